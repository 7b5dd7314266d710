#!/usr/bin/env bash
# Makes the Dockerfile's base image locally when no registry can be reached: a Debian
# bookworm minbase rootfs from debootstrap with python3 and python3-venv, imported into
# podman under the exact name the Dockerfile's `ARG BASE_IMAGE` default names
# (python:3.11-slim-bookworm). The Dockerfile uses only what both this image and the real
# one have: python3 on PATH with the venv module, useradd, a POSIX shell.
#
# Skips everything when the image already exists (a real one pulled from a registry
# included); the rootfs tarball is cached under ${OMNIRAIL_CACHE:-~/.cache/omnirail}.
#   scripts/container/base_image.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/../.."

force=0
[[ ${1:-} == --force ]] && force=1
say() { echo "[base_image.sh] $*" >&2; }

name=$(sed -n 's/^ARG BASE_IMAGE=\(.*\)$/\1/p' Dockerfile | head -1)
name=${name:-python:3.11-slim-bookworm}
# Short names resolve to docker.io/library/NAME; tag the same so FROM finds it locally.
[[ $name == */* ]] || name="docker.io/library/$name"

if ((!force)) && podman image exists "$name"; then
  say "$name exists; nothing to do"
  exit 0
fi

suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# Run-time needs only: the interpreter, venv for the build stages, CA roots for users who
# install from an index. Everything else comes from the wheelhouse.
include=python3,python3-venv,ca-certificates
cache=${OMNIRAIL_CACHE:-$HOME/.cache/omnirail}/base
key=$(echo "$suite $mirror $include v1" | sha256sum | cut -c1-12)
tarball="$cache/rootfs-$suite-$key.tar.gz"
mkdir -p "$cache"

if ((force)) || [[ ! -f $tarball ]]; then
  command -v debootstrap >/dev/null || scripts/container/podman.sh >/dev/null
  root=$(mktemp -d /var/tmp/ctr_rootfs.XXXXXX)
  # Unmounts what the chroot steps mounted, then removes the tree, on any exit.
  cleanup() {
    umount -R "$root/proc" 2>/dev/null || true
    rm -rf --one-file-system "$root"
  }
  trap cleanup EXIT
  say "debootstrap $suite (minbase + $include) into $root"
  debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$root.log" 2>&1 ||
    { tail -30 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  # Same apt sources as the official images, so a build can `apt-get install` more.
  cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
SOURCES
  # Like the slim images: no docs, man pages or locales from later installs.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
DPKG
  # Security and point-release updates, then drop every cache and list.
  mount -t proc proc "$root/proc"
  chroot "$root" /bin/sh -c 'export DEBIAN_FRONTEND=noninteractive;
    apt-get update -q && apt-get upgrade -y -q && apt-get clean' >"$root.log" 2>&1 ||
    { tail -30 "$root.log" >&2; exit 1; }
  umount "$root/proc"
  rm -f "$root.log"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/tmp/* "$root"/root/.cache
  find "$root/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  tar --numeric-owner -C "$root" -czf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  say "cached $tarball ($(du -h "$tarball" | cut -f1))"
fi

say "importing $tarball as $name"
podman import --quiet \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "debootstrap $suite minbase + $include (omnirail scripts/container/base_image.sh)" \
  "$tarball" "$name" >/dev/null
say "$name: $(podman image inspect --format '{{.Size}}' "$name" | numfmt --to=iec)"

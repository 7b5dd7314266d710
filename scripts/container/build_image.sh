#!/usr/bin/env bash
# Builds the omnirail image (default tag omnirail:latest) with podman, offline: sets up
# podman, makes the base image and the wheelhouse when missing or stale, then builds with
# --network=none so nothing inside the build can reach an index (--format=docker: the OCI
# format drops HEALTHCHECK). podman's layer cache makes a rebuild after a source change
# redo only omnirail's own layers (about 30 s; the dependency layers are reused).
#   scripts/container/build_image.sh [extra podman build args, e.g. --build-arg EXTRAS=]
# Env: OMNIRAIL_IMAGE (tag, default omnirail:latest), OMNIRAIL_FORCE_BUILD=1 (build even
# when the inputs are unchanged).
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${OMNIRAIL_IMAGE:-omnirail:latest}
say() { echo "[build_image.sh] $*" >&2; }
timed() { # LABEL CMD...: runs CMD, reports its wall time
  local label=$1 start=$SECONDS
  shift
  "$@"
  say "$label: $((SECONDS - start)) s"
}

total=$SECONDS
timed "podman set-up" scripts/container/podman.sh >/dev/null
timed "base image" scripts/container/base_image.sh
timed "wheelhouse" scripts/container/wheelhouse.sh

# Even a fully cached build takes ~30 s here (buildah hashes the 1.5 GB venv to check the
# cache of COPY --from): skip it when nothing that goes into the image changed.
base=$(sed -n 's/^ARG BASE_IMAGE=\(.*\)$/\1/p' Dockerfile | head -1)
key=$({
  cat Dockerfile .dockerignore scripts/container/pip_install.sh .wheelhouse/.stamp-*
  podman image inspect --format '{{.Id}}' "$base"
  printf '%s\n' "$@"
} | sha256sum | cut -c1-16)
if [[ -z ${OMNIRAIL_FORCE_BUILD:-} ]] &&
  [[ $(podman image inspect --format '{{index .Labels "org.omnirail.build-key"}}' "$image" 2>/dev/null) == "$key" ]]; then
  say "$image is up to date (build key $key); OMNIRAIL_FORCE_BUILD=1 rebuilds"
else
  timed "image build" podman build --network=none --layers --pull=never --format=docker \
    --label "org.omnirail.build-key=$key" -t "$image" -f Dockerfile "$@" .
fi
# podman stores `-t omnirail:latest` as localhost/omnirail:latest, while a build through the
# Docker API (docker-compose build) tags docker.io/library/omnirail:latest, and lookups of
# the short name prefer localhost/. Both names get this build, so neither is stale.
registry=${image%%/*}
if [[ $image != */* ]]; then
  podman tag "$image" "docker.io/library/$image"
elif [[ $registry != *.* && $registry != *:* && $registry != localhost ]]; then
  podman tag "$image" "docker.io/$image"
fi
say "$image: $(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec), \
total $((SECONDS - total)) s"

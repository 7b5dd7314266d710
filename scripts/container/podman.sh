#!/usr/bin/env bash
# Sets up podman as the container engine for the compose tests and CI (this machine has no
# Docker engine): installs the Debian packages, writes the engine and storage settings this
# kernel/cgroup setup needs, and starts a Docker-compatible API socket for docker-compose.
# Idempotent: safe to run again; a running service is left alone.
#
#   eval "$(scripts/container/podman.sh)"     # sets DOCKER_HOST for this shell
#   scripts/container/podman.sh --stop        # stops the API service this script started
#
# Progress goes to stderr; the only stdout line is `export DOCKER_HOST=...`.
set -euo pipefail

RUN_DIR=${OMNIRAIL_PODMAN_RUN_DIR:-/run/omnirail}
SOCK="$RUN_DIR/podman.sock"
PID_FILE="$RUN_DIR/podman.pid"
LOG_FILE="$RUN_DIR/podman-service.log"
MARK="# written by omnirail scripts/container/podman.sh"

say() { echo "[podman.sh] $*" >&2; }

# The service we started, if it is still that process (a recycled pid is not ours).
service_pid() {
  local pid
  [[ -f $PID_FILE ]] || return 1
  pid=$(<"$PID_FILE")
  [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "system service" || return 1
  echo "$pid"
}

answers() { curl -sf --max-time 5 --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; }

if [[ ${1:-} == --stop ]]; then
  if pid=$(service_pid); then
    kill "$pid"
    for _ in $(seq 50); do [[ -d /proc/$pid ]] || break; sleep 0.1; done
    say "stopped podman API service (pid $pid)"
  fi
  rm -f "$PID_FILE"
  exit 0
fi

# ---- packages ------------------------------------------------------------------------
# runc: crun fails on this machine's cgroup v1 hybrid setup. netavark + aardvark-dns:
# networks with service-name DNS (compose). iptables: published ports. uidmap, slirp4netns,
# fuse-overlayfs, catatonit: rootless use and `init: true`. debootstrap: the base image.
packages=(podman docker-compose runc netavark aardvark-dns iptables uidmap slirp4netns
  fuse-overlayfs catatonit debootstrap curl ca-certificates)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---- engine settings -----------------------------------------------------------------
mkdir -p /etc/containers "$RUN_DIR"
changed=0
# Our files are rewritten each run; someone else's is kept once as *.orig.
write_conf() {
  local path=$1 body=$2
  if [[ -f $path ]] && ! grep -qF "$MARK" "$path" && [[ ! -f $path.orig ]]; then
    cp "$path" "$path.orig"
  fi
  local new="$MARK"$'\n'"$body"
  if [[ ! -f $path ]] || [[ $(<"$path") != "$new" ]]; then
    printf '%s\n' "$new" >"$path"
    say "wrote $path"
    changed=1
  fi
}

# Containers may not ask for more than the hard limits of the podman process that starts
# them: without CAP_SYS_RESOURCE (this sandbox drops it) runc cannot raise them, and podman's
# defaults (1048576 files) fail with "error setting rlimit type 7: operation not permitted".
# podman also lowers its own nproc hard limit (32768 here, below `ulimit -Hu`), so a short
# probe service reports the limits a real one will have.
hard_limit() { # NAME from /proc/PID/limits, e.g. "Max processes"
  awk -v n="$2" 'index($0, n) == 1 { print $(NF - 1) }' "/proc/$1/limits" 2>/dev/null || true
}
min_limit() { if [[ $1 == unlimited ]]; then echo "$2"; elif [[ $2 == unlimited ]] || (($1 < $2)); then echo "$1"; else echo "$2"; fi; }
probe_sock="$RUN_DIR/ctr_probe.$$.sock"
podman system service --time=0 "unix://$probe_sock" >/dev/null 2>&1 </dev/null &
probe=$!
for _ in $(seq 100); do [[ -S $probe_sock ]] && break; sleep 0.1; done
podman_nofile=$(hard_limit $probe "Max open files")
podman_nproc=$(hard_limit $probe "Max processes")
kill $probe 2>/dev/null || true
wait $probe 2>/dev/null || true
rm -f "$probe_sock"
nofile=$(min_limit "$(ulimit -Hn)" "${podman_nofile:-unlimited}")
nproc=$(min_limit "$(ulimit -Hu)" "${podman_nproc:-unlimited}")
[[ $nofile == unlimited ]] && nofile=1048576
[[ $nproc == unlimited ]] && nproc=4194304
write_conf /etc/containers/containers.conf "[containers]
default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]

[engine]
runtime = \"runc\"
# No systemd here: plain cgroupfs and a file event log.
cgroup_manager = \"cgroupfs\"
events_logger = \"file\"

[network]
network_backend = \"netavark\""

# Storage: overlay when the kernel mounts it on this filesystem, else vfs (full copies per
# layer: slow and large). Decided once: changing drivers would orphan existing images.
storage_conf=/etc/containers/storage.conf
if [[ -f $storage_conf ]] && grep -qF "$MARK" "$storage_conf"; then
  driver=$(sed -n 's/^driver = "\(.*\)"/\1/p' "$storage_conf")
else
  probe=$(mktemp -d /var/tmp/ctr_overlay_probe.XXXXXX)
  mkdir -p "$probe"/{lower,upper,work,merged}
  echo lower >"$probe/lower/f"
  driver=vfs
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
    "$probe/merged" 2>/dev/null; then
    echo upper >"$probe/merged/f" && [[ $(<"$probe/upper/f") == upper ]] && driver=overlay
    umount "$probe/merged"
  fi
  rm -rf "$probe"
  if [[ -f $storage_conf ]] && ! grep -qF "$MARK" "$storage_conf"; then
    say "keeping existing $storage_conf"
    driver=$(sed -n 's/^driver = "\(.*\)"/\1/p' "$storage_conf")
  else
    write_conf "$storage_conf" "[storage]
driver = \"$driver\"
runroot = \"/run/containers/storage\"
graphroot = \"/var/lib/containers/storage\""
  fi
fi
say "storage driver: ${driver:-default}"

# ---- API service ---------------------------------------------------------------------
# The service reads the settings once: restart ours when they changed.
if ((changed)) && pid=$(service_pid); then
  say "settings changed: restarting the API service"
  "$0" --stop
fi
if pid=$(service_pid) && answers; then
  say "podman API service already running (pid $pid)"
elif answers; then
  say "$SOCK already answers (not started by this script)"
else
  rm -f "$SOCK"
  # setsid + nohup: the service outlives this script and the shell that ran it.
  setsid nohup podman system service --time=0 "unix://$SOCK" >>"$LOG_FILE" 2>&1 </dev/null &
  echo $! >"$PID_FILE"
  for _ in $(seq 100); do
    answers && break
    kill -0 "$(<"$PID_FILE")" 2>/dev/null || { tail -20 "$LOG_FILE" >&2; exit 1; }
    sleep 0.1
  done
  answers || { say "podman API service did not answer on $SOCK"; tail -20 "$LOG_FILE" >&2; exit 1; }
  say "started podman API service (pid $(<"$PID_FILE"), log $LOG_FILE)"
fi

echo "export DOCKER_HOST=unix://$SOCK"

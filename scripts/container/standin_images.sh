#!/usr/bin/env bash
# Stand-ins for the Prometheus and Jaeger images, for tests on machines that cannot pull
# (no image registry here). Each is tagged under the names compose files use, so a compose
# file naming prom/prometheus:vX or jaegertracing/all-in-one:X runs unchanged:
#  - Prometheus: Debian bookworm's `prometheus` package (2.42), laid out like the official
#    image: /bin/prometheus, /etc/prometheus/prometheus.yml, data in /prometheus, user
#    nobody, port 9090, ENTRYPOINT /bin/prometheus with the official default CMD. The .deb
#    is fetched on the host (apt-get download) so the build itself is offline.
#  - Jaeger: not packaged in Debian. A small OTLP/gRPC receiver on 4317 that keeps spans in
#    memory and serves them on 16686 in the JSON of Jaeger's query API (/api/services,
#    /api/traces?service=X, /api/traces/ID); see scripts/container/jaeger_standin.py.
#    It is built FROM omnirail:latest (scripts/container/build_image.sh) for grpcio and
#    the OTLP protos; it is no Jaeger: no UI, no storage, no sampling strategies.
# Tags: every prom/prometheus and jaegertracing/all-in-one image named in ./docker-compose.yml
# plus $STANDIN_PROMETHEUS_TAGS / $STANDIN_JAEGER_TAGS (space-separated). A tag that holds a
# real (pulled) image is left alone.
#   scripts/container/standin_images.sh [prometheus] [jaeger]     (default: both)
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { echo "[standin_images.sh] $*" >&2; }
cache=${OMNIRAIL_CACHE:-$HOME/.cache/omnirail}/standin
base=$(sed -n 's/^ARG BASE_IMAGE=\(.*\)$/\1/p' Dockerfile | head -1)
omnirail_image=${OMNIRAIL_IMAGE:-omnirail:latest}
want=("$@")
((${#want[@]})) || want=(prometheus jaeger)

# Image names of this kind in the top-level compose file (what the e2e test runs).
compose_images() {
  [[ -f docker-compose.yml ]] || return 0
  sed -n "s#^[[:space:]]*image:[[:space:]]*['\"]\{0,1\}\($1[^'\"[:space:]]*\).*#\1#p" \
    docker-compose.yml | sort -u
}

# What a Docker client means by NAME: prom/prometheus:X is docker.io/prom/prometheus:X
# (podman would store a bare `podman tag` under localhost/, which compose does not find).
qualify() {
  local first=${1%%/*}
  if [[ $1 != */* ]]; then
    echo "docker.io/library/$1"
  elif [[ $first == *.* || $first == *:* || $first == localhost ]]; then
    echo "$1"
  else
    echo "docker.io/$1"
  fi
}

# Tags SOURCE as each of the remaining names, unless a name holds a non-stand-in image.
tag_all() {
  local src=$1 kind=$2 name label
  shift 2
  for name in "$@"; do
    name=$(qualify "$name")
    if podman image exists "$name"; then
      label=$(podman image inspect --format '{{index .Labels "org.omnirail.standin"}}' "$name")
      if [[ $label != "$kind" ]]; then
        say "$name exists and is not a stand-in: left alone"
        continue
      fi
    fi
    podman tag "$src" "$name"
    say "tagged $name"
  done
}

# Quiet, offline, docker format (HEALTHCHECK kept) builds; podman's layer cache makes a
# repeat build instant.
build() { podman build --quiet --network=none --layers --pull=never --format=docker "$@" >/dev/null; }

prometheus() {
  local deb ctx version tags
  mkdir -p "$cache/prometheus"
  deb=$(find "$cache/prometheus" -name "prometheus_*.deb" | sort | tail -1)
  if [[ -z $deb ]]; then
    command -v apt-get >/dev/null || { say "no apt-get: cannot fetch Debian's prometheus"; return 1; }
    say "apt-get download prometheus"
    # _apt cannot write into root's cache dir: download to a scratch dir it can use.
    local dl
    dl=$(mktemp -d /tmp/ctr_prom_dl.XXXXXX)
    chmod 777 "$dl"
    (cd "$dl" && apt-get download -q prometheus >/dev/null 2>&1) ||
      { apt-get update -q >/dev/null && (cd "$dl" && apt-get download -q prometheus >/dev/null); }
    mv "$dl"/prometheus_*.deb "$cache/prometheus/"
    rm -rf "$dl"
    deb=$(find "$cache/prometheus" -name "prometheus_*.deb" | sort | tail -1)
  fi
  version=$(dpkg-deb -f "$deb" Version)
  ctx=$(mktemp -d /tmp/ctr_prom_ctx.XXXXXX)
  trap 'rm -rf "$ctx"' RETURN
  dpkg-deb -x "$deb" "$ctx/root"
  mkdir -p "$ctx/rootfs/usr/bin" "$ctx/rootfs/usr/share/prometheus" "$ctx/rootfs/etc/prometheus"
  cp "$ctx"/root/usr/bin/{prometheus,promtool} "$ctx/rootfs/usr/bin/"
  cp -a "$ctx/root/usr/share/prometheus/web" "$ctx/rootfs/usr/share/prometheus/"
  # The official image's default config: Prometheus scraping itself.
  cat >"$ctx/rootfs/etc/prometheus/prometheus.yml" <<'YAML'
global:
  scrape_interval: 15s
  evaluation_interval: 15s
scrape_configs:
  - job_name: prometheus
    static_configs:
      - targets: ["localhost:9090"]
YAML
  cat >"$ctx/Containerfile" <<EOF2
FROM $base
LABEL org.omnirail.standin=prometheus org.omnirail.standin.source="debian prometheus $version"
COPY rootfs/ /
# /bin is /usr/bin on bookworm (merged /usr); the link covers a base where it is not.
RUN test -x /bin/prometheus || ln -s /usr/bin/prometheus /usr/bin/promtool /bin/ \\
 && mkdir -p /prometheus && chown -R 65534:65534 /prometheus /etc/prometheus
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF2
  build -t "localhost/omnirail-standin/prometheus:latest" "$ctx"
  say "prometheus stand-in built from Debian's $version"
  # shellcheck disable=SC2086
  tags=$( (compose_images prom/prometheus; printf '%s\n' ${STANDIN_PROMETHEUS_TAGS:-prom/prometheus:v2.55.1 prom/prometheus:v3.1.0}) | sort -u)
  # shellcheck disable=SC2086
  tag_all localhost/omnirail-standin/prometheus:latest prometheus $tags
}

jaeger() {
  local tags
  if ! podman image exists "$omnirail_image"; then
    say "$omnirail_image not found: run scripts/container/build_image.sh first"
    return 1
  fi
  build -t localhost/omnirail-standin/jaeger:latest --build-arg "BASE=$omnirail_image" \
    -f - scripts/container <<'EOF2'
ARG BASE
FROM ${BASE}
LABEL org.omnirail.standin=jaeger
COPY jaeger_standin.py /opt/standin/jaeger_standin.py
EXPOSE 4317 16686
HEALTHCHECK --interval=10s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:16686/api/services', timeout=4)"]
ENTRYPOINT ["python", "/opt/standin/jaeger_standin.py"]
CMD []
EOF2
  say "jaeger stand-in built on $omnirail_image"
  # shellcheck disable=SC2086
  tags=$( (compose_images jaegertracing/all-in-one; printf '%s\n' ${STANDIN_JAEGER_TAGS:-jaegertracing/all-in-one:1.62.0}) | sort -u)
  # shellcheck disable=SC2086
  tag_all localhost/omnirail-standin/jaeger:latest jaeger $tags
}

scripts/container/podman.sh >/dev/null
scripts/container/base_image.sh
for kind in "${want[@]}"; do
  case $kind in
  prometheus | jaeger) "$kind" ;;
  *) say "unknown stand-in $kind (prometheus, jaeger)"; exit 2 ;;
  esac
done

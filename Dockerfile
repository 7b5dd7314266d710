# The omnirail service image: one image for the coordinator and every stage.
#   omnirail:latest coordinator --pipeline examples/quickstart/pipeline.yaml --listen 0.0.0.0:50051
#   omnirail:latest stage --pipeline ... --stage NAME --coordinator coordinator:50051 \
#       --listen 0.0.0.0:50051 --advertise NAME:50051 --metrics-host 0.0.0.0 --metrics-port 9464
#
# Build args:
#   BASE_IMAGE  python:3.11-slim-bookworm (scripts/container/base_image.sh makes a local one)
#   EXTRAS      omnirail extras to install, comma-separated ("" for none). The default,
#               nixl,ucx,hf, has the cross-host relays and transformers + pillow (about
#               200 MB), which the shipped omnirail/models/qwen3_omni and omni_demo's hf_thinker
#               import; the coordinator imports the factories too. scripts/container/
#               wheelhouse.sh takes its default from this line.
#   TORCH       cpu (torch from the PyTorch CPU index) or cuda (torch from PyPI); used only
#               when installing from the network
#   WHEELHOUSE  auto: install offline (pip --no-index) from .wheelhouse/ in the build
#               context when it holds wheels (scripts/container/wheelhouse.sh makes it),
#               else from the network; yes: require it; no: ignore it
# The wheelhouse is only bind-mounted into RUN steps of the build stages (deps, app): it is
# in no layer of the final image, which gets the venv, the examples and nothing else.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS deps
ARG EXTRAS=nixl,ucx,hf
ARG TORCH=cpu
ARG WHEELHOUSE=auto
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_NO_INPUT=1
RUN python3 -m venv /opt/omnirail
WORKDIR /src
# Shared by both install steps: which pip to run, from the wheelhouse or from indexes.
# (buildah does not rerun a RUN when only bind-mounted files change, so each step's inputs
# are COPYed first: they are its cache key.)
COPY scripts/container/pip_install.sh /usr/local/bin/omnirail-pip-install
# Dependencies: this layer is reused until the pins or the extras change.
COPY pyproject.toml constraints.txt ./
RUN --mount=type=bind,source=.,target=/ctx \
    omnirail-pip-install deps

# omnirail itself, --no-deps on top of them; /out gets its files alone.
FROM deps AS app
COPY README.md ./
COPY omnirail ./omnirail
COPY coordinator ./coordinator
COPY stage_service ./stage_service
COPY relay ./relay
RUN --mount=type=bind,source=.,target=/ctx \
    omnirail-pip-install omnirail

FROM ${BASE_IMAGE}
# A fixed non-root uid/gid so volume permissions and runAsUser can be set ahead of time.
RUN groupadd --gid 10001 omnirail \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/omnirail \
      --shell /bin/sh omnirail
# Two layers: the dependencies (reused until the pins change), then omnirail's own files.
COPY --from=deps /opt/omnirail /opt/omnirail
COPY --from=app /out/ /
WORKDIR /app
# Pipeline files and their toy models: `--pipeline examples/quickstart/pipeline.yaml`.
COPY examples ./examples
ENV PATH=/opt/omnirail/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMNIRAIL_HEALTH_ADDRESS=localhost:50051
USER 10001:10001
EXPOSE 50051 9464
# grpc.health.v1 of the service in this container; OMNIRAIL_HEALTH_ADDRESS and
# OMNIRAIL_HEALTH_SERVICE (default "": the process serves) say what to ask.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["omnirail", "health"]
ENTRYPOINT ["omnirail"]
CMD ["--help"]

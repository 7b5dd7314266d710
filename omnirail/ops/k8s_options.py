"""What `omnirail k8s` is asked for (`K8sOptions`), checked before anything is generated:
names the API server would refuse (a namespace, a claim) and an OTLP endpoint the services
could not dial are refused here, naming the flag, rather than in `kubectl apply` or in
every pod's start-up."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from omnirail.ops.compose_edges import EdgeRelay
from omnirail.ops.compose_groups import DNS_LABEL, ComposeError

IMAGE = "omnirail:latest"
# RFC 1123 subdomain (claim names): labels joined by dots.
_DNS_SUBDOMAIN = re.compile(rf"{DNS_LABEL.pattern}(\.{DNS_LABEL.pattern})*")
# A container image reference: no whitespace or control characters (the registry judges
# the rest).
_IMAGE = re.compile(r"[^\s\x00-\x1f\x7f]{1,4096}")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|[kMGTPE])?")


@dataclass(frozen=True)
class K8sOptions:
    image: str = IMAGE
    namespace: str | None = None
    # A PersistentVolumeClaim holding the model directory the stages read (mounted
    # read-only at /model; the pipeline's model paths point there).
    model_claim: str | None = None
    otlp_endpoint: str | None = None
    service_monitor: bool = False
    gpus_per_node: int | None = None
    tls_dir: Path | None = None
    tokens_file: Path | None = None
    resolve: bool = True
    edge_relays: tuple[EdgeRelay, ...] = ()
    memory_request: str = "1Gi"
    # What names the pipeline in the header's command when it is not the pipeline file: a
    # checkpoint directory and its --set flags (`omnirail k8s MODEL_DIR`).
    source_args: tuple[str, ...] = ()

    def check(self) -> None:
        """Raises ComposeError naming the first option Kubernetes or the services would
        refuse."""
        if self.namespace is not None and not DNS_LABEL.fullmatch(self.namespace):
            raise ComposeError(
                f"--namespace {self.namespace!r}: not a namespace name (lower-case letters, "
                "digits and inner '-', at most 63)"
            )
        claim = self.model_claim
        if claim is not None and (len(claim) > 253 or not _DNS_SUBDOMAIN.fullmatch(claim)):
            raise ComposeError(
                f"--model-claim {claim!r}: not a PersistentVolumeClaim name (lower-case "
                "letters, digits, inner '-' and '.', at most 253)"
            )
        if self.otlp_endpoint is not None:
            _check_otlp_endpoint(self.otlp_endpoint)
        if not _IMAGE.fullmatch(self.image):
            raise ComposeError(f"--image {self.image!r}: not an image reference")
        if not _QUANTITY.fullmatch(self.memory_request):
            raise ComposeError(
                f"memory_request {self.memory_request!r}: not a quantity (e.g. 512Mi, 2Gi)"
            )
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ComposeError(f"--gpus-per-node {self.gpus_per_node}: must be at least 1")


def _check_otlp_endpoint(endpoint: str) -> None:
    """What the services' exporter dials (OTLP over gRPC): http(s)://host:port or
    host:port."""
    text = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        parsed = urllib.parse.urlsplit(text)
        port = parsed.port
    except ValueError as exc:
        raise ComposeError(f"--otlp-endpoint {endpoint!r}: {exc}") from None
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or port is None
        or parsed.path not in ("", "/")
        or any(c.isspace() for c in endpoint)
    ):
        raise ComposeError(
            f"--otlp-endpoint {endpoint!r}: expected host:port or http(s)://host:port "
            "(a collector's OTLP gRPC port, usually 4317)"
        )

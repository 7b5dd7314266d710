"""`omnirail k8s`: Kubernetes manifests for a pipeline (omnirail.ops.k8s)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def cmd_k8s(args: argparse.Namespace) -> int:
    from omnirail.ops.compose_edges import EdgeRelay
    from omnirail.ops.k8s import K8sOptions, generate, write_bundle

    options = K8sOptions(
        image=args.image,
        namespace=args.namespace,
        model_claim=args.model_claim,
        otlp_endpoint=args.otlp_endpoint,
        service_monitor=args.service_monitor,
        gpus_per_node=args.gpus_per_node,
        tls_dir=Path(args.tls) if args.tls else None,
        tokens_file=Path(args.tokens_file) if args.tokens_file else None,
        resolve=not args.no_resolve,
        edge_relays=tuple(EdgeRelay.parse(e) for e in args.edge_relay),
    )
    bundle = generate(args.file, options, Path(args.output))
    for path in write_bundle(bundle, Path(args.output)):
        print(f"[omnirail] wrote {path}", file=sys.stderr)
    return 0


def add_k8s_parser(sub: Any) -> None:
    from omnirail.ops.k8s import IMAGE

    k = sub.add_parser("k8s", help="write Kubernetes manifests for a pipeline")
    k.add_argument("file", help="pipeline YAML")
    k.add_argument("-o", "--output", required=True, help="directory for the manifests")
    k.add_argument("--image", default=IMAGE, help="default: %(default)s")
    k.add_argument("--namespace", default=None, help="metadata.namespace of every object")
    k.add_argument(
        "--model-claim",
        default=None,
        metavar="CLAIM",
        help="a PersistentVolumeClaim holding the model directory the stages read",
    )
    k.add_argument("--otlp-endpoint", default=None, help="OTEL_EXPORTER_OTLP_ENDPOINT for all")
    k.add_argument(
        "--service-monitor",
        action="store_true",
        help="also a ServiceMonitor (prometheus-operator) besides the scrape annotations",
    )
    k.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help="refuse a pod that needs more GPUs than a node of this type has",
    )
    k.add_argument("--tls", default=None, metavar="DIR", help="mesh TLS material (made if absent)")
    k.add_argument("--tokens-file", default=None, metavar="FILE", help="client bearer tokens")
    k.add_argument(
        "--edge-relay",
        action="append",
        default=[],
        metavar="SRC->DST=BACKEND",
        help="send this edge over BACKEND in a derived pipeline, repeatable",
    )
    k.add_argument("--no-resolve", action="store_true", help="do not import the pipeline's modules")
    k.set_defaults(fn=cmd_k8s)

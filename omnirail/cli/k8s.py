"""`omnirail k8s`: Kubernetes manifests for a pipeline (omnirail.ops.k8s).

FILE is a pipeline file, or a checkpoint directory as `omnirail serve` takes one
(`omnirail.cli.model_dir`): the installed pipeline of its architecture, pointed at it with
the `--set`s applied, goes into the pipeline's ConfigMap alone (the model code is in the
image), and the stages that read the checkpoint mount `--model-claim` at /model, the
claim holding that directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from omnirail.cli.model_dir import add_set_flag, pipeline_source, source_args


def cmd_k8s(args: argparse.Namespace) -> int:
    from omnirail.ops.k8s import generate, write_bundle

    source = pipeline_source(args.file, args.set, None, imports=not args.no_resolve)
    with source as (pipeline, resolved):
        named = source_args(args.file, args.set, Path.cwd()) if resolved is not None else ()
        bundle = generate(pipeline, _options(args, named), Path(args.output))
    for path in write_bundle(bundle, Path(args.output)):
        print(f"[omnirail] wrote {path}", file=sys.stderr)
    return 0


def _options(args: argparse.Namespace, named: tuple[str, ...]) -> Any:
    from omnirail.ops.compose_edges import EdgeRelay
    from omnirail.ops.k8s import K8sOptions

    return K8sOptions(
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
        source_args=named,
    )


def add_k8s_parser(sub: Any) -> None:
    from omnirail.ops.k8s import IMAGE

    k = sub.add_parser("k8s", help="write Kubernetes manifests for a pipeline")
    k.add_argument(
        "file",
        metavar="FILE|MODEL_DIR",
        help="pipeline YAML, or a checkpoint directory (as `omnirail serve` takes; with "
        "--model-claim, the claim holding it)",
    )
    k.add_argument("-o", "--output", required=True, help="directory for the manifests")
    add_set_flag(k, "; with a checkpoint directory")
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

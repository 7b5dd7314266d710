"""`omnirail compose`: its arguments and the command (see omnirail.ops.compose).

FILE is a pipeline file, or a checkpoint directory as `omnirail serve` takes one
(`omnirail.cli.model_dir`): the installed pipeline of its architecture, pointed at it with
the `--set`s applied, is written to `<model>/pipeline.yaml` beside the compose file (its
directory is what the services mount at /pipeline; the model code is in the image) and the
checkpoint is bind-mounted read-only at /model into the stages that read it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from omnirail.cli.model_dir import add_set_flag, pipeline_source, source_args
from omnirail.ops import compose as _compose


def cmd_compose(args: argparse.Namespace) -> int:
    from omnirail.ops.compose import default_build_context, generate, write_bundle

    if args.build_context is None:
        context = default_build_context()
    else:
        context = None if args.build_context == "none" else Path(args.build_context).resolve()
    output = Path(args.output) if args.output else None
    # Relative paths in the compose file (and its command) start at its directory.
    base = Path.cwd() if output is None else output.resolve().parent
    source = pipeline_source(args.file, args.set, base, imports=not args.no_resolve)
    with source as (pipeline, resolved):
        named = source_args(args.file, args.set, base) if resolved is not None else ()
        options = _options(args, context, named)
        bundle = generate(pipeline, output, options)
        for path in write_bundle(bundle):
            print(f"[omnirail] wrote {path}", file=sys.stderr)
    if bundle.output is None:
        sys.stdout.write(bundle.text)
    return 0


def _options(args: argparse.Namespace, context: Path | None, named: tuple[str, ...]) -> Any:
    from omnirail.ops.compose import ComposeOptions, EdgeRelay, ModelDir

    return ComposeOptions(
        image=args.image,
        jaeger_image=args.jaeger_image,
        prometheus_image=args.prometheus_image,
        coordinator_port=args.coordinator_port,
        http_port=args.http_port,
        depends_condition=args.depends_condition,
        edge_relays=tuple(EdgeRelay.parse(e) for e in args.edge_relay),
        build_context=context,
        resolve=not args.no_resolve,
        model_dirs=tuple(ModelDir.parse(d) for d in args.model_dir),
        check_model_dirs=not args.no_check_model_dir,
        tls_dir=Path(args.tls) if args.tls else None,
        tokens_file=Path(args.tokens_file) if args.tokens_file else None,
        source_args=named,
    )


def add_compose_parser(sub: Any) -> None:
    """Adds `compose` to the CLI's subcommands (`sub`, from add_subparsers)."""
    k = sub.add_parser("compose", help="write a docker compose deployment of a pipeline")
    k.add_argument(
        "file",
        metavar="FILE|MODEL_DIR",
        help="pipeline YAML (or .py), or a checkpoint directory (as `omnirail serve` takes): "
        "its installed pipeline is written to MODEL/pipeline.yaml beside the compose file",
    )
    k.add_argument("-o", "--output", default=None, help="compose file (default: stdout)")
    add_set_flag(k, "; with a checkpoint directory")
    k.add_argument(
        "--edge-relay",
        action="append",
        default=[],
        metavar="SRC->DST=BACKEND",
        help="send this edge over BACKEND (e.g. ucx) in a derived pipeline, repeatable",
    )
    k.add_argument(
        "--coordinator-port",
        type=int,
        default=_compose.GRPC_PORT,
        help="host port the coordinator is published on (default: %(default)s)",
    )
    k.add_argument(
        "--http-port",
        type=int,
        default=_compose.HTTP_PORT,
        help="host port of the OpenAI gateway, for pipelines with api.openai (0: no gateway; "
        "default: %(default)s)",
    )
    for name, image in [
        ("image", _compose.IMAGE),
        ("jaeger-image", _compose.JAEGER_IMAGE),
        ("prometheus-image", _compose.PROMETHEUS_IMAGE),
    ]:
        k.add_argument(f"--{name}", default=image, help="default: %(default)s")
    k.add_argument(
        "--depends-condition",
        choices=["service_started", "service_healthy"],
        default="service_started",
        help="what stages wait for of the coordinator (they retry attaching anyway)",
    )
    k.add_argument(
        "--build-context",
        default=None,
        help="directory with the Dockerfile, or 'none' (default: this checkout, if it has one)",
    )
    k.add_argument(
        "--no-resolve", action="store_true", help="do not import factories while validating"
    )
    k.add_argument(
        "--model-dir",
        action="append",
        default=[],
        metavar="[MODEL_PATH=]HOST_DIR",
        help=f"host directory mounted read-only at {_compose.MODEL_MOUNT} for the pipeline's "
        "model_path (MODEL_PATH= names which, as written, when stages read several); "
        "default: model_path itself, relative to the pipeline's directory",
    )
    k.add_argument(
        "--no-check-model-dir",
        action="store_true",
        help="do not require the model directories to exist here (they will where compose runs)",
    )
    k.add_argument(
        "--tls",
        default=None,
        metavar="DIR",
        help="TLS on every hop (mutual inside the mesh) and a mesh secret: the material in "
        "DIR, made there (a throwaway CA naming every service) when DIR holds none; mounted "
        "read-only into every omnirail service",
    )
    k.add_argument(
        "--tokens-file",
        default=None,
        metavar="FILE",
        help="with --tls: bearer tokens the coordinator's client API accepts, one per line",
    )
    k.set_defaults(fn=cmd_compose)

"""The `omnirail` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from omnirail.cli.args import port_number, progress, read_inputs, seconds, wake_us
from omnirail.cli.lifecycle import cmd_down, cmd_up, exit_now
from omnirail.cli.model_dir import add_set_flag
from omnirail.cli.security import (
    add_client_flags,
    add_mesh_flags,
    client_options,
    mesh_env,
)
from omnirail.cli.serve import cmd_serve
from omnirail.config import ConfigError, PipelineConfig, format_topology, load_pipeline
from omnirail.tuning import aio
from omnirail.tuning.cpu_latency import hold_or_warn
from omnirail.tuning.cpus import parse_cpus, pin_process
from omnirail.wire.errors import Code, OmniError

EXIT_USAGE = 2


def _setup_logging(level: str) -> None:
    from omnirail.telemetry.logs import setup_logging

    setup_logging(level)


# ---- commands ------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_pipeline(args.file)
    print(format_topology(cfg))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from omnirail.client.jsonio import dumps
    from omnirail.ops.launcher import Mesh

    inputs = read_inputs(args)
    with Mesh(
        args.file,
        transport="tcp" if args.tcp else None,
        progress=progress(args.quiet),
        pin=args.pin,
        cpu_wake_latency_us=args.cpu_wake_latency_us,
        env=mesh_env(args),
        tls=args.tls,
    ) as mesh:
        assert mesh.address is not None
        with mesh.client(tensors="numpy") as client:
            started = time.perf_counter()
            if args.stream:
                events = client.stream(inputs, timeout=args.timeout)
                result = _print_stream(events, started, args)
            else:
                result = client.generate(inputs, timeout=args.timeout)
            elapsed = time.perf_counter() - started
        progress(args.quiet)(f"request {result.request_id} took {elapsed * 1000:.1f} ms")
        print(dumps(result.outputs))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from omnirail.client.jsonio import dumps
    from omnirail.client.sdk import Client

    inputs = read_inputs(args)
    with Client(args.address, tensors="numpy", **client_options(args)) as client:
        options = {
            "request_id": args.request_id,
            "timeout": args.timeout,
            "traceparent": args.traceparent,
        }
        if args.stream:
            result = _print_stream(client.stream(inputs, **options), time.perf_counter(), args)
        else:
            result = client.generate(inputs, **options)
    print(dumps(result.outputs))
    return 0


def _print_stream(events: Iterator[Any], started: float, args: argparse.Namespace) -> Any:
    """Shows chunks as they arrive (see omnirail/stream_render.py); returns the result."""
    from omnirail.client.render import StreamRenderer
    from omnirail.client.sdk import Chunk

    render = StreamRenderer(started, audio_out=args.audio_out, jsonl=args.jsonl)
    try:
        for event in events:
            if isinstance(event, Chunk):
                render.chunk(event)
                continue
            render.close()
            if not getattr(args, "quiet", False):
                summary = render.summary(time.perf_counter() - started)
                print(f"[omnirail] {summary}", file=sys.stderr, flush=True)
            return event
    finally:
        render.close()
    raise OmniError(Code.INTERNAL, "the stream ended without a result")


def _pin(flag: str | None, configured: list[int] | None) -> None:
    """Pins this service process to `--cpus` or, without the flag, to its configured CPUs."""
    cpus = parse_cpus(flag) if flag else configured
    if cpus:
        pin_process(cpus)


def _wake_latency(flag: int | None, cfg: PipelineConfig, who: str) -> AbstractContextManager[Any]:
    """Holds the PM QoS request of `--cpu-wake-latency-us`, else the pipeline's, for the
    `with` block (a host that refuses it gets a warning in the log)."""
    us = flag if flag is not None else cfg.cpu_wake_latency_us
    return hold_or_warn(us, who) or nullcontext()


def cmd_coordinator(args: argparse.Namespace) -> int:
    from omnirail.coordinator.main import serve

    _setup_logging(args.log_level)
    cfg = load_pipeline(args.pipeline)
    _pin(args.cpus, cfg.coordinator_cpus)
    with _wake_latency(args.cpu_wake_latency_us, cfg, "coordinator"):
        aio.run(
            serve(
                cfg,
                args.listen,
                args.ready_file,
                metrics_host=args.metrics_host,
                metrics_port=args.metrics_port,
            )
        )
    exit_now(0)
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from omnirail.gateway.server import serve

    _setup_logging(args.log_level)
    cfg = load_pipeline(args.pipeline)
    aio.run(serve(cfg, args.coordinator, args.listen, args.ready_file))
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from omnirail.stage_service.main import serve

    _setup_logging(args.log_level)
    cfg = load_pipeline(args.pipeline)
    names = [s for s in args.stage.split(",") if s]
    known = cfg.stage_names
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"unknown stage {unknown[0]!r}" if unknown else "names no stage"
        raise ValueError(f"--stage {args.stage!r}: {what}; stages: {', '.join(known)}")
    _pin(args.cpus, cfg.process_cpus(names))
    listen = args.listen or f"{cfg.endpoints.host}:0"
    with _wake_latency(args.cpu_wake_latency_us, cfg, f"stage process {args.stage}"):
        aio.run(
            serve(
                cfg,
                names,
                coordinator=args.coordinator,
                listen=listen,
                advertise=args.advertise,
                shm_prefix=args.shm_prefix,
                metrics_host=args.metrics_host,
                metrics_port=args.metrics_port,
                tp_rank=args.tp_rank,
                tp_init=args.tp_init,
                heartbeat=args.heartbeat,
            )
        )
    exit_now(0)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from omnirail.ops.launcher import running_meshes
    from omnirail.telemetry.waterfall import run_trace

    if args.run_dir:
        missing = [d for d in args.run_dir if not Path(d).is_dir()]
        if missing:
            raise ValueError(f"--run-dir {missing[0]}: no such directory")
        dirs = [str(Path(d) / "spans") if (Path(d) / "spans").is_dir() else d for d in args.run_dir]
    else:
        states = running_meshes(args.name)
        dirs = [
            str(Path(str(st["run_dir"])) / "spans") for st in states.values() if "run_dir" in st
        ]
        if not dirs:
            raise ValueError("no running mesh to read spans from; pass --run-dir DIR")
    return run_trace(args.request_id, dirs, args.json)


def cmd_health(args: argparse.Namespace) -> int:
    from omnirail.ops.health import (
        HealthCheckError,
        check_health,
        default_address,
        default_service,
    )
    from omnirail.transport.security import MeshSecurity

    address = args.address or default_address()
    service = default_service() if args.service is None else args.service
    try:
        # TLS as the mesh's processes have it (OMNIRAIL_TLS_*, as compose sets them).
        security = MeshSecurity(None)
        check_health(address, service, timeout=args.timeout, security=security)
    except HealthCheckError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    return 0


# ---- parser --------------------------------------------------------------------

_WAKE_HELP = (
    "keep idle CPUs able to wake within this many µs while {what} runs (0: polling; a PM "
    "QoS request through /dev/cpu_dma_latency, needs root; default: the pipeline's "
    "cpu_wake_latency_us)"
)


def _add_wake_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--cpu-wake-latency-us",
        type=wake_us,
        default=None,
        metavar="US",
        help=_WAKE_HELP.format(what=what),
    )


_CPUS_HELP = 'pin the process to these CPUs, e.g. "0" or "0-3,6" (default: the pipeline\'s {what})'


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnirail", description="Serve multi-stage model pipelines.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="check a pipeline file and print its topology")
    v.add_argument("file")
    v.set_defaults(fn=cmd_validate)

    def mesh_flags(sp: argparse.ArgumentParser, file: bool = True) -> None:
        if file:
            sp.add_argument("file", help="pipeline YAML (or .py)")
        sp.add_argument("--tcp", action="store_true", help="TCP instead of Unix sockets")
        sp.add_argument("--quiet", action="store_true", help="no progress on stderr")
        sp.add_argument(
            "--pin",
            action="store_true",
            help="pin each process without configured cpus to one CPU, round-robin "
            "(lower latency when every stage runs one compute thread)",
        )
        _add_wake_flag(sp, "the mesh")
        add_mesh_flags(sp)

    def up_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", default=None)
        sp.add_argument(
            "--port", type=port_number, default=0, help="coordinator port with --tcp (0 picks one)"
        )
        sp.add_argument(
            "--detach", action="store_true", help="return once ready; stop with `omnirail down`"
        )
        sp.add_argument("--name", default=None, help="mesh name (default: the pipeline's name)")
        sp.add_argument(
            "--run-dir", default=None, help="sockets and logs (default: a new temp dir)"
        )
        sp.add_argument(
            "--http",
            default=None,
            metavar="HOST:PORT",
            help="also serve the OpenAI-compatible HTTP gateway there (the pipeline's api.openai)",
        )

    u = sub.add_parser("up", help="start the coordinator and every stage process")
    mesh_flags(u)
    up_flags(u)
    u.set_defaults(fn=cmd_up)

    sv = sub.add_parser(
        "serve",
        help="serve a checkpoint directory with the installed pipeline of its architecture",
        description="Reads MODEL_DIR/config.json, picks the installed pipeline that serves its "
        "architecture, points it at MODEL_DIR and runs it as `omnirail up` does.",
    )
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="a local checkpoint directory")
    mesh_flags(sv, file=False)
    up_flags(sv)
    add_set_flag(sv)
    sv.add_argument(
        "--print-pipeline",
        action="store_true",
        help="print the resolved pipeline YAML (to edit and run with `omnirail up`) and exit",
    )
    sv.set_defaults(fn=cmd_serve)

    d = sub.add_parser("down", help="stop a detached mesh")
    d.add_argument("--name", default=None)
    d.add_argument("--all", action="store_true")
    d.set_defaults(fn=cmd_down)

    def input_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--input", default=None, help="JSON object of inputs")
        sp.add_argument("--input-file", default=None, help="file holding the JSON object")
        sp.add_argument("--timeout", type=seconds, default=None, help="seconds")
        sp.add_argument(
            "--stream",
            action="store_true",
            help="show stream chunks as they come: text inline, audio into a WAV file",
        )
        sp.add_argument(
            "--audio-out",
            default=None,
            metavar="PATH",
            help="with --stream: the WAV file for audio chunks (default omnirail-<id>.wav)",
        )
        sp.add_argument(
            "--jsonl", action="store_true", help="with --stream: every chunk as one JSON line"
        )

    r = sub.add_parser("run", help="start the mesh, run one request, print the result, stop")
    mesh_flags(r)
    input_flags(r)
    r.set_defaults(fn=cmd_run)

    g = sub.add_parser("generate", help="send one request to a running mesh")
    add_client_flags(g)
    g.add_argument("--address", required=True, help="coordinator: unix:///path or host:port")
    input_flags(g)
    g.add_argument("--request-id", default=None)
    g.add_argument("--traceparent", default=None, help="W3C traceparent of the caller")
    g.set_defaults(fn=cmd_generate)

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway of a mesh")
    gw.add_argument("--pipeline", required=True)
    gw.add_argument("--coordinator", required=True, help="unix:///path or host:port")
    gw.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0: any free one)")
    gw.add_argument("--ready-file", default=None, help="write the URL here once serving")
    gw.add_argument("--log-level", default="INFO")
    gw.set_defaults(fn=cmd_gateway)

    c = sub.add_parser("coordinator", help="run the coordinator service alone")
    c.add_argument("--pipeline", required=True)
    c.add_argument("--listen", default="0.0.0.0:50051")
    c.add_argument("--ready-file", default=None, help="write the bound address here once serving")
    c.add_argument("--log-level", default="INFO")
    c.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port (0: any free one, -1: none; default: pipeline metrics)",
    )
    c.add_argument("--metrics-host", default=None, help="default: the pipeline's metrics.host")
    c.add_argument("--cpus", default=None, help=_CPUS_HELP.format(what="coordinator_cpus"))
    _add_wake_flag(c, "it")
    c.set_defaults(fn=cmd_coordinator)

    s = sub.add_parser("stage", help="run one stage process alone")
    s.add_argument("--pipeline", required=True)
    s.add_argument("--stage", required=True, help="stage name, or several joined by commas")
    s.add_argument("--coordinator", required=True)
    s.add_argument("--listen", default=None, help="default: the pipeline's host, any port")
    s.add_argument(
        "--advertise", default=None, help="address other stages dial (default: bound one)"
    )
    s.add_argument("--shm-prefix", default="omnirail")
    s.add_argument("--log-level", default="INFO")
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port (0: any free one, -1: none; default: pipeline metrics)",
    )
    s.add_argument("--metrics-host", default=None, help="default: the pipeline's metrics.host")
    s.add_argument("--cpus", default=None, help=_CPUS_HELP.format(what="its stages' cpus"))
    s.add_argument(
        "--tp-rank",
        type=int,
        default=None,
        help="this process's rank in a tensor-parallel stage's group (rank 0 serves the mesh)",
    )
    s.add_argument(
        "--tp-init", default=None, help="the group's rendezvous, tcp://HOST:PORT (rank 0 binds it)"
    )
    s.add_argument(
        "--heartbeat",
        default=None,
        metavar="FILE",
        help="touch FILE every second while the process serves (a supervisor's liveness "
        "check: `omnirail up` kills a process whose beat is older than liveness_s)",
    )
    _add_wake_flag(s, "it")
    s.set_defaults(fn=cmd_stage)

    from omnirail.cli.compose import add_compose_parser
    from omnirail.cli.restart import add_restart_parser
    from omnirail.cli.status import add_status_parser

    add_compose_parser(sub)
    add_status_parser(sub)
    add_restart_parser(sub)

    t = sub.add_parser("trace", help="print a request's span waterfall from a local mesh")
    t.add_argument("request_id")
    t.add_argument("--name", default=None, help="mesh name (default: every running mesh)")
    t.add_argument(
        "--run-dir", action="append", default=[], help="read spans from this run directory"
    )
    t.add_argument("--json", action="store_true", help="one JSON list of spans")
    t.set_defaults(fn=cmd_trace)

    h = sub.add_parser("health", help="exit 0 if a server's grpc.health.v1 says SERVING, else 1")
    h.add_argument(
        "--address",
        default=None,
        help="host:port, unix:///path or an http(s):// health URL (default: "
        "$OMNIRAIL_HEALTH_ADDRESS or localhost:50051)",
    )
    h.add_argument(
        "--service",
        default=None,
        help="e.g. omnirail.v1.Omnirail (default: $OMNIRAIL_HEALTH_SERVICE or the whole server)",
    )
    h.add_argument("--timeout", type=seconds, default=5.0, help="seconds")
    h.set_defaults(fn=cmd_health)

    from omnirail.cli.bench import add_bench_parser
    from omnirail.cli.k8s import add_k8s_parser

    add_bench_parser(sub)
    add_k8s_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # Dotted paths resolve against the working directory, as under `python -m`.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    if args.command in ("coordinator", "stage", "gateway"):
        from omnirail.ops.launcher import die_with_parent

        die_with_parent()
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"invalid pipeline:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OmniError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`omnirail bench ...`: the benchmark subcommand's flags and dispatch (JSON reports)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Callable
from typing import Any

from omnirail.cli.args import checked, progress, read_inputs, wake_us


def _parse_options(items: list[str]) -> dict[str, object]:
    import yaml

    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value) if value else ""
    return options


def _wake_setting(text: str) -> int | None:
    return None if text == "off" else wake_us(text)


def _levels(text: str) -> list[int]:
    """`--concurrency`: one level, or several comma-separated (`omni`: 1,8)."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M,...: {text!r}") from None
    if any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"levels must be at least 1: {text!r}")
    return levels


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low` (counts, sizes)."""
    return checked(int, lambda v: v >= low, f"at least {low}")


# An argparse type: a finite duration of at least 0 (ms or s, as the flag says).
_duration = checked(float, lambda v: 0 <= v < math.inf, "a finite number of at least 0")


def _one_level(args: argparse.Namespace, default: int) -> int:
    if args.concurrency is None:
        return default
    if len(args.concurrency) != 1:
        raise SystemExit(f"bench {args.what}: --concurrency takes one level")
    return args.concurrency[0]


def cmd_bench(args: argparse.Namespace) -> int:
    from omnirail.tuning import cpu_latency

    # Held by this process for the whole run: the bound is host-wide, so the mesh or the
    # relay's receiver it starts runs under it too. `host` measures with and without.
    tuned = args.what in ("pipeline", "relay", "omni", "realtime")
    hold, wake = cpu_latency.report(args.cpu_wake_latency_us if tuned else None)
    try:
        report = _run(args)
    finally:
        if hold is not None:
            hold.release()
    if tuned:
        report["cpu_wake_latency"] = wake
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.what == "relay":
        from omnirail.bench.relay_bench import run_relay_bench
        from omnirail.relay.base import RelayError

        try:
            sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
        except ValueError:
            raise ValueError(f"--sizes: expected byte counts N,M,...: {args.sizes!r}") from None
        try:
            report = run_relay_bench(
                args.backend,
                sizes=sizes,
                options=_parse_options(args.option),
                receiver_options=_parse_options(args.receiver_option),
                receiver_wrap=shlex.split(args.receiver_wrap or ""),
                device=args.device,
            )
        except (RelayError, ConnectionError) as exc:
            # A transfer that failed (a peer gone, a backend's library refusing): said in
            # one line, exit status 1, as other runtime failures are.
            raise SystemExit(f"error: relay bench ({args.backend}): {exc}") from None
    elif args.what == "host":
        from omnirail.bench.host_bench import run_host_bench

        report = run_host_bench()
    elif args.what == "demo":
        from omnirail.bench.demo_bench import run_demo_bench

        report = run_demo_bench(
            address=args.address,
            pipeline=args.pipeline,
            inputs=read_inputs(args) if (args.input or args.input_file) else None,
            runs=args.runs,
            concurrency=_one_level(args, 1),
            via=args.via,
            progress=progress(args.json),
        )
    elif args.what == "stop":
        from omnirail.bench.stop_bench import run_stop_bench

        report = run_stop_bench(
            pipeline=args.pipeline,
            inputs=read_inputs(args) if (args.input or args.input_file) else None,
            runs=args.runs,
            requests=1 if args.requests is None else args.requests,
            progress=progress(args.json),
        )
    elif args.what == "omni":
        from omnirail.bench.omni_bench import run_omni_bench

        report = run_omni_bench(
            model_path=args.model_path,
            baseline=args.baseline,
            concurrency=args.concurrency or [1, 8],
            requests=16 if args.requests is None else args.requests,
            max_new_tokens=args.max_new_tokens,
            talker_max_new_tokens=args.talker_max_new_tokens,
            kind=args.kind,
            torch_threads=args.torch_threads,
            thinkers=[t.strip() for t in args.thinker.split(",") if t.strip()],
            thinker_options=_parse_options(args.option),
            size=args.size,
            progress=progress(args.json),
        )
    elif args.what == "realtime":
        from omnirail.bench.realtime_bench import run_realtime_bench

        report = run_realtime_bench(
            model_path=args.model_path,
            sessions=args.sessions or [1, 8],
            turns=args.turns,
            max_new_tokens=args.max_new_tokens,
            talker_max_new_tokens=args.talker_max_new_tokens,
            size=args.size,
            progress=progress(args.json),
        )
    elif args.what == "llm":
        from omnirail.bench.llm_bench import run_llm_bench

        report = run_llm_bench(
            model_path=args.model_path,
            concurrency=args.concurrency or [1, 8],
            requests=16 if args.requests is None else args.requests,
            max_new_tokens=args.max_new_tokens,
            rounds=max(args.rounds, 2),
            engine=_parse_options(args.option),
            progress=progress(args.json),
        )
    elif args.what == "streaming":
        from omnirail.bench.streaming_bench import run_streaming_bench

        report = run_streaming_bench(
            chunks=args.chunks,
            interval_ms=args.interval_ms,
            runs=args.runs,
            progress=progress(args.json),
        )
    elif args.what == "overload":
        from omnirail.bench.overload_bench import run_overload_bench

        report = run_overload_bench(
            factor=args.factor,
            live=args.live or 64,
            stage_ms=args.stage_ms or 5.0,
            waves=args.rounds if args.rounds >= 3 else 10,
            progress=progress(args.json),
        )
    elif args.what == "tenants":
        from omnirail.bench.tenant_bench import run_tenant_bench

        report = run_tenant_bench(
            live=args.live or 8,
            steps=args.steps,
            step_ms=args.step_ms,
            flood_x=args.flood_x,
            quiet_x=args.quiet_x,
            seconds=args.seconds,
            baseline=args.compare_fcfs,
            progress=progress(args.json),
        )
    elif args.what == "chaos":
        from omnirail.bench.chaos_bench import run_chaos_bench

        report = run_chaos_bench(
            shape=args.shape,
            requests=10_000 if args.requests is None else args.requests,
            concurrency=_one_level(args, 32),
            abort_fraction=args.abort_fraction,
            deadline_fraction=args.deadline_fraction,
            bad_fraction=args.bad_fraction,
            kill_every_s=args.kill_every,
            replicas=max(args.replicas, 2),
            seed=args.seed,
            progress=progress(args.json),
        )
    elif args.tls:
        from omnirail.bench.tls_bench import run_tls_bench

        report = run_tls_bench(
            stages=args.stages,
            payload_bytes=args.payload_bytes,
            requests=300 if args.requests is None else args.requests,
            concurrency=_one_level(args, 64),
            throughput_requests=args.throughput_requests,
            stage_ms=args.stage_ms,
            pin=args.pin,
            rounds=max(args.rounds, 3),
            tcp=args.tls_tcp,
            progress=progress(args.json),
        )
    elif args.replicas > 1:
        from omnirail.bench.balance_bench import run_balance_bench

        report = run_balance_bench(
            replicas=args.replicas,
            slow_factor=args.slow_factor,
            stage_ms=args.stage_ms or 10.0,
            requests=600 if args.requests is None else args.requests,
            concurrency=_one_level(args, 16),
            rounds=max(args.rounds, 3),
            progress=progress(args.json),
        )
    else:
        from omnirail.bench.pipeline_bench import run_pipeline_bench

        report = run_pipeline_bench(
            stages=args.stages,
            payload_bytes=args.payload_bytes,
            requests=300 if args.requests is None else args.requests,
            concurrency=_one_level(args, 64),
            throughput_requests=args.throughput_requests,
            stage_ms=args.stage_ms,
            tracing=args.tracing,
            pin=args.pin,
            rounds=args.rounds,
            fused=args.fused,
            progress=progress(args.json),
        )
    return report


def add_bench_parser(sub: Any) -> None:
    """Adds `bench` to the CLI's subcommands (`sub`, from add_subparsers)."""
    b = sub.add_parser("bench", help="benchmarks (JSON output)")
    b.add_argument(
        "what",
        choices=[
            "pipeline",
            "relay",
            "streaming",
            "demo",
            "host",
            "omni",
            "llm",
            "realtime",
            "chaos",
            "overload",
            "stop",
            "tenants",
        ],
    )
    b.add_argument("--json", action="store_true", help="one line of JSON, no progress")
    b.add_argument("--backend", default="shm")
    b.add_argument("--sizes", default=None, help="relay: comma-separated byte sizes")
    b.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="relay: a backend option for both sides; llm: an engine option (value parsed as "
        "YAML), repeatable",
    )
    b.add_argument(
        "--receiver-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="relay: a backend option for the receiver only (e.g. host=10.0.0.2)",
    )
    b.add_argument(
        "--receiver-wrap",
        default=None,
        help="relay: command prefix for the receiver, e.g. 'ip netns exec NS' (across hosts)",
    )
    b.add_argument("--stages", type=int, default=3)
    b.add_argument("--payload-bytes", type=_at_least(0), default=0)
    b.add_argument(
        "--requests",
        type=_at_least(1),
        default=None,
        help="pipeline: sequential latency requests (default 300); omni: requests per "
        "concurrency level, in waves of that many at once (default 16); stop: requests "
        "before each stop (default 1)",
    )
    b.add_argument(
        "--concurrency",
        type=_levels,
        default=None,
        metavar="N[,N...]",
        help="pipeline: requests in flight (default 64); demo: streams at once (default 1); "
        "omni: levels, comma-separated (default 1,8)",
    )
    b.add_argument(
        "--sessions",
        type=_levels,
        default=None,
        metavar="N[,N...]",
        help="realtime: spoken sessions at once, levels comma-separated (default 1,8)",
    )
    b.add_argument(
        "--turns",
        type=_at_least(2),
        default=3,
        help="realtime: turns per conversation (the last one is barged in on; default 3)",
    )
    b.add_argument("--throughput-requests", type=_at_least(1), default=2048)
    b.add_argument(
        "--stage-ms",
        type=_duration,
        default=0.0,
        help="pipeline: each stage sleeps this long per request (GIL released, like a kernel)",
    )
    b.add_argument("--chunks", type=_at_least(1), default=50, help="streaming: chunks per request")
    b.add_argument(
        "--interval-ms", type=_duration, default=10.0, help="streaming: producer time per chunk"
    )
    b.add_argument(
        "--runs",
        type=_at_least(1),
        default=5,
        help="streaming, demo: timed requests; stop: up/down cycles",
    )
    b.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pipeline: repeat the latency and throughput runs on one mesh; medians reported",
    )
    b.add_argument("--address", default=None, help="demo: a running mesh (default: start one)")
    b.add_argument(
        "--via",
        choices=["grpc", "http"],
        default="grpc",
        help="demo: http also streams each request through the OpenAI gateway, against the "
        "SDK in the same run (what the gateway adds to time to first text and audio)",
    )
    b.add_argument(
        "--pipeline", default=None, help="demo, stop: pipeline file (default: omni demo)"
    )
    b.add_argument("--input", default=None, help="demo, stop: JSON object of inputs")
    b.add_argument("--input-file", default=None, help="demo, stop: file holding the JSON object")
    b.add_argument(
        "--model-path",
        default=None,
        help="omni: a local Qwen3-Omni checkpoint directory; llm: a model directory vLLM serves "
        "(default: a tiny random one made "
        "in a temporary folder)",
    )
    b.add_argument(
        "--baseline",
        choices=["transformers"],
        default=None,
        help="omni: also time transformers' own generate() on the same weights, in turn "
        "with the mesh, and report the ratios",
    )
    b.add_argument("--max-new-tokens", type=int, default=32, help="omni: the thinker's text tokens")
    b.add_argument(
        "--talker-max-new-tokens",
        type=int,
        default=128,
        help="omni: the talker's codec frames (12.5 per second of audio)",
    )
    b.add_argument(
        "--kind", choices=["text", "image", "audio"], default="text", help="omni: the request"
    )
    b.add_argument(
        "--thinker",
        default="native",
        metavar="ENGINE[,ENGINE]",
        help="omni: the thinker engines to run, one mesh each, in the same run (native, vllm; "
        "e.g. vllm,native); --option KEY=VALUE sets the vLLM thinker's engine options",
    )
    b.add_argument(
        "--size",
        choices=["tiny", "bench"],
        default="tiny",
        help="omni: the random checkpoint made when --model-path is not given: tiny, or bench "
        "(the thinker far larger than talker and code2wav, as in the real model)",
    )
    b.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="omni: torch threads of the transformers baseline (the mesh's stages use 1 each)",
    )
    b.add_argument(
        "--device",
        default="cpu",
        help="relay: where the sent tensors live (cpu, cuda, cuda:N); with a GPU, ratio is "
        "against a same-run copy on it",
    )
    b.add_argument(
        "--replicas",
        type=_at_least(1),
        default=1,
        help="pipeline: one stage with this many replicas, replica 0 --slow-factor times "
        "slower, under each balance policy (least_outstanding against request_id hashing), "
        "interleaved; --stage-ms defaults to 10 here",
    )
    b.add_argument(
        "--slow-factor",
        type=float,
        default=5.0,
        help="pipeline --replicas: how much slower replica 0 computes",
    )
    chaos = b.add_argument_group("chaos")
    chaos.add_argument(
        "--shape",
        choices=["omni", "quickstart", "streaming"],
        default="omni",
        help="chaos: which pipeline (every stage with --replicas, at least 2): the installed "
        "omni demo, or an example of a checkout (run from its root)",
    )
    chaos.add_argument("--abort-fraction", type=float, default=0.3, help="chaos: aborted")
    chaos.add_argument(
        "--deadline-fraction", type=float, default=0.1, help="chaos: with a 5-40 ms deadline"
    )
    chaos.add_argument(
        "--bad-fraction", type=float, default=0.05, help="chaos: malformed or oversized input"
    )
    chaos.add_argument(
        "--kill-every",
        type=_duration,
        default=3.0,
        metavar="S",
        help="chaos: SIGKILL a random stage process every S seconds (0: none)",
    )
    chaos.add_argument("--seed", type=int, default=0, help="chaos: the mix and the victims")
    chaos.add_argument(
        "--factor", type=int, default=10, help="overload: waves of FACTOR x --live at once"
    )
    chaos.add_argument(
        "--live",
        type=_at_least(1),
        default=None,
        help="overload, tenants: the mesh's max_live_requests (default 64; tenants 8)",
    )
    tenants = b.add_argument_group("tenants")
    tenants.add_argument(
        "--steps", type=_at_least(1), default=20, help="tenants: steps per request"
    )
    tenants.add_argument(
        "--step-ms", type=_duration, default=10.0, help="tenants: ms per step (any batch)"
    )
    tenants.add_argument(
        "--flood-x", type=float, default=10.0, help="tenants: the flooder's rate, x capacity"
    )
    tenants.add_argument(
        "--quiet-x", type=float, default=0.2, help="tenants: the quiet caller's rate, x capacity"
    )
    tenants.add_argument(
        "--seconds", type=_duration, default=10.0, help="tenants: seconds per phase"
    )
    tenants.add_argument(
        "--compare-fcfs",
        action="store_true",
        help="tenants: also run the flooded phase without quotas (first come first served)",
    )
    b.add_argument(
        "--tls",
        action="store_true",
        help="pipeline: a plaintext mesh against one with --tls auto and a client token, "
        "interleaved (at least 3 rounds)",
    )
    b.add_argument(
        "--tls-tcp", action="store_true", help="pipeline --tls: both meshes over TCP loopback"
    )
    b.add_argument(
        "--fused",
        action="store_true",
        help="pipeline: also run the stages fused into one process (local dispatch) and "
        "compare with one process per stage, interleaved (at least 3 rounds)",
    )
    b.add_argument(
        "--tracing",
        choices=["off", "on", "compare"],
        default="off",
        help="pipeline: spans to a local file at sampling 1.0; compare runs both, interleaved",
    )
    b.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pipeline: pin each mesh process to one CPU, round-robin, as `omnirail up --pin` "
        "(recommended where every stage runs one compute thread, as the bench's do; "
        "default: on, --no-pin to compare)",
    )
    b.add_argument(
        "--cpu-wake-latency-us",
        type=_wake_setting,
        default=0,
        metavar="US|off",
        help="pipeline, relay, omni: hold idle CPUs to wake within US µs while measuring, as a "
        "latency-tuned serving host would (PM QoS; needs root, else the report says it was "
        "not held); off measures the host as it is (default: 0, polling)",
    )
    b.set_defaults(fn=cmd_bench)

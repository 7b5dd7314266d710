"""The `omnirail` command line over real processes: validate, run, up/generate/down, bench."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omnirail.client.sdk import Client
from omnirail.ops.launcher import pid_alive, read_states, state_dir
from omnirail.relay.shm_pool import sweep_segments
from omnirail.tuning import cpu_latency
from tests.integration.conftest import MESH_TIMEOUT, REPO, explain, omnirail

QUICKSTART = "examples/quickstart/pipeline.yaml"
QUICKSTART_INPUT = "examples/quickstart/input.json"
STAGES = ["preprocess", "text_encoder", "image_encoder", "fuse"]
QUICK_TIMEOUT = 120  # commands that do not


def omnirail_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("omnirail-")}


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=30)
    return sorted(int(p) for p in out.stdout.split())


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def shm_prefixes(pids: list[int]) -> set[str]:
    """The --shm-prefix the launcher gave its stage processes."""
    prefixes = set()
    for pid in pids:
        argv = cmdline(pid)
        if "--shm-prefix" in argv:
            prefixes.add(argv[argv.index("--shm-prefix") + 1])
    return prefixes


def mesh_processes(launcher: int) -> list[int]:
    children = child_pids(launcher)
    roles = sorted(cmdline(pid)[3] for pid in children)  # python -m omnirail <role>
    assert roles == ["coordinator"] + ["stage"] * len(STAGES), roles
    return children


def assert_gone(pids: list[int]) -> None:
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not alive, f"processes still present after shutdown: {alive}"


def check_quickstart_outputs(outputs: dict) -> None:
    assert set(outputs) == {"fuse"}
    fuse = outputs["fuse"]
    assert fuse["embedding"]["dtype"] == "float32"
    assert fuse["embedding"]["shape"] == [128]
    assert isinstance(fuse["similarity"], float)
    assert -1.0 <= fuse["similarity"] <= 1.0


@dataclass
class Tracked:
    pids: list[int] = field(default_factory=list)
    prefixes: set[str] = field(default_factory=set)


@contextlib.contextmanager
def cleanup(name: str) -> Iterator[Tracked]:
    """Whatever happens in the block, the mesh `name` is stopped and its shm swept."""
    found = Tracked()
    try:
        yield found
    finally:
        if name in read_states():
            omnirail("down", "--name", name, timeout=QUICK_TIMEOUT)
        for pid in found.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for prefix in found.prefixes:
            sweep_segments(prefix)
        (state_dir() / f"{name}.json").unlink(missing_ok=True)
        (state_dir() / f"{name}.log").unlink(missing_ok=True)


# ---- validate ---------------------------------------------------------------------


def test_validate_prints_topology() -> None:
    proc = omnirail("validate", QUICKSTART, timeout=QUICK_TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.splitlines()
    assert "pipeline: quickstart" in lines
    assert "entry: preprocess" in lines
    assert "terminals: fuse" in lines
    for stage in STAGES:
        assert f"  {stage}" in lines, f"stage {stage} missing from:\n{proc.stdout}"
    assert "    wait_for: text_encoder, image_encoder" in proc.stdout


def test_validate_reports_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\n"
        "stages:\n"
        "  - name: first\n"
        "    factory: examples.quickstart.models:create_preprocess\n"
        "    next: last\n"
        "    terminal: true\n"
        "  - name: last\n"
        "    factory: examples.quickstart.models:create_fuse\n"
        "    wait_for: [first]\n"
        "    terminal: true\n"
    )
    proc = omnirail("validate", str(bad), timeout=QUICK_TIMEOUT)
    assert proc.returncode == 2, explain(proc)
    assert proc.stdout == ""
    assert "invalid pipeline" in proc.stderr
    assert "stages[first].terminal" in proc.stderr
    assert "both set" in proc.stderr
    assert "stages[last].merge_fn: required when wait_for is set" in proc.stderr


def test_validate_missing_file(tmp_path: Path) -> None:
    proc = omnirail("validate", str(tmp_path / "nope.yaml"), timeout=QUICK_TIMEOUT)
    assert proc.returncode == 2, explain(proc)
    assert "nope.yaml: no such file" in proc.stderr


# ---- run ----------------------------------------------------------------------------


def test_run_quickstart() -> None:
    proc = omnirail("run", QUICKSTART, "--input-file", QUICKSTART_INPUT)
    assert proc.returncode == 0, explain(proc)
    check_quickstart_outputs(json.loads(proc.stdout))
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[omnirail] ")]
    assert any("starting coordinator" in line for line in progress), proc.stderr
    assert any("mesh ready: 4 stages" in line for line in progress), proc.stderr
    assert any(re.search(r"request \w+ took [\d.]+ ms", line) for line in progress), proc.stderr


def test_run_streaming_example_prints_chunks_as_they_come() -> None:
    proc = omnirail(
        "run",
        "examples/streaming/pipeline.yaml",
        "--input",
        '{"text": "stream me"}',
        "--stream",
        "--jsonl",
        "--quiet",
    )
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.splitlines()
    chunks = [json.loads(line) for line in lines if line.startswith('{"t_ms"')]
    result = json.loads("\n".join(lines[len(chunks) :]))
    text = [c for c in chunks if c["stage"] == "thinker"]
    audio = [c for c in chunks if c["stage"] == "vocoder"]
    assert "".join(c["data"] for c in text) == "stream me"
    assert [c["chunk_id"] for c in text] == list(range(9))
    assert {c["modality"] for c in text} == {"text"} and {c["modality"] for c in audio} == {"audio"}
    assert [c["chunk_id"] for c in audio] == list(range(len(audio))) and len(audio) >= 2
    times = [c["t_ms"] for c in chunks]
    assert times == sorted(times)
    assert sum(c["data"]["shape"][0] for c in audio) == result["vocoder"]["samples"] == 9 * 320
    assert result["thinker"] == {"text": "stream me"} and result["talker"] == {"frames": 9}


@pytest.mark.slow
def test_bench_streaming_json() -> None:
    proc = omnirail(
        "bench", "streaming", "--chunks", "10", "--interval-ms", "5", "--runs", "2", "--json"
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["chunks"] == 10 and len(report["ttfc_ms_runs"]) == 2
    assert 0 < report["ttfc_ms"] < report["total_ms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "[1,2]"], "error: --input: expected a JSON object of inputs, got list"),
        (["--input", "{"], "error: --input: invalid JSON"),
        ([], "error: --input or --input-file is required"),
    ],
    ids=["not-an-object", "bad-json", "no-input"],
)
def test_run_rejects_bad_input_before_starting(args: list[str], message: str) -> None:
    proc = omnirail("run", QUICKSTART, *args, timeout=QUICK_TIMEOUT)
    assert proc.returncode == 2, explain(proc)
    assert message in proc.stderr
    assert "starting coordinator" not in proc.stderr  # no mesh was started for it
    assert proc.stdout == ""


def test_run_stage_error_exits_1_naming_stage() -> None:
    proc = omnirail("run", QUICKSTART, "--input", '{"text": ""}')
    assert proc.returncode == 1, explain(proc)
    assert proc.stdout == ""
    assert "in stage 'preprocess'" in proc.stderr
    assert "inputs.text: a non-empty string is required" in proc.stderr


# ---- up / generate / down ---------------------------------------------------------


def test_up_detached_generate_down() -> None:
    name = f"clitest-{uuid.uuid4().hex[:8]}"
    shm_before = omnirail_shm()
    with cleanup(name) as found:
        up = omnirail("up", QUICKSTART, "--detach", "--name", name)
        assert up.returncode == 0, explain(up)
        address = up.stdout.strip()
        assert re.fullmatch(r"unix:///\S+\.sock", address), address

        state = read_states()[name]
        launcher = int(state["pid"])  # type: ignore[arg-type]
        found.pids = [launcher]
        assert state["address"] == address
        assert launcher != os.getpid() and pid_alive(launcher)
        children = mesh_processes(launcher)
        found.pids = [launcher, *children]
        prefixes = shm_prefixes(children)
        assert len(prefixes) == 1, prefixes
        found.prefixes = prefixes
        (prefix,) = prefixes

        rid = f"traced-{uuid.uuid4().hex[:8]}"
        parent_trace = uuid.uuid4().hex
        gen = omnirail(
            "generate",
            "--address",
            address,
            "--input",
            '{"text": "hi"}',
            "--request-id",
            rid,
            "--traceparent",
            f"00-{parent_trace}-{'ab' * 8}-01",
            timeout=QUICK_TIMEOUT,
        )
        assert gen.returncode == 0, explain(gen)
        check_quickstart_outputs(json.loads(gen.stdout))
        # The 196 KiB image went through the relay, so this mesh made shared memory.
        ours = {n for n in omnirail_shm() - shm_before if n.startswith(prefix + "-")}
        assert ours, "expected the mesh to hold shared memory after a relayed request"

        # Spans of the live mesh, from the run directory's files (exported every 0.2 s).
        deadline = time.monotonic() + 30
        while True:
            trace = omnirail("trace", rid, "--name", name, "--json", timeout=QUICK_TIMEOUT)
            spans = json.loads(trace.stdout) if trace.returncode == 0 else []
            if len([sp for sp in spans if sp["name"].startswith("stage ")]) == len(STAGES):
                break
            assert time.monotonic() < deadline, explain(trace)
            time.sleep(0.3)
        assert {sp["service"] for sp in spans} == {"omnirail-coordinator"} | {
            f"omnirail-stage-{st}" for st in STAGES
        }
        assert [sp["name"] for sp in spans if sp["depth"] == 0] == ["omnirail.request"]
        text = omnirail("trace", rid, "--name", name, timeout=QUICK_TIMEOUT)
        assert text.returncode == 0, explain(text)
        assert f"trace {parent_trace}" in text.stdout and "stage fuse" in text.stdout
        missing = omnirail("trace", "no-such-request", "--name", name, timeout=QUICK_TIMEOUT)
        assert missing.returncode == 1 and "no-such-request" in missing.stderr

        # A stage killed under `up` is restarted; `status` shows it, and it serves again.
        status = omnirail("status", "--name", name, "--json", timeout=QUICK_TIMEOUT)
        processes = json.loads(status.stdout)[name]["processes"]
        assert {p["state"] for p in processes.values()} == {"running"}, processes
        os.kill(processes["stage-fuse"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            status = omnirail("status", "--name", name, "--json", timeout=QUICK_TIMEOUT)
            fuse = json.loads(status.stdout)[name]["processes"]["stage-fuse"]
            if fuse["state"] == "running" and fuse["restarts"] == 1:
                break
            assert time.monotonic() < deadline, fuse
            time.sleep(0.2)
        assert fuse["last_exit"]["code"] == -signal.SIGKILL
        children = mesh_processes(launcher)
        found.pids = [launcher, *children]
        while True:
            gen = omnirail("generate", "--address", address, "--input", '{"text": "hi"}')
            if gen.returncode == 0:
                break
            assert time.monotonic() < deadline, explain(gen)
            time.sleep(0.3)
        check_quickstart_outputs(json.loads(gen.stdout))
        table = omnirail("status", timeout=QUICK_TIMEOUT)
        assert table.returncode == 0 and "RESTARTS" in table.stdout, explain(table)
        assert "stage-fuse" in table.stdout and "code -9" in table.stdout

        down = omnirail("down", "--name", name, timeout=QUICK_TIMEOUT)
        assert down.returncode == 0, explain(down)
        assert f"stopped {name}" in down.stdout

        assert not pid_alive(launcher), "launcher still running after `omnirail down`"
        assert_gone(children)
        assert not (state_dir() / f"{name}.json").exists(), "state file left behind"
        assert name not in read_states()
        leftover = sorted(n for n in omnirail_shm() - shm_before if n.startswith(prefix + "-"))
        assert leftover == [], f"shared memory left after `omnirail down`: {leftover}"

        again = omnirail("down", "--name", name, timeout=QUICK_TIMEOUT)
        assert again.returncode == 2, explain(again)
        assert f"no running mesh named {name!r}" in again.stderr


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                break
    with contextlib.suppress(queue.Empty):
        return lines.get(timeout=1)
    return ""


def test_up_foreground_tcp_sigint(tmp_path: Path) -> None:
    name = f"clitest-{uuid.uuid4().hex[:8]}"
    shm_before = omnirail_shm()
    stderr_path = tmp_path / "up.stderr"
    with cleanup(name) as found, open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omnirail", "up", QUICKSTART, "--tcp", "--name", name],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        found.pids = [proc.pid]
        try:
            address = _first_line(proc, MESH_TIMEOUT).strip()
            assert address, f"`omnirail up` printed no address:\n{stderr_path.read_text()}"
            match = re.fullmatch(r"([\w.\-]+):(\d+)", address)
            assert match, f"not host:port: {address!r}"
            assert int(match.group(2)) > 0

            state = read_states()[name]
            assert state["pid"] == proc.pid and state["address"] == address
            children = mesh_processes(proc.pid)
            found.pids = [proc.pid, *children]
            prefixes = shm_prefixes(children)
            found.prefixes = prefixes
            (prefix,) = prefixes

            with Client(address, timeout=60) as client:
                out = client.generate({"text": "hi"}).output
            assert tuple(out["embedding"].shape) == (128,)
            assert -1.0 <= out["similarity"] <= 1.0

            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0, stderr_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        assert_gone(children)
        assert "[omnirail] stopping" in stderr_path.read_text()
        assert not (state_dir() / f"{name}.json").exists(), "state file left behind"
        leftover = sorted(n for n in omnirail_shm() - shm_before if n.startswith(prefix + "-"))
        assert leftover == [], f"shared memory left after SIGINT: {leftover}"


# ---- bench --------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_pipeline_json() -> None:
    proc = omnirail(
        "bench",
        "pipeline",
        "--stages",
        "2",
        "--requests",
        "20",
        "--throughput-requests",
        "64",
        "--concurrency",
        "8",
        "--stage-ms",
        "2",
        "--rounds",
        "3",
        "--json",
    )
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    report = json.loads(lines[0])
    for key in ("latency_p50_ms", "latency_p99_ms", "throughput_rps"):
        assert isinstance(report[key], (int, float)) and report[key] > 0, (key, report)
    assert report["latency_p50_ms"] <= report["latency_p99_ms"]
    assert report["stages"] == 2 and report["requests"] == 20 and report["rounds"] == 3
    for key in ("latency_p50_ms", "latency_p99_ms", "throughput_rps"):
        per_round = report[f"rounds_{key}"]
        assert len(per_round) == 3 and report[key] == sorted(per_round)[1], (key, report)
    assert report["stage_ms"] == 2 and 0 < report["efficiency"] <= 1.05
    # By default the bench pins its single-threaded stages and holds idle CPUs to polling
    # where the host lets it.
    assert report["pinned"] is True
    wake = report["cpu_wake_latency"]
    assert wake["requested_us"] == 0 and wake["held"] == cpu_latency.available(), wake
    assert "[omnirail]" not in proc.stderr  # --json: no progress


def test_bench_pipeline_fused_against_separate_processes() -> None:
    proc = omnirail(
        "bench",
        "pipeline",
        "--stages",
        "3",
        "--fused",
        "--payload-bytes",
        "200000",  # relayed between separate processes, by reference when fused
        "--requests",
        "10",
        "--throughput-requests",
        "32",
        "--concurrency",
        "4",
        "--json",
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["processes"] == {"separate": 4, "fused": 2}
    assert report["rounds"] == 3 and report["payload_bytes"] == 200000
    for kind in ("separate", "fused"):
        side = report[kind]
        for key in ("latency_p50_ms", "latency_p99_ms", "throughput_rps"):
            assert side[key] > 0, (kind, key, report)
        assert len(side["rounds_latency_p50_ms"]) == len(side["rounds_throughput_rps"]) == 3
    ratios = report["fused_over_separate"]
    assert ratios["throughput"] == pytest.approx(
        report["fused"]["throughput_rps"] / report["separate"]["throughput_rps"], rel=0.01
    )
    assert ratios["latency_p50"] > 0 and ratios["latency_p99"] > 0
    bad = omnirail("bench", "pipeline", "--fused", "--tracing", "compare")
    assert bad.returncode != 0 and "pick one" in bad.stderr, explain(bad)


def test_bench_relay_untuned_and_a_bad_wake_latency() -> None:
    proc = omnirail("bench", "relay", "--sizes", "4096", "--cpu-wake-latency-us", "off", "--json")
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["sizes"]["4096"]["gbps"] > 0
    assert (report["device"], report["reference"]) == ("cpu", "memcpy")
    assert report["cpu_wake_latency"] == {"requested_us": None, "held": False}
    bad = omnirail("bench", "relay", "--cpu-wake-latency-us", "-1")
    assert bad.returncode == 2 and "must be 0..1000000 µs, got -1" in bad.stderr, explain(bad)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (
            ("generate", "--address", "localhost:1", "--input-file", "/"),
            "error: --input-file /: Is a directory",
        ),
        (
            ("run", QUICKSTART, "--input-file", "/nonexistent/in.json"),
            "error: --input-file /nonexistent/in.json: No such file or directory",
        ),
        (
            ("generate", "--address", "localhost:1", "--input", "{}", "--timeout", "-5"),
            "argument --timeout: must be above 0 and at most a year, got -5",
        ),
        (("health", "--timeout", "nan"), "argument --timeout: must be above 0"),
        (("restart", "x", "--timeout", "0"), "argument --timeout: must be above 0"),
        (("trace", "x", "--run-dir", "/nonexistent"), "error: --run-dir /nonexistent: no such"),
        (("up", QUICKSTART, "--tcp", "--port", "-3"), "argument --port: must be 0-65535"),
        (
            ("coordinator", "--pipeline", QUICKSTART, "--listen", "192.0.2.1:0"),
            "error: cannot listen on 192.0.2.1:0: Failed to bind",
        ),
        (
            ("stage", "--pipeline", QUICKSTART, "--stage", "fuse,nosuch", "--coordinator", "x:1"),
            "error: --stage 'fuse,nosuch': unknown stage 'nosuch'; stages: preprocess, ",
        ),
    ],
)
def test_bad_arguments_are_one_line_naming_the_flag(argv: tuple[str, ...], problem: str) -> None:
    proc = omnirail(*argv, timeout=60)
    assert proc.returncode == 2 and problem in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--backend", "nosuch"), "error: --backend 'nosuch': no such relay backend"),
        (("--receiver-option", "host=x"), "error: --receiver-option: host: unknown option"),
        (("--sizes", "4096,x"), "error: --sizes: expected byte counts N,M,...: '4096,x'"),
    ],
)
def test_bench_relay_refuses_what_it_cannot_run_in_one_line(
    argv: tuple[str, ...], problem: str
) -> None:
    proc = omnirail("bench", "relay", *argv, "--cpu-wake-latency-us", "off")
    assert proc.returncode == 2 and proc.stderr.startswith(problem), explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


def test_bench_relay_device() -> None:
    """GPU tensors through the relay, against a same-run copy on the GPU; a host without
    CUDA is told so."""
    import torch

    if not torch.cuda.is_available():
        proc = omnirail("bench", "relay", "--device", "cuda", "--json")
        assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr, explain(proc)
    else:
        proc = omnirail("bench", "relay", "--device", "cuda", "--sizes", "1048576", "--json")
        assert proc.returncode == 0, explain(proc)
        report = json.loads(proc.stdout)
        assert (report["device"], report["reference"]) == ("cuda", "device_to_device_copy")
        assert report["sizes"]["1048576"]["gbps"] > 0
    bad = omnirail("bench", "relay", "--device", "gpu")
    assert bad.returncode == 2 and "--device must be cpu, cuda or cuda:N" in bad.stderr


def test_bench_host_json() -> None:
    proc = omnirail("bench", "host", "--json")
    assert proc.returncode == 0, explain(proc)
    report = json.loads(proc.stdout)
    assert report["cpus"] == len(os.sched_getaffinity(0))
    rtt = report["wakeup_rtt_us"]
    assert rtt["same_cpu"] > 0 and rtt["unpinned"] > 0
    assert (rtt["cross_cpu"] is None) == (report["cpus"] < 2)
    assert 0 < report["python_loop_ns"] < 10_000
    assert report["idle_penalty_us"]["hot"] > 0 and report["idle_penalty_us"]["after_2ms_idle"] > 0
    copies = report["memcpy_gbps"]
    assert copies["1048576"]["hot"] > 0 and copies["1048576"]["rotating"] > 0
    big = copies["67108864"]
    assert big["alone"] > 0 and big["two_at_once_each"] > 0
    assert abs(big["two_at_once_ratio"] - big["two_at_once_each"] / big["alone"]) < 0.01
    polling = report["polling_idle"]
    assert polling["requested_us"] == 0 and polling["held"] == cpu_latency.available()
    if polling["held"]:
        assert polling["wakeup_rtt_us"]["unpinned"] > 0
        assert polling["idle_penalty_us"]["after_2ms_idle"] > 0
    else:
        assert "error" in polling

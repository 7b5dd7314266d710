"""Losing one replica fails only what it touched: requests it held with nothing sent to
the client yet run again on the other replica (every stage here is `retry_safe`), those
already streaming fail with UNAVAILABLE naming stage and replica, the other replica's go
on untouched. A replica that hangs (SIGSTOP) is noticed within `liveness_s`, treated the
same, killed and restarted; a request without a deadline ends at the pipeline's default."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import yaml

from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import PIPELINES, generate_when_back, shm_names, start_mesh


def _replicas(mesh: Mesh, client: Client, stage: str) -> list[tuple[str, int]]:
    """(replica id, pid) of `stage`'s replicas, sorted by id (the stages' routing order)."""
    info = next(s for s in client.describe().stages if s.name == stage)
    pids = mesh.processes()
    out = []
    for rep in sorted(info.replicas, key=lambda r: r.replica_id):
        process = rep.address.rsplit("/", 1)[-1].removesuffix(".sock")  # unix socket name
        out.append((rep.replica_id, pids[process]))
    return out


def _metric(client: Client, name: str) -> float:
    address = client.describe().metrics_address
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _run_all(fns: dict[str, Any]) -> dict[str, Any]:
    """Runs each of `fns` on its own thread; their results (or errors) by key."""
    out: dict[str, Any] = {}

    def run(key: str) -> None:
        try:
            out[key] = fns[key]()
        except OmniError as exc:
            out[key] = exc
            out[key + ":at"] = time.monotonic()

    threads = [threading.Thread(target=run, args=(k,)) for k in fns]
    for t in threads:
        t.start()
    return {"threads": threads, "out": out}


def test_a_lost_inner_replica_reruns_only_its_requests() -> None:
    mesh = start_mesh("failover")
    try:
        with Client(mesh.address or "", timeout=30) as client:
            (dead_id, dead_pid), (live_id, live_pid) = _replicas(mesh, client, "double")
            rids = [f"fo-{i}" for i in range(8)]
            # The stages send a request to replica crc32(id) % 2 of `double`.
            on_dead = {r for r in rids if zlib.crc32(r.encode()) % 2 == 0}
            assert 0 < len(on_dead) < len(rids)
            before = _metric(client, "omnirail_requests_redispatched_total")
            run = _run_all(
                {
                    r: (lambda r=r: client.generate({"n": 4, "sleep": 2.0}, request_id=r))
                    for r in rids
                }
            )
            time.sleep(1.0)  # every request is sleeping in `double`
            os.kill(dead_pid, signal.SIGKILL)
            for t in run["threads"]:
                t.join(60)
            out = run["out"]
            failed = {r: out[r] for r in rids if isinstance(out[r], OmniError)}
            assert failed == {}
            # Each ran to the end on the replica that stayed, once or (if on the lost
            # one) twice; the other replica's requests were not touched.
            assert {out[r].output["double_pid"] for r in rids} == {live_pid}
            assert {out[r].output["sum"] for r in rids} == {12.0}
            redispatched = _metric(client, "omnirail_requests_redispatched_total") - before
            assert redispatched == len(on_dead), (redispatched, on_dead)
            assert dead_id != live_id
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == []


def test_a_lost_replica_fails_what_already_streamed_and_spares_the_rest() -> None:
    mesh = start_mesh("failover_stream")
    try:
        with Client(mesh.address or "", timeout=60) as client:
            replicas = dict(_replicas(mesh, client, "thinker"))
            got: dict[str, list[int]] = {f"s{i}": [] for i in range(4)}

            def stream(rid: str) -> Any:
                for event in client.stream({"n": 60, "step_ms": 50}, request_id=rid):
                    if isinstance(event, Chunk):
                        got[rid].append(event.chunk_id)
                    else:
                        return event
                return None

            run = _run_all({rid: (lambda rid=rid: stream(rid)) for rid in got})
            time.sleep(1.0)
            # Least-outstanding placement put two on each replica; every one is streaming.
            assert all(got[rid] for rid in got), got
            dead_id, dead_pid = next(iter(replicas.items()))
            killed = time.monotonic()
            os.kill(dead_pid, signal.SIGKILL)
            for t in run["threads"]:
                t.join(60)
            out = run["out"]
            failed = [rid for rid in got if isinstance(out[rid], OmniError)]
            assert len(failed) == 2, out
            for rid in failed:
                error = out[rid]
                assert error.code == Code.UNAVAILABLE and error.stage == "thinker", error
                assert dead_id in error.message and "went away" in error.message
                # Noticed by the loss, not by the 60 s timeout (about 0.1 s on an idle
                # host; the bound leaves room for a busy one).
                assert out[rid + ":at"] - killed < 5.0
            for rid in set(got) - set(failed):
                assert got[rid] == list(range(60)), got[rid]
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == []


def test_a_hung_stage_is_noticed_its_requests_end_and_it_is_restarted(tmp_path: Path) -> None:
    # `summarize` not retry-safe: its requests end when it is found hung (a retry-safe
    # one would wait for the restarted process and succeed).
    cfg = yaml.safe_load((PIPELINES / "failover.yaml").read_text())
    cfg["stages"][2]["retry_safe"] = False
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    mesh = Mesh(path)
    mesh.start(timeout=240)
    try:
        with Client(mesh.address or "") as client:  # no timeout of its own
            # No deadline from the client: the pipeline's default (6 s) ends it.
            started = time.monotonic()
            try:
                # (8 s: long enough to outlast the deadline, short enough not to hold
                # `double`'s compute thread through the rest of the test.)
                client.generate({"n": 4, "sleep": 8})
                raise AssertionError("an 8 s request ended before the 6 s default deadline")
            except OmniError as exc:
                assert exc.code == Code.DEADLINE_EXCEEDED, exc
                assert "6s deadline" in exc.message
            assert 5.5 < time.monotonic() - started < 12.0  # the deadline, not a hang

            pid = mesh.processes()["stage-summarize"]
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                client.generate({"n": 4}, timeout=20)
                raise AssertionError("a request through a stopped stage completed")
            except OmniError as exc:
                took = time.monotonic() - stopped
                assert exc.code == Code.UNAVAILABLE and exc.stage == "summarize", exc
                assert "stopped answering" in exc.message
            # liveness_s is 2: noticed within it and the coordinator's 0.5 s tick (about
            # 2.5 s), well before the request's 20 s timeout; room for a busy host.
            assert took < 10.0, took
            # The launcher kills it (its heartbeat stopped) and starts it again.
            deadline = time.monotonic() + 90
            while True:
                status = mesh.status()["stage-summarize"]
                if status["state"] == "running" and status["restarts"] == 1:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
            assert status["last_exit"]["code"] == -signal.SIGKILL
            assert status["last_exit"]["hung"] is True
            out = generate_when_back(client, mesh, deadline)
            assert out["sum"] == 12.0 and out["pid"] != pid
    finally:
        mesh.stop()
    assert shm_names(mesh.shm_prefix) == []

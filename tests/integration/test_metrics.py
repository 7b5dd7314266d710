"""Prometheus /metrics over real processes: endpoints found through DescribePipeline, and
each series moving as requests complete, fail, time out, get aborted and stream.

Only counts and values that follow from what was sent are checked, never timings; the
stage processes report asynchronously, so expectations are polled.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import Samples, scrape, start_mesh

TIMEOUT = 60.0  # generous: only reached when something is broken


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Endpoints:
    """The mesh's /metrics addresses, as DescribePipeline reports them."""

    def __init__(self, client: Client) -> None:
        info = client.describe()
        self.coordinator = info.metrics_address
        self.stages = {s.name: [r.metrics_address for r in s.replicas] for s in info.stages}

    def stage(self, name: str) -> str:
        (address,) = self.stages[name]
        return address

    def snapshot(self) -> dict[str, Samples]:
        """Every endpoint's samples, keyed "coordinator" or by stage name."""
        out = {"coordinator": scrape(self.coordinator)}
        out.update({name: scrape(self.stage(name)) for name in self.stages})
        return out


def eventually(check: Callable[[], list[str]], what: str) -> None:
    """Polls `check` (which returns what is still wrong) until it returns nothing."""
    deadline = time.monotonic() + TIMEOUT
    problems = check()
    while problems:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(problems))
        time.sleep(0.05)
        problems = check()


def expect(problems: list[str], label: str, got: float, want: float) -> None:
    if got != want:
        problems.append(f"{label}: {got} != {want}")


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    # Processes: each serves its own endpoint (LocalMesh starts no metrics server).
    mesh = start_mesh("linear")
    try:
        with Client(mesh.address or "", timeout=60) as c:
            yield c
    finally:
        mesh.stop()


def test_every_process_publishes_its_endpoint(client: Client) -> None:
    ends = Endpoints(client)
    addresses = [ends.coordinator] + [a for addrs in ends.stages.values() for a in addrs]
    assert all(addresses), f"a process reported no metrics address: {addresses}"
    assert len(set(addresses)) == len(addresses), "processes share a metrics endpoint"
    snap = ends.snapshot()
    assert value(snap["coordinator"], "omnirail_requests_running") >= 0
    assert ("omnirail_requests_running", ()) in snap["coordinator"]
    for name in ends.stages:
        # Scrape-time gauges exist for each hosted stage before any request.
        assert ("omnirail_stage_queue_depth", (("stage", name),)) in snap[name]
        assert ("omnirail_stage_inflight", (("stage", name),)) in snap[name]


def test_series_follow_completed_failed_timed_out_and_aborted_requests(client: Client) -> None:
    ends = Endpoints(client)
    before = ends.snapshot()
    n_big = 1 << 16  # 256 KiB of float32: through shm on both edges (inline bound 1 KiB)

    # Completed, through the relay.
    assert client.generate({"n": n_big}).output["n"] == n_big
    # Failed in `double`.
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4, "fail": "boom"})
    assert info.value.code == Code.INTERNAL
    # Failed at the coordinator's deadline while `double` computes.
    with pytest.raises(OmniError) as info:
        client.generate({"n": 4, "sleep": 1.0}, timeout=0.3)
    assert info.value.code == Code.DEADLINE_EXCEEDED

    # Aborted by the client while running; a second request waits in `double`'s queue.
    slow = f"metrics-slow-{uuid.uuid4().hex[:8]}"
    client.submit({"n": 4, "sleep": 3.0}, request_id=slow)
    queued = client.submit({"n": 4})

    def live() -> list[str]:
        coord, double = scrape(ends.coordinator), scrape(ends.stage("double"))
        problems: list[str] = []
        if value(coord, "omnirail_requests_running") < 2:
            problems.append(f"running: {value(coord, 'omnirail_requests_running')} < 2")
        if value(double, "omnirail_stage_inflight", stage="double") < 2:
            problems.append("double holds fewer than 2 requests")
        if value(double, "omnirail_stage_queue_depth", stage="double") < 1:
            problems.append("nothing waits in double's queue")
        return problems

    eventually(live, "the running, in-flight and queued requests to show")
    client.abort(slow, reason="metrics test")
    assert client.wait(queued, timeout=TIMEOUT).state == "completed"

    def settled() -> list[str]:
        after = ends.snapshot()
        problems: list[str] = []

        def delta(where: str, name: str, **labels: str) -> float:
            return value(after[where], name, **labels) - value(before[where], name, **labels)

        # Coordinator: states, end-to-end latency, aborts by reason, nothing left running.
        for state, want in (("completed", 2), ("failed", 2), ("aborted", 1)):
            expect(
                problems,
                f"requests {state}",
                delta("coordinator", "omnirail_requests_total", state=state),
                want,
            )
            expect(
                problems,
                f"duration count {state}",
                delta("coordinator", "omnirail_request_duration_seconds_count", state=state),
                want,
            )
        for reason, want in (("client", 1), ("deadline", 1), ("stage_error", 1)):
            expect(
                problems,
                f"aborts {reason}",
                delta("coordinator", "omnirail_aborts_total", reason=reason),
                want,
            )
        expect(
            problems,
            "aborts unavailable",
            delta("coordinator", "omnirail_aborts_total", reason="unavailable"),
            0,
        )
        expect(problems, "running", value(after["coordinator"], "omnirail_requests_running"), 0)
        # No request here streamed, so no time to first chunk.
        expect(
            problems,
            "first chunk count",
            delta("coordinator", "omnirail_time_to_first_chunk_seconds_count"),
            0,
        )

        # Stages: outcomes. Every request passed `source`; `double` failed one and dropped
        # two on the coordinator's abort; two reached `summarize`.
        outcomes = {
            "source": {"completed": 5, "failed": 0, "aborted": 0},
            "double": {"completed": 2, "failed": 1, "aborted": 2},
            "summarize": {"completed": 2, "failed": 0, "aborted": 0},
        }
        for stage, wants in outcomes.items():
            for outcome, want in wants.items():
                expect(
                    problems,
                    f"{stage} {outcome}",
                    delta(stage, "omnirail_stage_requests_total", stage=stage, outcome=outcome),
                    want,
                )
            expect(
                problems,
                f"{stage} in flight",
                value(after[stage], "omnirail_stage_inflight", stage=stage),
                0,
            )
        # Queue and compute: one observation per result a stage sent on (the failed and
        # aborted requests sent none from `double`).
        for stage, want in (("source", 5), ("double", 2), ("summarize", 2)):
            for series in ("omnirail_stage_queue_seconds", "omnirail_stage_compute_seconds"):
                expect(
                    problems,
                    f"{stage} {series} count",
                    delta(stage, f"{series}_count", stage=stage),
                    want,
                )
            if delta(stage, "omnirail_stage_compute_seconds_sum", stage=stage) <= 0:
                problems.append(f"{stage}: no compute time observed")

        # Relay: the one large request crossed both edges through shm, put by the sender
        # and got by the receiver, the same bytes on each side.
        for sender, receiver in (("source", "double"), ("double", "summarize")):
            edge = f"{sender}->{receiver}"
            put = {"backend": "shm", "edge": edge, "op": "put"}
            get = {"backend": "shm", "edge": edge, "op": "get"}
            put_bytes = delta(sender, "omnirail_relay_bytes_total", **put)
            get_bytes = delta(receiver, "omnirail_relay_bytes_total", **get)
            if put_bytes < n_big * 4:
                problems.append(f"{edge}: put {put_bytes} bytes < {n_big * 4}")
            expect(problems, f"{edge} get bytes", get_bytes, put_bytes)
            expect(
                problems,
                f"{edge} put count",
                delta(sender, "omnirail_relay_seconds_count", **put),
                1,
            )
            expect(
                problems,
                f"{edge} get count",
                delta(receiver, "omnirail_relay_seconds_count", **get),
                1,
            )
        return problems

    eventually(settled, "the series to reflect the requests")


@pytest.fixture(scope="module")
def streaming_mesh() -> Iterator[Mesh]:
    mesh = start_mesh("streaming")
    yield mesh
    mesh.stop()


def test_time_to_first_chunk_counts_streamed_requests_only(streaming_mesh: Mesh) -> None:
    with Client(streaming_mesh.address or "", timeout=60) as client:
        ends = Endpoints(client)
        before = scrape(ends.coordinator)
        events = list(client.stream({"n": 6}))
        assert any(isinstance(e, Chunk) for e in events)
        client.generate({"n": 6})  # the same pipeline, not streamed to the client

        def settled() -> list[str]:
            after = scrape(ends.coordinator)
            problems: list[str] = []
            for name, want in (
                ("omnirail_time_to_first_chunk_seconds_count", 1),
                ("omnirail_requests_total", 2),
            ):
                labels = {"state": "completed"} if name == "omnirail_requests_total" else {}
                expect(
                    problems,
                    name,
                    value(after, name, **labels) - value(before, name, **labels),
                    want,
                )
            first = value(after, "omnirail_time_to_first_chunk_seconds_sum") - value(
                before, "omnirail_time_to_first_chunk_seconds_sum"
            )
            if first <= 0:
                problems.append("no time to first chunk observed")
            return problems

        eventually(settled, "time to first chunk")


def test_relayed_stream_chunks_count_on_both_sides(streaming_mesh: Mesh) -> None:
    chunk_bytes = 128 << 10  # above the 64 KiB inline bound: every chunk goes through shm
    with Client(streaming_mesh.address or "", timeout=60) as client:
        ends = Endpoints(client)
        before = ends.snapshot()
        events = list(client.stream({"n": 3, "chunk_bytes": chunk_bytes}))
        assert sum(isinstance(e, Chunk) for e in events) >= 1

        def settled() -> list[str]:
            after = ends.snapshot()
            problems: list[str] = []
            for sender, receiver in (("thinker", "talker"), ("talker", "vocoder")):
                edge = f"{sender}->{receiver}"
                put = {"backend": "shm", "edge": edge, "op": "put"}
                get = {"backend": "shm", "edge": edge, "op": "get"}

                def delta(where: str, name: str, labels: dict[str, str]) -> float:
                    return value(after[where], name, **labels) - value(
                        before[where], name, **labels
                    )

                put_bytes = delta(sender, "omnirail_relay_bytes_total", put)
                if put_bytes < 3 * chunk_bytes:
                    problems.append(f"{edge}: put {put_bytes} bytes < {3 * chunk_bytes}")
                expect(
                    problems,
                    f"{edge} get bytes",
                    delta(receiver, "omnirail_relay_bytes_total", get),
                    put_bytes,
                )
                expect(
                    problems, f"{edge} puts", delta(sender, "omnirail_relay_seconds_count", put), 3
                )
                expect(
                    problems,
                    f"{edge} gets",
                    delta(receiver, "omnirail_relay_seconds_count", get),
                    3,
                )
            return problems

        eventually(settled, "relayed stream chunks to be counted")

"""`tp_size: 2` on the CPU: two real rank processes in a gloo group serve a sharded MLP
with the outputs of the unsharded one; a rank killed mid-request fails that request with
UNAVAILABLE within a second, and the launcher restarts the group, which serves again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from omnirail.client.sdk import Client
from omnirail.models.omni_demo import pipeline_file
from omnirail.ops.launcher import Mesh
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import PIPELINES, start_mesh

pytestmark = pytest.mark.slow  # ~20-40 s: two meshes, a group restart


@pytest.fixture(scope="module")
def meshes() -> Iterator[tuple[Mesh, Mesh]]:
    single = start_mesh("tp_mlp_single")
    try:
        group = start_mesh("tp_mlp")
    except BaseException:
        single.stop()
        raise
    yield single, group
    group.stop()
    single.stop()


def test_two_ranks_give_what_one_gives(meshes: tuple[Mesh, Mesh]) -> None:
    single, group = meshes
    names = set(group.processes())
    assert {"stage-mlp_tp0", "stage-mlp_tp1"} <= names and "stage-mlp" not in names
    with (
        Client(single.address or "", timeout=60) as a,
        Client(group.address or "", timeout=60) as b,
    ):
        for seed, rows in ((0, 1), (1, 4), (2, 33)):
            want = a.generate({"seed": seed, "rows": rows}).output
            got = b.generate({"seed": seed, "rows": rows}).output
            assert (want["ranks"], want["part"]) == (1, 128)
            assert (got["ranks"], got["part"]) == (2, 64)  # each rank holds half the layer
            assert got["y"].shape == (rows, 32)
            torch.testing.assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5)
            assert not torch.equal(got["y"], torch.zeros_like(got["y"]))


def test_a_killed_rank_fails_its_request_fast_and_the_group_comes_back(
    meshes: tuple[Mesh, Mesh],
) -> None:
    single, group = meshes
    before = group.processes()
    with Client(group.address or "", timeout=60) as client:
        outcome: list[object] = []

        def slow_request() -> None:
            try:
                outcome.append(client.generate({"seed": 5, "rows": 2, "sleep_s": 30}).output)
            except OmniError as exc:
                outcome.append((time.monotonic(), exc))

        worker = threading.Thread(target=slow_request)
        worker.start()
        time.sleep(1.5)  # rank 0 waits in the all-reduce for the slow rank 1
        assert not outcome, outcome
        killed_at = time.monotonic()
        os.kill(before["stage-mlp_tp1"], signal.SIGKILL)
        worker.join(30)
        [(failed_at, error)] = outcome  # type: ignore[misc]
        assert isinstance(error, OmniError) and error.code == Code.UNAVAILABLE, error
        assert failed_at - killed_at < 1.0, failed_at - killed_at
        # Both ranks start again (new processes) and the group serves the same answers.
        deadline = time.monotonic() + 90
        while True:
            try:
                out = client.generate({"seed": 3, "rows": 5}).output
                break
            except OmniError as exc:
                assert exc.code == Code.UNAVAILABLE, exc
                assert time.monotonic() < deadline, group.log_tails()
                time.sleep(0.2)
    after = group.processes()
    assert after["stage-mlp_tp0"] != before["stage-mlp_tp0"]
    assert after["stage-mlp_tp1"] != before["stage-mlp_tp1"]
    assert out["mlp_pid"] == after["stage-mlp_tp0"] and out["ranks"] == 2
    with Client(single.address or "", timeout=60) as a:
        want = a.generate({"seed": 3, "rows": 5}).output
    torch.testing.assert_close(out["y"], want["y"], rtol=1e-5, atol=1e-5)
    # The mesh itself never saw a process exit it would stop for.
    assert group.poll_exited() == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_ranks_on_two_gpus_give_what_one_gives(
    meshes: tuple[Mesh, Mesh], tmp_path: Path
) -> None:
    """The same group on GPUs 0 and 1 (NCCL for the all-reduce, gloo for the calls)."""
    cfg = yaml.safe_load((PIPELINES / "tp_mlp.yaml").read_text())
    cfg["name"] = "it-tp-mlp-gpus"
    cfg["stages"][1]["gpu"] = [0, 1]
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    single, _ = meshes
    with Mesh(path) as gpus, Client(gpus.address or "", timeout=60) as client:
        got = client.generate({"seed": 7, "rows": 6}).output
    with Client(single.address or "", timeout=60) as a:
        want = a.generate({"seed": 7, "rows": 6}).output
    assert got["ranks"] == 2
    torch.testing.assert_close(got["y"], want["y"], rtol=1e-4, atol=1e-4)


def _demo_copy(where: Path, tp_size: int) -> Path:
    """The installed omni demo's pipeline in `where` with its thinker on `tp_size` ranks."""
    where.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(pipeline_file().read_text())
    for stage in cfg["stages"]:
        if stage["name"] == "thinker":
            stage["tp_size"] = tp_size
    path = where / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_demo_thinker_sharded_over_two_ranks_says_the_same(tmp_path: Path) -> None:
    """The omni demo's thinker (a toy transformer with KV caches under continuous
    batching) with its heads and MLPs split over two ranks: the same words and audio as
    on one rank, for requests alone and together."""
    inputs = [
        {"text": f"tell me a story {i}", "max_new_tokens": 6 + 4 * i, "seed": i, "temperature": 0}
        for i in range(4)
    ]
    outputs: dict[int, list[Any]] = {}
    for tp_size in (1, 2):
        with Mesh(_demo_copy(tmp_path / f"tp{tp_size}", tp_size)) as mesh:
            if tp_size == 2:
                assert {"stage-thinker_tp0", "stage-thinker_tp1"} <= set(mesh.processes())
            with Client(mesh.address or "", timeout=120) as client:
                alone = [client.generate(x).outputs for x in inputs]
                with ThreadPoolExecutor(len(inputs)) as pool:
                    together = list(pool.map(lambda x: client.generate(x).outputs, inputs))
            assert together == alone
            outputs[tp_size] = alone
    for one, two in zip(outputs[1], outputs[2], strict=True):
        assert two["decode"]["text"] == one["decode"]["text"]
        assert two["code2wav"]["samples"] == one["code2wav"]["samples"]

"""Fuzzing of `torchdist` relay descriptors (see test_relay_descriptor_fuzz.py for the
cases and the checks): rank 0 sends, rank 1 of the same two-rank gloo group receives,
both in this process. Runs with `-k torchdist`, as scripts/test.sh runs its other tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import given

torchdist = pytest.importorskip("omnirail.relay.torchdist")

from omnirail.relay.base import RelaySettings, create_relay  # noqa: E402
from omnirail.relay.pull import PullRelay  # noqa: E402
from tests.fuzz.test_relay_descriptor_fuzz import (  # noqa: E402
    CASES,
    PULL_OPTIONS,
    MiB,
    PullEnv,
    pull_env,
)


@pytest.fixture(scope="module")
def torchdist_env() -> Iterator[PullEnv]:
    async def make() -> tuple[PullRelay, PullRelay]:
        options = {**PULL_OPTIONS, "init_method": "tcp://127.0.0.1:0", "timeout_s": 30.0}
        first = RelaySettings(pool_bytes=MiB, rank=0, world_size=2, options=options)
        sender = create_relay("torchdist", first)
        try:
            receiver = create_relay("torchdist", torchdist.pair_settings(sender, first, 1))
        except BaseException:
            sender.close()
            raise
        try:
            await asyncio.gather(sender.connect(30), receiver.connect(30))
        except BaseException:
            receiver.close()
            sender.close()
            raise
        return sender, receiver  # type: ignore[return-value]

    yield from pull_env("torchdist", make)


@given(case=CASES)
def test_torchdist_descriptor_fuzz(torchdist_env: PullEnv, case: bytes) -> None:
    torchdist_env.check(case)


def test_torchdist_fuzz_left_it_working(torchdist_env: PullEnv) -> None:
    torchdist_env.finish()

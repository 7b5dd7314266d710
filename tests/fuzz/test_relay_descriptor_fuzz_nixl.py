"""Fuzzing of `nixl` relay descriptors (see test_relay_descriptor_fuzz.py for the cases
and the checks). nixl brings its own UCX build, as ucxx does: this module runs in a
process of its own (`-k nixl`) and skips where ucxx is loaded already."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from hypothesis import given

if "ucxx" in sys.modules:  # two UCX builds in one interpreter: never
    pytest.skip("ucxx is loaded in this process; run with -k nixl", allow_module_level=True)
nixl = pytest.importorskip("omnirail.relay.nixl")

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
def nixl_env() -> Iterator[PullEnv]:
    async def make() -> tuple[PullRelay, PullRelay]:
        settings = RelaySettings(pool_bytes=MiB, options=PULL_OPTIONS)
        return create_relay("nixl", settings), create_relay("nixl", settings)  # type: ignore[return-value]

    yield from pull_env("nixl", make)


@given(case=CASES)
def test_nixl_descriptor_fuzz(nixl_env: PullEnv, case: bytes) -> None:
    nixl_env.check(case)


def test_nixl_fuzz_left_it_working(nixl_env: PullEnv) -> None:
    nixl_env.finish()

"""Fuzzing of `ucx` relay descriptors (see test_relay_descriptor_fuzz.py for the cases
and the checks). ucxx brings its own UCX build, as nixl does: this module runs in a
process of its own (`-k ucx`) and skips where nixl is loaded already."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from hypothesis import given

if any(name.split(".")[0] in ("nixl", "nixl_cu12") for name in sys.modules):
    pytest.skip("nixl is loaded in this process; run with -k ucx", allow_module_level=True)
ucx = pytest.importorskip("omnirail.relay.ucx")

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
def ucx_env() -> Iterator[PullEnv]:
    async def make() -> tuple[PullRelay, PullRelay]:
        settings = RelaySettings(pool_bytes=MiB, options=PULL_OPTIONS)
        return create_relay("ucx", settings), create_relay("ucx", settings)  # type: ignore[return-value]

    yield from pull_env("ucx", make)


@given(case=CASES)
def test_ucx_descriptor_fuzz(ucx_env: PullEnv, case: bytes) -> None:
    ucx_env.check(case)


def test_ucx_fuzz_left_it_working(ucx_env: PullEnv) -> None:
    ucx_env.finish()

"""TensorParallel: what a factory gets; a shared call on a group of one is the call itself,
and names are checked. Groups of several ranks run in tests/integration (real processes)."""

from __future__ import annotations

import pytest

from omnirail.stage.tp import TensorParallel, TensorParallelBroken
from omnirail.wire.errors import Code


def test_a_group_of_one_runs_shared_calls_directly() -> None:
    tp = TensorParallel("mlp")
    assert (tp.rank, tp.size, tp.group, tp.device) == (0, 1, None, "cpu")

    def double(x: int) -> int:
        return 2 * x

    assert tp.shared("double", double) is double
    with pytest.raises(ValueError, match="already used"):
        tp.shared("double", double)
    with pytest.raises(ValueError, match="reserved"):
        tp.shared("__stop__", double)
    tp.stop_followers()  # nothing to tell
    tp.close()


def test_a_broken_group_fails_calls_as_unavailable_and_says_so_once() -> None:
    told: list[str] = []
    tp = TensorParallel("mlp", rank=0, size=2)
    tp.on_broken = lambda: told.append("broken")
    lead = tp.shared("fn", lambda x: x)
    tp._break("RuntimeError: Connection closed by peer")
    tp._break("again")
    assert told == ["broken"] and tp.broken == "RuntimeError: Connection closed by peer"
    with pytest.raises(TensorParallelBroken) as info:
        lead(1)
    assert info.value.code == Code.UNAVAILABLE and info.value.stage == "mlp"
    assert "tensor-parallel group of stage 'mlp' broke" in info.value.message

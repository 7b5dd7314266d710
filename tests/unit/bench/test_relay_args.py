"""`omnirail bench relay` refuses what it cannot run before it starts a receiver."""

from __future__ import annotations

import pytest

from omnirail.bench.relay_bench import check_relay_args


@pytest.mark.parametrize(
    ("backend", "sizes", "options", "receiver", "problem"),
    [
        ("nosuch", None, {}, {}, "--backend 'nosuch': no such relay backend (known: shm, nixl"),
        ("inline", None, {}, {}, "--backend inline: it carries payloads inside"),
        ("shm", [4096, 0], {}, {}, "--sizes: byte counts must be at least 1, got 0"),
        ("shm", None, {"nosuch": 1}, {}, "--option: nosuch: unknown option for backend 'shm'"),
        ("shm", None, {}, {"host": "x"}, "--receiver-option: host: unknown option"),
        ("shm", None, {}, {"copy_threads": 0}, "--receiver-option: copy_threads: "),
        ("ucx", None, {"progress": "x"}, {}, "--option: progress: "),
    ],
)
def test_what_cannot_run_is_refused(
    backend: str, sizes: list[int] | None, options: dict, receiver: dict, problem: str
) -> None:
    with pytest.raises(ValueError) as ei:
        check_relay_args(backend, sizes, options, receiver)
    assert str(ei.value).startswith(problem), ei.value


@pytest.mark.parametrize("backend", ["shm", "nixl", "ucx", "torchdist"])
def test_every_moving_backend_with_its_own_options_is_accepted(backend: str) -> None:
    receiver = {"host": "10.0.0.2"} if backend in ("nixl", "ucx") else {}
    check_relay_args(backend, [1, 4096], {}, receiver)

"""Relay options in a pipeline config: checked per level against the backend it selects."""

from __future__ import annotations

from typing import Any

import pytest

from omnirail.config import PipelineConfig
from tests.unit.config.helpers import config_error, pipe, st

TD = {"world_size": 2, "options": {"init_method": "tcp://10.0.0.1:29500"}}

# Every option the relays guide (docs/guides/relays.md) lists, with a valid value, per backend.
COPY = {"copy_thread_bytes": 1 << 20, "copy_threads": 1}
PULLED = {**COPY, "peer_wait_s": 2, "fetch_timeout_s": 10.5, "connect_timeout_s": 30, "host": "h"}
GUIDE_OPTIONS: dict[str, dict[str, Any]] = {
    "shm": {**COPY, "forward_views": False},
    "nixl": {
        **PULLED,
        "ucx_error_handling_mode": "peer",
        "progress_thread": True,
        "num_threads": 2,
        "chunk_bytes": 1 << 20,
        "spin_us": 0,
        "handle_cache": 16,
        "listen": "127.0.0.1",
    },
    "ucx": {
        **PULLED,
        "progress": "polling",
        "ucx_config": {"TLS": "tcp"},
        "listen": "127.0.0.1",
    },
    "torchdist": {
        **PULLED,
        "init_method": "tcp://10.0.0.1:29500",
        "timeout_s": 60,
        "gloo_host": "10.0.0.2",
    },
}


def edge(backend: str, **kw: Any) -> dict[str, Any]:
    """Stage a sends to b with `backend` (its own relay stays shm)."""
    extra = {**TD, "rank": 0} if backend == "torchdist" else {}
    relay_to = {"b": {"backend": backend, **extra, **kw}}
    b_relay = {"rank": 1} if backend == "torchdist" else None
    b = st("b", terminal=True, **({"relay": b_relay} if b_relay else {}))
    a_relay = {"relay": {"rank": 0}} if backend == "torchdist" else {}
    return pipe(st("a", next="b", relay_to=relay_to, **a_relay), b)


@pytest.mark.parametrize("backend", sorted(GUIDE_OPTIONS))
def test_every_documented_option_is_accepted(backend: str) -> None:
    cfg = PipelineConfig.from_dict(edge(backend, options=GUIDE_OPTIONS[backend]))
    assert cfg.relay_for("a", "b").options == GUIDE_OPTIONS[backend]


@pytest.mark.parametrize(
    "backend, key, want",
    [
        ("shm", "forward_view", "forward_views"),
        ("shm", "copy_thread", "copy_threads"),
        ("nixl", "fetch_timout_s", "fetch_timeout_s"),
        ("nixl", "ucx_error_handling", "ucx_error_handling_mode"),
        ("ucx", "ucxconfig", "ucx_config"),
        ("ucx", "peer_wait", "peer_wait_s"),
        ("torchdist", "init_methd", "init_method"),
        ("torchdist", "gloohost", "gloo_host"),
    ],
)
def test_a_misspelt_option_is_named_with_a_suggestion(backend: str, key: str, want: str) -> None:
    err = config_error(edge(backend, options={key: 1}))
    assert (
        f"stages[a].relay_to[b].options.{key}: unknown option for backend {backend!r} "
        f"(did you mean {want}?)"
    ) in err.errors


def test_the_issue_example() -> None:
    d = pipe(
        st("thinker", next="talker", relay_to={"talker": {"backend": "nixl"}}),
        st("talker", terminal=True),
    )
    d["stages"][0]["relay_to"]["talker"]["options"] = {"fetch_timout_s": 5}
    assert config_error(d).errors == [
        "stages[thinker].relay_to[talker].options.fetch_timout_s: unknown option for backend "
        "'nixl' (did you mean fetch_timeout_s?)"
    ]


def test_every_level_names_its_place() -> None:
    d = pipe(
        st("x", next="y", relay={"backend": "ucx", "options": {"lisen": 1}}),
        st("y", terminal=True, relay={"options": {"copy_threads": "2"}}),
        relay={"backend": "nixl", "options": {"num_threads": -1, "host": 5}},
    )
    errors = config_error(d).errors
    assert errors == [
        "pipeline.relay.options.host: input should be a valid string",
        "pipeline.relay.options.num_threads: input should be greater than or equal to 0",
        "stages[x].relay.options.lisen: unknown option for backend 'ucx' (did you mean listen?)",
        "stages[y].relay.options.copy_threads: input should be a valid integer",
    ]


SHM = "unknown option for backend 'shm'"


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"copy_threads": "two"}, "copy_threads: input should be a valid integer"),
        ({"copy_threads": True}, "copy_threads: input should be a valid integer"),
        ({"copy_thread_bytes": -1}, "copy_thread_bytes: input should be greater than or equal"),
        ({"forward_views": "yes"}, "forward_views: input should be a valid boolean"),
        ({"device": "cuda:0"}, f"device: {SHM} (device is a relay field, not an option)"),
        ({"x": 1}, f"x: {SHM} (options: copy_thread_bytes, copy_threads, forward_views)"),
    ],
)
def test_mistyped_and_out_of_range_values(options: dict[str, Any], problem: str) -> None:
    d = pipe(st("a", terminal=True), relay={"options": options})
    (error,) = config_error(d).errors
    assert error.startswith(f"pipeline.relay.options.{problem}")


def test_edge_options_are_checked_against_the_backend_the_edge_keeps() -> None:
    # relay_to[b] keeps the stage's backend (nixl): its options are nixl's, not shm's.
    d = pipe(
        st("a", next="b", relay={"backend": "nixl"}, relay_to={"b": {"credits": 8}}),
        st("b", terminal=True),
    )
    d["stages"][0]["relay_to"]["b"]["options"] = {"handle_cache": 4}
    PipelineConfig.from_dict(d)
    d["stages"][0]["relay_to"]["b"]["options"] = {"forward_views": False}
    assert config_error(d).errors == [
        "stages[a].relay_to[b].options.forward_views: unknown option for backend 'nixl' "
        "(options: chunk_bytes, connect_timeout_s, copy_thread_bytes, copy_threads, "
        "fetch_timeout_s, handle_cache, host, listen, num_threads, peer_wait_s, progress_thread, "
        "spin_us, ucx_error_handling_mode)"
    ]


def test_a_level_that_changes_the_backend_starts_without_the_inherited_options() -> None:
    d = pipe(
        st("a", next="b", relay_to={"b": {"backend": "shm"}}),
        st("b", terminal=True),
        relay={"backend": "nixl", "options": {"ucx_error_handling_mode": "peer"}},
    )
    cfg = PipelineConfig.from_dict(d)
    assert cfg.relay_for("a").options == {"ucx_error_handling_mode": "peer"}
    assert cfg.relay_for("a", "b").options == {}
    # Setting options with the new backend keeps them; the same backend inherits them.
    d["stages"][0]["relay_to"]["b"]["options"] = {"forward_views": False}
    assert PipelineConfig.from_dict(d).relay_for("a", "b").options == {"forward_views": False}
    d["stages"][0]["relay_to"]["b"] = {"backend": "nixl", "credits": 4}
    cfg = PipelineConfig.from_dict(d)
    assert cfg.relay_for("a", "b").options == {"ucx_error_handling_mode": "peer"}


def test_an_unknown_backend_is_reported_once_not_its_options() -> None:
    d = pipe(st("a", terminal=True), relay={"backend": "rdma", "options": {"x": 1}})
    assert config_error(d).errors == [
        "pipeline.relay.backend: unknown relay backend 'rdma'; known: inline, nixl, shm, "
        "torchdist, ucx"
    ]


def _guide_options() -> dict[str, set[str]]:
    """Backtick-quoted names in the relays guide's option bullets (docs/guides/relays.md,
    "Backend options"), by the backends each bullet is about."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[3] / "docs/guides/relays.md").read_text(encoding="utf-8")
    section = text.split("## Backend options", 1)[1].split("\n## ", 1)[0]
    bullets = section.split("The options of each backend:", 1)[1].split("\n\n", 2)[1]
    heads = {
        "- `shm` and all pulled backends": ("shm", "nixl", "ucx", "torchdist"),
        "- `shm`:": ("shm",),
        "- all pulled backends:": ("nixl", "ucx", "torchdist"),
        "- `nixl`:": ("nixl",),
        "- `ucx`:": ("ucx",),
        "- `torchdist`:": ("torchdist",),
    }
    found: dict[str, set[str]] = {b: set() for b in GUIDE_OPTIONS}
    not_options = {"none", "peer", "blocking", "polling", "relay", "rank", "world_size"}
    for bullet in re.split(r"\n(?=- )", bullets.strip()):
        (backends,) = [b for head, b in heads.items() if bullet.startswith(head)]
        for name in re.findall(r"`([a-z_]+)`", bullet):
            if name not in not_options and name not in found:
                for backend in backends:
                    found[backend].add(name)
    return found


def test_the_relays_guide_lists_exactly_the_options_of_each_backend() -> None:
    from omnirail.relay import registry

    for backend, names in _guide_options().items():
        model = registry.options_model(backend)
        assert model is not None
        assert names == set(model.model_fields), backend
        assert names == set(GUIDE_OPTIONS[backend]), backend  # all tried above

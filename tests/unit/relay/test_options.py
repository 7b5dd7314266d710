"""relay.options and relay.registry: typed options per backend, one lazy registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnirail.relay import registry
from omnirail.relay.base import RelayError, RelaySettings, create_relay, relay_backends
from omnirail.relay.options import (
    CopyOptions,
    InlineOptions,
    NixlOptions,
    OptionsError,
    PulledOptions,
    ShmOptions,
    TorchdistOptions,
    UcxOptions,
    option_problems,
    parse_options,
)


def test_registry_lists_every_backend_with_its_options_model() -> None:
    assert relay_backends() == ["inline", "nixl", "shm", "torchdist", "ucx"]
    models = {name: b.options for name, b in registry.BACKENDS.items()}
    assert models == {
        "inline": InlineOptions,
        "shm": ShmOptions,
        "nixl": NixlOptions,
        "ucx": UcxOptions,
        "torchdist": TorchdistOptions,
    }
    for model in (ShmOptions, NixlOptions, UcxOptions, TorchdistOptions):
        assert issubclass(model, CopyOptions)
    for model in (NixlOptions, UcxOptions, TorchdistOptions):
        assert issubclass(model, PulledOptions)
    assert registry.options_model("carrier-pigeon") is None


def test_importing_the_registry_and_base_loads_no_backend_library() -> None:
    code = (
        "import sys\n"
        "from omnirail.relay import base, registry\n"
        "from omnirail.config import PipelineConfig\n"
        "PipelineConfig.from_dict({'stages': [{'name': 'a', 'factory': 'os:getcwd',"
        " 'terminal': True}], 'relay': {'backend': 'nixl', 'options': {'num_threads': 1}}})\n"
        "base.relay_backends()\n"
        "loaded = [m for m in ('nixl', 'nixl_cu12', 'ucxx', 'torch.distributed',"
        " 'omnirail.relay.nixl', 'omnirail.relay.ucx', 'omnirail.relay.torchdist',"
        " 'omnirail.relay.shm') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_defaults_are_the_documented_ones() -> None:
    shm = ShmOptions()
    assert (shm.copy_thread_bytes, shm.copy_threads, shm.forward_views) == (8 << 20, 2, True)
    nixl = NixlOptions()
    assert (nixl.peer_wait_s, nixl.fetch_timeout_s, nixl.connect_timeout_s) == (5, 30, 60)
    assert nixl.host is None
    assert (nixl.ucx_error_handling_mode, nixl.progress_thread, nixl.num_threads) == (
        "none",
        False,
        0,
    )
    assert (nixl.chunk_bytes, nixl.spin_us, nixl.handle_cache) == (8 << 20, 30, 128)
    ucx = UcxOptions()
    assert (ucx.progress, ucx.listen, ucx.ucx_config) == ("blocking", None, {})
    td = TorchdistOptions()
    assert (td.init_method, td.timeout_s, td.gloo_host) == (None, 120, None)


UNKNOWN = "unknown option for backend 'x'"


@pytest.mark.parametrize(
    "model, options, problem",
    [
        (ShmOptions, {"copy_thread": 1}, UNKNOWN + " (did you mean copy_threads?)"),
        (ShmOptions, {"forward_views": "no"}, "input should be a valid boolean"),
        (ShmOptions, {"copy_threads": 0}, "input should be greater than or equal to 1"),
        (ShmOptions, {"copy_threads": True}, "input should be a valid integer"),
        (ShmOptions, {"copy_threads": 2.0}, "input should be a valid integer"),
        (NixlOptions, {"fetch_timout_s": 1}, UNKNOWN + " (did you mean fetch_timeout_s?)"),
        (NixlOptions, {"ucx_error_handling_mode": "maybe"}, "input should be 'none' or 'peer'"),
        (NixlOptions, {"handle_cache": -1}, "input should be greater than or equal to 0"),
        (UcxOptions, {"lisen": "::1"}, UNKNOWN + " (did you mean listen?)"),
        (UcxOptions, {"progress": "sometimes"}, "input should be 'blocking' or 'polling'"),
        (UcxOptions, {"ucx_config": {"TLS": ["tcp"]}}, "input should be a valid string"),
        (TorchdistOptions, {"init_method": "env://"}, "want 'tcp://host:port', got 'env://'"),
        (TorchdistOptions, {"timeout_s": 0}, "input should be greater than 0"),
        (TorchdistOptions, {"timeout_s": float("inf")}, "input should be a finite number"),
        (NixlOptions, {"fetch_timeout_s": float("nan")}, "input should be a finite number"),
        (TorchdistOptions, {"rank": 1}, UNKNOWN + " (rank is a relay field, not an option)"),
        (InlineOptions, {"copy_threads": 1}, UNKNOWN + " (it takes no options)"),
    ],
)
def test_models_refuse_unknown_mistyped_and_out_of_range(model, options, problem) -> None:
    ((key, why),) = option_problems("x", model, options)
    assert why == problem
    assert key.split(".")[0] in options


def test_an_unknown_option_without_a_close_name_lists_the_options() -> None:
    ((_, why),) = option_problems("ucx", UcxOptions, {"zzz": 1})
    assert why.startswith("unknown option for backend 'ucx' (options: connect_timeout_s, ")


def test_values_are_typed_and_ucx_config_reads_numbers_as_text() -> None:
    ucx = parse_options("ucx", UcxOptions, {"ucx_config": {"TLS": "tcp", "RNDV_THRESH": 8192}})
    assert ucx.ucx_config == {"TLS": "tcp", "RNDV_THRESH": "8192"}  # type: ignore[attr-defined]
    nixl = parse_options("nixl", NixlOptions, {"fetch_timeout_s": 3})
    assert nixl.fetch_timeout_s == 3.0  # type: ignore[attr-defined]


def test_create_relay_types_the_options_and_names_every_refused_one() -> None:
    relay = create_relay("shm", RelaySettings(options={"copy_threads": 1}))
    try:
        assert relay.options == ShmOptions(copy_threads=1)  # type: ignore[attr-defined]
    finally:
        relay.close()
    with pytest.raises(RelayError) as err:
        create_relay("shm", RelaySettings(options={"copy_threads": 0, "forward_view": True}))
    assert str(err.value) == (
        "shm relay options: copy_threads: input should be greater than or equal to 1; "
        "forward_view: unknown option for backend 'shm' (did you mean forward_views?)"
    )
    with pytest.raises(RelayError, match="unknown relay backend 'carrier-pigeon'"):
        create_relay("carrier-pigeon")


def test_options_of_another_backend_are_reparsed() -> None:
    with pytest.raises(OptionsError, match="listen: unknown option for backend 'shm'"):
        parse_options("shm", ShmOptions, UcxOptions(listen="127.0.0.1", copy_threads=3))
    shm = parse_options("shm", ShmOptions, UcxOptions(copy_threads=3))
    assert shm == ShmOptions(copy_threads=3)


def test_settings_round_trip_through_json() -> None:
    settings = RelaySettings(rank=1, world_size=2, options=TorchdistOptions(timeout_s=5))
    again = RelaySettings(**settings.as_dict())
    assert again.as_dict() == settings.as_dict()
    assert again.options_as("torchdist", TorchdistOptions) == TorchdistOptions(timeout_s=5)

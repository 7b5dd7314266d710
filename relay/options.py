"""Typed options of every relay backend: one pydantic model each, defaults in one place.

A backend's options are what `RelayConfig.options` may hold for it; anything else is
refused (`extra="forbid"`), and values keep their types strictly (an integer option takes
no bool, float or string). The backends read these models, never a raw dict:

- `CopyOptions`: the copy-in of the sending relays (shm and the pulled ones), see
  `omnirail.relay.copy`.
- `ShmOptions`, and `PulledOptions` shared by `NixlOptions`, `UcxOptions` and
  `TorchdistOptions`; `InlineOptions` has none.

Pool size, device, rank and world size are `RelaySettings` fields, not options. Importing
this module needs pydantic only (config validation reads the models without the backends'
libraries).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_COPY_THREAD_BYTES = 8 << 20
DEFAULT_COPY_THREADS = 2
DEFAULT_PEER_WAIT_S = 5.0
DEFAULT_FETCH_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0
# `RelayConfig` fields that are not options (a hint when one is given as an option).
RELAY_FIELDS = frozenset(
    ("backend", "inline_bytes", "pool_mb", "credits", "credit_mb", "device", "rank", "world_size")
)


class RelayOptions(BaseModel):
    """Base of every backend's options: strict types, unknown keys refused, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class InlineOptions(RelayOptions):
    """`inline` takes no options."""


class CopyOptions(RelayOptions):
    """The copy-in of payloads into relay memory (`omnirail.relay.copy.Copier`)."""

    copy_thread_bytes: int = Field(
        DEFAULT_COPY_THREAD_BYTES,
        ge=0,
        description="Copies into relay memory at least this large run in worker threads, "
        "off the event loop.",
    )
    copy_threads: int = Field(
        DEFAULT_COPY_THREADS,
        ge=1,
        description="Such a copy is split across up to this many threads (parts of at least "
        "4 MiB).",
    )


class ShmOptions(CopyOptions):
    """Options of `shm`."""

    forward_views: bool = Field(
        True,
        description="A stage whose result to one next stage is bytes it received over shm, "
        "laid out as received, hands that view on without a copy; false where a later stage "
        "cannot see an earlier stage's /dev/shm.",
    )


class PulledOptions(CopyOptions):
    """Options every receiver-pulled backend (nixl, ucx, torchdist) takes."""

    peer_wait_s: float = Field(
        DEFAULT_PEER_WAIT_S,
        ge=0,
        description="How long a receiver waits for a sender's relay info to arrive through "
        "the coordinator, seconds.",
    )
    fetch_timeout_s: float = Field(
        DEFAULT_FETCH_TIMEOUT_S,
        gt=0,
        description="Bound of one fetch (torchdist: of every transfer wait), seconds.",
    )
    connect_timeout_s: float = Field(
        DEFAULT_CONNECT_TIMEOUT_S,
        gt=0,
        description="Start-up: how long a stage process waits for the backend to connect, seconds.",
    )
    host: str | None = Field(
        None,
        description="The address peers reach this process at; unset: the stage's own gRPC host.",
    )


class NixlOptions(PulledOptions):
    """Options of `nixl`."""

    ucx_error_handling_mode: Literal["none", "peer"] = Field(
        "none",
        description='"none": fast on one host; "peer": a dead peer fails transfers instead '
        "of hanging them (across hosts).",
    )
    progress_thread: bool = Field(
        False,
        description="A NIXL progress thread; off: the event loop polls (turn it on with "
        "spare cores across hosts).",
    )
    num_threads: int = Field(0, ge=0, description="NIXL's own worker threads.")
    chunk_bytes: int = Field(
        8 << 20,
        ge=1,
        description="One READ per this many bytes, so a big fetch does not hold the loop (at "
        "least 64 KiB are read at a time).",
    )
    spin_us: float = Field(30.0, ge=0, description="Busy polling before yielding to the loop, µs.")
    handle_cache: int = Field(128, ge=0, description="Prepared transfer handles kept per peer.")
    listen: str | None = Field(
        None,
        description="An address of the network interface NIXL's UCX backend listens on (its "
        "ucx_devices); unset: that of `host` if it is local (loopback without a host); "
        '"0.0.0.0": every interface.',
    )


class UcxOptions(PulledOptions):
    """Options of `ucx`."""

    progress: Literal["blocking", "polling"] = Field(
        "blocking",
        description='"blocking": progress when the worker\'s fd fires; "polling": spin while '
        "transfers run (faster only with idle cores).",
    )
    listen: str | None = Field(
        None,
        description="An address of the network interface UCX's transports listen on (UCX "
        'NET_DEVICES); unset: that of `host` if it is local; "0.0.0.0": every interface. '
        "ucx_config NET_DEVICES wins.",
    )
    ucx_config: dict[str, str] = Field(
        {},
        description="UCX settings of this relay's context without the UCX_ prefix, e.g. "
        '{"TLS": "tcp"} across network namespaces or containers on one machine.',
    )

    @field_validator("ucx_config", mode="before")
    @classmethod
    def _scalars_as_text(cls, v: Any) -> Any:
        # YAML reads `RNDV_THRESH: 8192` as a number; UCX takes every setting as text.
        if isinstance(v, Mapping):
            return {
                k: str(x) if isinstance(x, int | float) and not isinstance(x, bool) else x
                for k, x in v.items()
            }
        return v


class TorchdistOptions(PulledOptions):
    """Options of `torchdist`."""

    init_method: str | None = Field(
        None,
        description='"tcp://HOST:PORT" of rank 0\'s store, reachable by every rank (port 0: '
        "rank 0 picks one; single-process tests).",
    )
    timeout_s: float = Field(120.0, gt=0, description="Rendezvous bound, seconds.")
    gloo_host: str | None = Field(
        None,
        description="The address gloo binds; unset: `host`, else loopback for a loopback group.",
    )

    @field_validator("init_method")
    @classmethod
    def _tcp_url(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                url = urlsplit(v)
                ok = url.scheme == "tcp" and bool(url.hostname) and url.port is not None
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"want 'tcp://host:port', got {v!r}")
        return v


class OptionsError(ValueError):
    """Options a backend refuses; `problems` holds (key, problem) for each."""

    def __init__(self, backend: str, problems: list[tuple[str, str]]) -> None:
        self.backend = backend
        self.problems = problems
        super().__init__(
            f"{backend} relay options: " + "; ".join(f"{key}: {why}" for key, why in problems)
        )


def option_problems(backend: str, model: type[RelayOptions], options: Any) -> list[tuple[str, str]]:
    """(key, problem) for every option in `options` that `model` refuses; [] when valid."""
    try:
        model.model_validate(options)
    except ValidationError as exc:
        return problems_of(backend, model, exc)
    return []


def parse_options(backend: str, model: type[RelayOptions], options: Any) -> RelayOptions:
    """`options` (a mapping, or options of any backend) as `model`; raises OptionsError."""
    if isinstance(options, model):
        return options
    if isinstance(options, RelayOptions):
        options = options.model_dump(exclude_unset=True)
    try:
        return model.model_validate(options if options is not None else {})
    except ValidationError as exc:
        raise OptionsError(backend, problems_of(backend, model, exc)) from None


def problems_of(
    backend: str, model: type[RelayOptions], exc: ValidationError
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) if loc else "options"
        if err["type"] == "extra_forbidden":
            why = f"unknown option for backend {backend!r}" + _hint(loc[-1], model.model_fields)
        elif err["type"] == "model_type" or not loc:
            why = "expected a mapping of option names to values"
        else:
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            why = msg[:1].lower() + msg[1:]  # pydantic capitalises; ours follow "key: "
        if (key, why) not in out:
            out.append((key, why))
    return out


def _hint(key: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    if key in RELAY_FIELDS:
        return f" ({key} is a relay field, not an option)"
    if not known:
        return " (it takes no options)"
    return f" (options: {', '.join(known)})"

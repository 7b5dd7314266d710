"""The relay backends: name -> (options model, where the backend's class lives).

This table is the one list of backends. Importing it imports no backend module (nor
nixl, ucxx or torch.distributed): a backend's module is imported the first time a relay
of it is made (`Backend.load`), so config validation can check options against the
models alone. `omnirail.relay.base.create_relay` and `relay_backends` read it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnirail.relay.options import (
    InlineOptions,
    NixlOptions,
    RelayOptions,
    ShmOptions,
    TorchdistOptions,
    UcxOptions,
)

if TYPE_CHECKING:
    from omnirail.relay.base import Relay, RelaySettings


@dataclass(frozen=True)
class Backend:
    name: str
    options: type[RelayOptions]
    # "module:attribute" of the backend's Relay class (or any factory of RelaySettings).
    target: str

    def load(self) -> Callable[[RelaySettings], Relay]:
        """The backend's factory; imports its module (ImportError: library missing)."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("inline", InlineOptions, "omnirail.relay.inline:InlineRelay"),
        Backend("shm", ShmOptions, "omnirail.relay.shm:ShmRelay"),
        Backend("nixl", NixlOptions, "omnirail.relay.nixl:NixlRelay"),
        Backend("ucx", UcxOptions, "omnirail.relay.ucx:UcxRelay"),
        Backend("torchdist", TorchdistOptions, "omnirail.relay.torchdist:TorchDistRelay"),
    )
}


def backend(name: str) -> Backend | None:
    return BACKENDS.get(name)


def options_model(name: str) -> type[RelayOptions] | None:
    """The options model of backend `name` (None: no such backend)."""
    entry = BACKENDS.get(name)
    return entry.options if entry is not None else None

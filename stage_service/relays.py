"""The relays one stage process opens: which backends its edges use, with what settings,
and a start-up that fails naming the edge when a backend cannot start.

A process opens each backend once, with the per-process fields (`pool_mb`, `device`,
`rank`, `world_size`, `options`) that `omnirail.config.relays.process_relays` decides for
it (and that config validation checks could all apply); per-edge fields (`credits`,
`credit_mb`, `inline_bytes`, `backend`) are set per edge (`omnirail.stage_service.edges`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from omnirail.config import ConfigError, PipelineConfig, RelayConfig
from omnirail.config.relays import process_relays
from omnirail.relay.base import Relay, RelayError, create_relay
from omnirail.relay.options import DEFAULT_CONNECT_TIMEOUT_S, PulledOptions, RelayOptions
from omnirail.wire.errors import Code, OmniError


class RelayStartupError(OmniError):
    """A relay backend this process needs could not start."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.UNAVAILABLE, message)


@dataclass
class RelayPlan:
    backend: str
    # What the process opens the backend with (its per-process fields; see process_relays).
    config: RelayConfig
    edges: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"relay {self.backend!r} (edge{'s' if len(self.edges) > 1 else ''} " + (
            ", ".join(self.edges) + ")"
        )


def plan_relays(pipeline: PipelineConfig, stage_names: list[str]) -> dict[str, RelayPlan]:
    """Backends the hosted stages send with (their own relay and outgoing edges) and
    receive over (upstream edges), each with the config this process opens it with.
    Raises ConfigError when a per-process field could not apply (validation refuses such
    a config; this guards configs built without it)."""
    process = pipeline.process_of(stage_names[0]) if stage_names else ""
    opened, problems = process_relays(pipeline, stage_names, process)
    if problems:
        raise ConfigError(problems)
    return {b: RelayPlan(b, p.config, p.edges) for b, p in opened.items()}


def relay_host(address: str) -> str:
    """The host part of a gRPC address this process is reached at ("" for unix sockets)."""
    if address.startswith("unix:") or "/" in address:
        return ""
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


async def open_relays(plans: dict[str, RelayPlan], name_prefix: str, host: str) -> dict[str, Relay]:
    """Creates and connects every planned relay; RelayStartupError names the edges."""
    relays: dict[str, Relay] = {}
    try:
        options: list[RelayOptions] = []
        for backend, plan in plans.items():
            try:
                settings = plan.config.to_settings(name_prefix)
                opts = settings.options
                if host and isinstance(opts, PulledOptions) and opts.host is None:
                    # Pulled backends publish, and their transports listen on, the
                    # address peers reach this process at (its gRPC host).
                    opts = opts.model_copy(update={"host": host})
                    settings = dataclasses.replace(settings, options=opts)
                relays[backend] = create_relay(backend, settings)
            except (ImportError, RelayError, OSError, ValueError) as e:
                hint = ""
                if isinstance(e, ImportError):
                    hint = f" (install the extra: pip install 'omnirail[{backend}]')"
                raise RelayStartupError(f"{plan.describe()} cannot start: {e}{hint}") from e
            if isinstance(settings.options, RelayOptions):
                options.append(settings.options)
        timeout = max(
            (o.connect_timeout_s for o in options if isinstance(o, PulledOptions)),
            default=DEFAULT_CONNECT_TIMEOUT_S,
        )

        async def connect(backend: str) -> None:
            try:
                await relays[backend].connect(timeout)
            except (RelayError, OSError, TimeoutError) as e:
                raise RelayStartupError(f"{plans[backend].describe()} cannot start: {e}") from e

        await asyncio.gather(*(connect(b) for b in relays))
    except BaseException:
        for relay in relays.values():
            relay.close()
        raise
    return relays

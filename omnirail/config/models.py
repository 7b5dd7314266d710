"""Config models, `ConfigError`, and the topology queries the runtime asks of a pipeline.

Constructing a model checks structure only (types, ranges, unknown fields);
`PipelineConfig.from_dict` and `load_pipeline` also run every cross-stage rule in
`omnirail.config.validation`. Importable without torch: relay settings load lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from omnirail.config import dotted
from omnirail.config.api import ApiConfig
from omnirail.config.errors import NAME_RE, ConfigError, clip, short, stage_label
from omnirail.config.graph import StageIndex, join_groups, walk_graph
from omnirail.config.limits import (
    MAX_COUNT,
    MAX_CPU_ID,
    MAX_GPU_ID,
    MAX_MB,
    MAX_MESSAGE_MB,
    MAX_RANKS,
    MAX_SECONDS,
    MAX_STAGES,
    check_shape,
)
from omnirail.config.security import SecurityConfig
from omnirail.tuning.cpu_latency import MAX_US
from omnirail.tuning.cpus import parse_cpus

if TYPE_CHECKING:
    from omnirail.relay.base import RelaySettings

_NAME_HELP = "must start with a letter and contain only letters, digits, '_' or '-' (max 63)"


class _Model(BaseModel):
    # No float field takes NaN or an infinity: `.inf` seconds or MiB is accepted by a bare
    # `gt=0` and then breaks whatever uses it (sleeps, deadlines, `<< 20`).
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class RelayConfig(_Model):
    """One level of relay config (pipeline `relay`, `stages[].relay`, `relay_to[T]`).

    Per edge: `backend`, `inline_bytes`, `credits`, `credit_mb` (each edge gets its own
    merged value). Per process: `pool_mb`, `device`, `rank`, `world_size` and `options`
    (one relay object per backend per process; `omnirail.config.relays` decides what each
    process opens a backend with and refuses overrides that could not apply). `options`
    belong to the backend: they are checked against its model (`omnirail.relay.options`),
    and a level that changes the backend without setting options starts from none.
    """

    backend: str = Field(
        "shm",
        min_length=1,
        description="Relay backend of the edge: `inline`, `shm`, `nixl`, `ucx` or `torchdist` "
        "(per edge).",
    )
    # Inline payloads travel inside a gRPC message, so at most what one may carry.
    inline_bytes: int = Field(
        65536,
        ge=0,
        le=MAX_MESSAGE_MB << 20,
        description="Payloads whose packed tensor buffer is at most this many bytes travel "
        "inside the control message instead of the relay (per edge).",
    )
    pool_mb: int = Field(
        256,
        gt=0,
        le=MAX_MB,
        description="Size of the first pool segment in MiB; pools grow when a payload does "
        "not fit (per process).",
    )
    credits: int = Field(
        64,
        gt=0,
        le=MAX_COUNT,
        description="Transfers in flight on the edge before its sender blocks (per edge).",
    )
    credit_mb: int = Field(
        1024,
        gt=0,
        le=MAX_MB,
        description="MiB in flight on the edge before its sender blocks (per edge).",
    )
    device: str = Field(
        "cpu",
        description="Where the relay pool lives; only `cpu` is built (per process).",
    )
    rank: int | None = Field(
        None,
        ge=0,
        lt=MAX_COUNT,
        description="This process's rank for rank-addressed backends (`torchdist`); it must "
        "be below `world_size` (per process).",
    )
    world_size: int | None = Field(
        None,
        gt=0,
        le=MAX_COUNT,
        description="Ranks of the `torchdist` group (per process).",
    )
    options: dict[str, Any] = Field(
        {},
        description="The backend's own options, checked against its options model (see "
        "the relay options below); a level that changes `backend` without setting "
        "`options` starts from none (per process).",
    )

    @model_validator(mode="after")
    def _check_rank(self) -> RelayConfig:
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be < world_size {self.world_size}")
        return self

    def to_settings(self, name_prefix: str) -> RelaySettings:
        """Backend knobs for `omnirail.relay.base.create_relay`, options typed by the
        backend's model (a ValueError names what it refuses; an unknown backend keeps them
        as given: `create_relay` refuses the backend)."""
        from omnirail.relay import registry
        from omnirail.relay.base import RelaySettings
        from omnirail.relay.options import RelayOptions, parse_options

        options: RelayOptions | dict[str, Any] = dict(self.options)
        model = registry.options_model(self.backend)
        if model is not None:
            options = parse_options(self.backend, model, self.options)
        return RelaySettings(
            pool_bytes=self.pool_mb << 20,
            credit_slots=self.credits,
            credit_bytes=self.credit_mb << 20,
            name_prefix=name_prefix,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            options=options,
        )

    def updated_by(self, override: RelayConfig | None) -> tuple[RelayConfig, set[str]]:
        """This config with the fields `override` sets, and the names of the fields it
        changed that way. A backend change without options resets the options (they
        belong to the backend they were written for)."""
        if override is None:
            return self, set()
        fields = set(override.model_fields_set)
        if "backend" in fields and override.backend != self.backend:
            fields.add("options")  # override.options: its own, or none
        return self.model_copy(update={k: getattr(override, k) for k in fields}), fields


class EndpointsConfig(_Model):
    """Where the mesh's services listen and how big one gRPC message may be."""

    transport: Literal["unix", "tcp"] = Field(
        "unix", description="Unix sockets (one host) or TCP between the mesh's services."
    )
    base_path: str | None = Field(
        None,
        description="Directory for Unix sockets; the launcher picks a run directory when unset.",
    )
    host: str = Field("127.0.0.1", description="Host the services bind with `tcp`.")
    coordinator: str | None = Field(
        None,
        description="Explicit coordinator address (compose); the launcher allocates one when "
        "unset.",
    )
    # gRPC's message size options are C ints and protobuf refuses 2 GiB messages; see
    # omnirail.config.limits.MAX_MESSAGE_MB.
    max_message_mb: int = Field(
        64,
        gt=0,
        le=MAX_MESSAGE_MB,
        description="Largest gRPC message a service sends or receives, in MiB.",
    )


class MetricsConfig(_Model):
    """Prometheus `/metrics` endpoints, one per process (DescribePipeline lists them)."""

    enabled: bool = Field(True, description="Serve `/metrics` from every process.")
    host: str = Field("127.0.0.1", min_length=1, description="Host the endpoints bind.")
    port: int = Field(
        0, ge=0, le=65535, description="The coordinator's metrics port (0: a free one)."
    )
    stage_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Every stage process's metrics port (0: a free one each); a fixed one "
        "suits one stage process per host (or set `omnirail stage --metrics-port` each).",
    )


class RestartConfig(_Model):
    """How `omnirail up` restarts a stage process that exits (omnirail/ops/supervise.py):
    at most `max` restarts within `window_s` (0: never), the first after `backoff_s`,
    each next one twice as late, up to `backoff_max_s`."""

    max: int = Field(
        5, ge=0, le=MAX_COUNT, description="Restarts allowed within `window_s` (0: never)."
    )
    window_s: float = Field(
        60.0, gt=0, le=MAX_SECONDS, description="The window `max` counts restarts in, seconds."
    )
    backoff_s: float = Field(
        0.5, ge=0, le=MAX_SECONDS, description="Wait before the first restart, seconds."
    )
    backoff_max_s: float = Field(
        10.0,
        ge=0,
        le=MAX_SECONDS,
        description="Longest wait between restarts (each doubles the last), seconds.",
    )


class StreamConfig(_Model):
    """Flow control of the stream edges out of a stage, and how it takes early chunks."""

    credits: int = Field(
        64,
        gt=0,
        le=MAX_COUNT,
        description="Chunks in flight per stream edge (sent, not yet taken by the receiving "
        "scheduler).",
    )
    credit_mb: int = Field(
        64, gt=0, le=MAX_MB, description="MiB of chunks in flight per stream edge."
    )
    request_credits: int = Field(
        16,
        gt=0,
        le=MAX_COUNT,
        description="In-flight chunks one request may hold on an edge, so one stream cannot "
        "starve others.",
    )
    outbox_chunks: int = Field(
        256,
        gt=0,
        le=MAX_COUNT,
        description="Chunks the stage's scheduler may have emitted but not yet sent before "
        "it blocks in `outbox.put`.",
    )
    hold_early_chunks: bool = Field(
        False,
        description="Hold stream chunks that arrive before the request's payload instead of "
        "failing the request.",
    )


def _cpu_list(v: Any) -> list[int] | None:
    """A CPU affinity setting: None, a non-empty list of CPU ids, or "0-3,6"."""
    if v is None:
        return None
    if isinstance(v, str):
        _check_cpu_ids(v)
        try:
            return parse_cpus(v)  # its CpuError is a ValueError: pydantic reports the message
        except ValueError as exc:
            raise ValueError(clip(str(exc), 200)) from None  # it quotes the whole text
    if (
        isinstance(v, list | tuple)
        and v
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_CPU_ID for c in v)
    ):
        return sorted(set(v))
    raise ValueError(
        f'expected a non-empty list of CPU ids (0..{MAX_CPU_ID}) or "0-3,6", got {short(v)}'
    )


def _check_cpu_ids(text: str) -> None:
    """Refuses a CPU id past MAX_CPU_ID before `parse_cpus` expands a range: "0-20000000"
    would otherwise build a list of 20 million ids (10 s, 1.4 GB). Anything else that is
    wrong with the text is left to `parse_cpus` to report."""
    # Ranges may overlap ("0-7,4-5"), but not add up to more ids than twice the most there
    # can be: "0-8191" repeated 100,000 times is as slow to expand as one huge range.
    most, total = 2 * (MAX_CPU_ID + 1), 0
    for part in text.split(","):
        ids: list[int] = []
        for bound in part.partition("-")[::2]:
            bound = bound.strip()
            if len(bound) > 32:  # no CPU id is this long, and int() of it would be slow
                raise ValueError(f"bad CPU list {short(text)}: {short(bound)} is not a CPU id")
            try:
                ids.append(int(bound))  # parsed as parse_cpus parses it ("1_000" included)
            except ValueError:
                continue
        for cpu in ids:
            if cpu > MAX_CPU_ID:
                raise ValueError(
                    f"bad CPU list {short(text)}: CPU id {cpu} is past {MAX_CPU_ID}, the "
                    "largest Linux supports"
                )
        total += max(ids[-1] - ids[0] + 1, 1) if ids else 1
        if total > most:
            raise ValueError(f"bad CPU list {short(text)}: its items name more than {most} CPUs")


# A CPU affinity field: a list of CPU ids or "0-3,6" in the file, a sorted list (or None).
CpuList = Annotated[list[int] | None, BeforeValidator(_cpu_list)]


class InputStreamConfig(_Model):
    """`input_stream:`: clients may send input chunks into running requests (the Session
    call's `InputChunk`s); the entry stage takes them as a stream from source `"@client"`,
    bounded per request like a stream edge."""

    credits: int = Field(
        8,
        gt=0,
        le=MAX_COUNT,
        description="Input chunks of one request in flight (sent to the entry stage, not yet "
        "taken by its scheduler) before the coordinator stops reading the client's Session.",
    )
    credit_mb: int = Field(
        4,
        gt=0,
        le=MAX_MESSAGE_MB,
        description="The same bound as `credits`, in MiB of chunk payloads; whichever comes "
        "first applies.",
    )


class StageConfig(_Model):
    """One stage of a pipeline (`stages[]`): what it runs, where its results go, and where
    and how its process runs."""

    name: str = Field(
        description="The stage's name: a letter, then letters, digits, `_` or `-` (at most 63)."
    )
    factory: str = Field(
        description="Dotted path (`module:function`; a leading dot names a module next to "
        "the pipeline file) of a function that returns `fn(payload) -> output` or a "
        "scheduler."
    )
    factory_args: dict[str, Any] = Field(
        {},
        description="Keyword arguments of the factory (updated by `runtime_overrides[stage]`).",
    )
    next: list[str] | None = Field(
        None,
        description="Stages this stage's result goes to (a name or a list); exactly one of "
        "`next` and `terminal`.",
    )
    terminal: bool = Field(
        False, description="The stage's result is (part of) the request's result."
    )
    route_fn: str | None = Field(
        None,
        description="Dotted path of `route_fn(request_id, output) -> names`: per request, "
        "the subset of `next` the result goes to.",
    )
    wait_for: list[str] | None = Field(
        None,
        description="Fan-in: the upstream stages whose results this stage waits for before "
        "it runs.",
    )
    wait_for_fn: str | None = Field(
        None,
        description="Dotted path of `wait_for_fn(request_id, from_stage, payload) -> names "
        "| None`: per request, the subset of `wait_for` to wait for (None: not known yet).",
    )
    merge_fn: str | None = Field(
        None,
        description="Dotted path of `merge_fn({stage: payload}) -> payload`, joining a "
        "fan-in's payloads.",
    )
    stream_to: list[str] = Field(
        [], description="Stages this stage streams chunks to while it computes."
    )
    stream_done_to_fn: str | None = Field(
        None,
        description="Dotted path of `stream_done_to_fn(request_id, output) -> names`: which "
        "`stream_to` targets get the end-of-stream signal.",
    )
    stream: StreamConfig = Field(
        StreamConfig(), description="Flow control of the stage's stream edges."
    )
    project_payload: dict[str, str] = Field(
        {},
        description="Next stage -> dotted path of `fn(output) -> payload`: what of the "
        "result each next stage gets.",
    )
    process: str | None = Field(
        None,
        description="Stages with the same value share one process; unset: the stage runs in "
        "its own process named after it.",
    )
    gpu: int | list[int] | None = Field(
        None,
        description="GPU id among those the launcher sees (a list: one per tensor-parallel "
        "rank); unset: the CPU.",
    )
    tp_size: int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description="Tensor-parallel ranks: the stage runs as this many processes in one "
        "`torch.distributed` group.",
    )
    relay: RelayConfig | None = Field(
        None,
        description="Relay fields this stage's edges override on the pipeline's `relay`.",
    )
    relay_to: dict[str, RelayConfig] = Field(
        {},
        description="Per outgoing edge (target stage -> relay fields that differ from the "
        "stage's `relay`), e.g. nixl to a stage on another host while the rest stays on "
        "shm.",
    )
    replicas: int = Field(
        1, ge=1, le=MAX_RANKS, description="Processes (replicas) serving this stage."
    )
    torch_threads: int = Field(
        1, ge=1, le=MAX_RANKS, description="torch's intra-op threads in the stage's process."
    )
    restart: RestartConfig = Field(
        RestartConfig(),
        description="Restarts of the stage's process when it exits (stages sharing a "
        "process: the first stage's applies).",
    )
    retry_safe: bool = Field(
        False,
        description="Running a request here again gives the same result and has no side "
        "effects: a request whose replica was lost before any of it reached the client is "
        "re-dispatched when every stage it may pass says so.",
    )
    max_queue: int = Field(
        1024,
        gt=0,
        le=MAX_COUNT,
        description="A new request that finds this many messages waiting in the stage's "
        "inbox (requests not yet taken, and stream chunks) is refused at once with "
        "RESOURCE_EXHAUSTED and a retry hint.",
    )
    cpus: CpuList = Field(
        None,
        description="CPUs the stage's process is pinned to (every thread), as a list or "
        '"0-3,6"; stages sharing a process get the union; unset: wherever the OS schedules '
        "it.",
    )
    env: dict[str, str] = Field({}, description="Environment variables of the stage's process.")

    @field_validator("name", "process")
    @classmethod
    def _check_name(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError(f"invalid name {short(v)}: {_NAME_HELP}")
        return v

    @field_validator("next", mode="before")
    @classmethod
    def _normalize_next(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("gpu", mode="before")
    @classmethod
    def _check_gpu(cls, v: Any) -> Any:
        # Checked by hand so a bad value gets one message instead of one per union member.
        def ok(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_GPU_ID

        if v is None or ok(v):
            return v
        if isinstance(v, list | tuple) and v and all(ok(x) for x in v):
            return list(v)
        raise ValueError(
            f"expected a GPU id (0..{MAX_GPU_ID}) or a non-empty list of them, got {short(v)}"
        )

    @property
    def next_stages(self) -> list[str]:
        return list(self.next or ())

    @property
    def gpus(self) -> list[int]:
        """GPU ids the stage uses (empty for CPU stages)."""
        if self.gpu is None:
            return []
        return list(self.gpu) if isinstance(self.gpu, list) else [self.gpu]


class PipelineConfig(_Model):
    """A pipeline file's top level: its stages and what holds for the whole mesh."""

    name: str | None = Field(
        None,
        description="The pipeline's name (the mesh's default name); unset: `model_path`, "
        'else "pipeline".',
    )
    model_path: str | None = Field(
        None,
        description="A checkpoint directory, passed to every factory that takes a "
        "`model_path` argument its `factory_args` do not set.",
    )
    stages: list[StageConfig] = Field(min_length=1, description="The stages (at least one).")
    entry_stage: str | None = Field(
        None, description="The stage requests enter at; unset: the first stage."
    )
    relay: RelayConfig = Field(
        default_factory=RelayConfig,
        description="The relay of every edge, unless a stage's `relay` or `relay_to` "
        "overrides fields of it.",
    )
    fused_stages: list[list[str]] = Field(
        [],
        description="Groups of stages (each a linear run of `next` edges) that run in one process.",
    )
    runtime_overrides: dict[str, dict[str, Any]] = Field(
        {},
        description="Stage -> factory arguments that update its `factory_args` (shallowly).",
    )
    env_defaults: dict[str, str] = Field(
        {},
        description="Environment variables of every stage process, unless its `env` sets them.",
    )
    endpoints: EndpointsConfig = Field(
        default_factory=EndpointsConfig,
        description="Where the services listen, and the gRPC message bound.",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="The Prometheus `/metrics` endpoints of every process.",
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="TLS, client tokens and mesh membership.",
    )
    api: ApiConfig = Field(
        default_factory=ApiConfig,
        description="What the KServe v2 gRPC and OpenAI HTTP front doors show.",
    )
    terminal_stages_fn: str | None = Field(
        None,
        description="Dotted path of `terminal_stages_fn(request_id, inputs) -> names | "
        "None`: per request, the subset of terminal stages whose results it waits for (runs "
        "on the coordinator; tensors arrive as numpy arrays).",
    )
    default_timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_SECONDS,
        description="A request's deadline when the client gives none, seconds.",
    )
    max_input_mb: int = Field(
        32,
        gt=0,
        le=MAX_MESSAGE_MB,
        description="Largest request inputs in MiB (they arrive in one gRPC message: the "
        "same bound as `endpoints.max_message_mb`); past it RESOURCE_EXHAUSTED.",
    )
    max_live_requests: int = Field(
        1024,
        gt=0,
        le=MAX_COUNT,
        description="Requests the coordinator runs at once; past it a new one is refused "
        "at once with RESOURCE_EXHAUSTED and a retry hint, instead of queueing work that "
        "would miss its deadline.",
    )
    drain_s: float = Field(
        10.0,
        ge=0,
        le=MAX_SECONDS,
        description="On shutdown (SIGTERM, `omnirail down`) the coordinator refuses new "
        "requests and gives the running ones this long to end before it fails them, "
        "seconds.",
    )
    balance: Literal["least_outstanding", "round_robin", "request_id"] = Field(
        "least_outstanding",
        description="How the coordinator picks the entry stage's replica for a new request: "
        "the fewest live requests, in turn, or a hash of the request id.",
    )
    abort_ack_timeout_s: float = Field(
        0.5,
        gt=0,
        le=MAX_SECONDS,
        description="How long an Abort call waits for the stage replicas' acknowledgements; "
        "those that have not answered by then are named in its reply, seconds.",
    )
    liveness_s: float = Field(
        5.0,
        ge=2.0,
        le=MAX_SECONDS,
        description="A replica not heard from for this long (stages report every second) is "
        "taken for hung and treated like a dead one, seconds.",
    )
    redispatch_attempts: int = Field(
        2,
        ge=0,
        le=10,
        description="How many times a request may be dispatched again after losing a "
        "replica (0: never).",
    )
    client_stream_buffer: int = Field(
        4096,
        gt=0,
        le=MAX_COUNT,
        description="Messages the coordinator holds for one client call that does not read "
        "(a Session, a KServe stream, a streaming Generate) before it stops reading that "
        "call's new requests.",
    )
    client_buffer_mb: int = Field(
        16,
        gt=0,
        le=MAX_MESSAGE_MB,
        description="The same bound as `client_stream_buffer`, in MiB; whichever comes "
        "first applies.",
    )
    input_stream: InputStreamConfig | None = Field(
        None,
        description="Clients may stream input into running requests (unset: they may not).",
    )
    coordinator_cpus: CpuList = Field(
        None,
        description="CPUs the coordinator process is pinned to (as a stage's `cpus`).",
    )
    cpu_wake_latency_us: int | None = Field(
        None,
        ge=0,
        le=MAX_US,
        strict=True,
        description="Idle CPUs must wake within this many µs while the mesh's processes run "
        "(a PM QoS request on `/dev/cpu_dma_latency`; 0: polling); unset: the host's power "
        "management is left alone.",
    )
    cpu_fallback: bool = Field(
        False,
        description="A stage with `gpu:` in a process that sees no CUDA device runs on the "
        "CPU (with a warning in its log) instead of failing start-up.",
    )

    _source_dir: str | None = PrivateAttr(default=None)
    # possible_stages' answers, by terminal set (a serving config does not change).
    _possible: dict[tuple[str, ...], frozenset[str]] = PrivateAttr(default_factory=dict)
    _index: StageIndex | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _relay_backend_shorthand(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "relay_backend" not in data:
            return data
        data = dict(data)
        backend = data.pop("relay_backend")
        if backend is None:
            return data
        if not isinstance(backend, str):
            # Checked here: a float such as `.nan` is not even equal to itself.
            raise ValueError(
                f"relay_backend: expected a relay backend name, got {type(backend).__name__}"
            )
        relay = data.get("relay")
        if relay is None:
            data["relay"] = {"backend": backend}
        elif isinstance(relay, RelayConfig):
            if "backend" in relay.model_fields_set and relay.backend != backend:
                raise ValueError(_backend_conflict(backend, relay.backend))
            data["relay"] = relay.model_copy(update={"backend": backend})
        elif isinstance(relay, Mapping):
            if "backend" in relay and relay["backend"] != backend:
                raise ValueError(_backend_conflict(backend, relay["backend"]))
            data["relay"] = {**relay, "backend": backend}
        return data

    @field_validator("stages", mode="before")
    @classmethod
    def _bound_stages(cls, v: Any) -> Any:
        # Refused before each stage is validated: see omnirail.config.limits.MAX_STAGES.
        if isinstance(v, list | tuple) and len(v) > MAX_STAGES:
            raise ValueError(f"{len(v)} stages; at most {MAX_STAGES} are supported")
        return v

    @model_validator(mode="after")
    def _default_name(self) -> PipelineConfig:
        if self.name is None:
            self.name = self.model_path or "pipeline"
        return self

    # -- construction ----------------------------------------------------------------

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source_dir: str | None = None, resolve: bool = True
    ) -> PipelineConfig:
        """Builds and fully validates a config; raises ConfigError listing every problem."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"pipeline: expected a mapping, got {type(data).__name__}")
        # Bounded size, depth and no cycles before pydantic walks (and copies) the data.
        check_shape(data)
        return cls._from_bounded(data, source_dir=source_dir, resolve=resolve)

    @classmethod
    def _from_bounded(
        cls, data: Mapping[str, Any], *, source_dir: str | None, resolve: bool
    ) -> PipelineConfig:
        """`from_dict` for data already within `check_shape`'s bounds: the YAML loader
        bounds what it composes the same way, and walking it again costs as much."""
        # Imported here because validation imports this module.
        from omnirail.config.validation import validate

        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(validation_error_lines(exc, data)) from None
        cfg.source_dir = source_dir
        validate(cfg, resolve=resolve)
        return cfg

    @property
    def model_name(self) -> str:
        """The model name the KServe and OpenAI front doors serve this pipeline as."""
        return self.api.model or _model_name(self.name or "pipeline")

    @property
    def source_dir(self) -> str | None:
        """Directory of the file the config came from; dotted paths resolve against it."""
        return self._source_dir

    @source_dir.setter
    def source_dir(self, value: str | None) -> None:
        self._source_dir = value

    @property
    def relay_backend(self) -> str:
        return self.relay.backend

    # -- derived topology ------------------------------------------------------------

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def resolved_entry_stage(self) -> str:
        return self.entry_stage or self.stages[0].name

    @property
    def terminal_stages(self) -> list[str]:
        return [s.name for s in self.stages if s.terminal]

    @property
    def gpu_placement(self) -> dict[str, int | list[int]]:
        return {s.name: s.gpu for s in self.stages if s.gpu is not None}

    @property
    def index(self) -> StageIndex:
        """The stage lookups (config/graph.py), built once per stage list: what
        validation, the coordinator and the stage hosts query."""
        index = self._index
        if index is None or index.stages is not self.stages:
            index = self._index = StageIndex.of(self.stages)
        return index

    def stage(self, name: str) -> StageConfig:
        found = self.index.by_name.get(name)
        if found is None:
            raise KeyError(f"unknown stage {name!r}; stages: {', '.join(self.stage_names)}")
        return found

    def upstream_of(self, name: str) -> list[str]:
        """Stages whose `next` names `name`, in declaration order."""
        return list(self.index.upstream_of(name))

    def stream_sources_of(self, name: str) -> list[str]:
        """Stages whose `stream_to` names `name`, in declaration order."""
        return list(self.index.stream_sources_of(name))

    def takes_payload(self, name: str) -> bool:
        """Whether `name` gets a request payload (entry, or some stage's `next`)."""
        return name == self.resolved_entry_stage or bool(self.upstream_of(name))

    def relay_for(self, stage_name: str, target: str | None = None) -> RelayConfig:
        """The relay a stage sends with: the pipeline's, updated by the fields the stage's
        `relay` sets explicitly, then (for edge `stage_name -> target`) by `relay_to`
        (see `RelayConfig.updated_by`)."""
        stage = self.stage(stage_name)
        cfg = self.relay
        for override in (stage.relay, stage.relay_to.get(target) if target else None):
            cfg, _ = cfg.updated_by(override)
        return cfg

    def relays_touching(self, stage_name: str) -> list[tuple[str, RelayConfig]]:
        """(edge, relay) a stage's process must open: its own default ("name->*"), its
        outgoing edges', and those its upstream stages send to it with."""
        found = [(f"{stage_name}->*", self.relay_for(stage_name))]
        found += [
            (f"{stage_name}->{t}", self.relay_for(stage_name, t)) for t in self.edges_of(stage_name)
        ]
        for up in self.upstream_of(stage_name) + self.stream_sources_of(stage_name):
            found.append((f"{up}->{stage_name}", self.relay_for(up, stage_name)))
        return found

    def backends_of(self, stage_name: str) -> set[str]:
        return {relay.backend for _, relay in self.relays_touching(stage_name)}

    def edges_of(self, stage_name: str) -> list[str]:
        """Stages `stage_name` can send to (next and stream_to)."""
        self.stage(stage_name)  # KeyError naming the stages
        return self.index.edges_of(stage_name)

    def factory_args_for(self, stage_name: str) -> dict[str, Any]:
        """`factory_args` updated (shallowly) by `runtime_overrides[stage]`.

        `model_path` is added when the pipeline has one, the args do not set it, and the
        factory declares a parameter of that name.
        """
        stage = self.stage(stage_name)
        args = {**stage.factory_args, **self.runtime_overrides.get(stage_name, {})}
        if self.model_path is not None and "model_path" not in args:
            factory = dotted.resolve(stage.factory, self.source_dir)
            if dotted.accepts(factory, "model_path"):
                args["model_path"] = self.model_path
        return args

    def process_cpus(self, stage_names: Iterable[str]) -> list[int] | None:
        """The CPUs of the process hosting `stage_names`: the union of the `cpus` its stages
        set, None when none sets any."""
        sets = [self.stage(n).cpus for n in stage_names]
        chosen = sorted({c for cpus in sets if cpus for c in cpus})
        return chosen or None

    def process_groups(self) -> dict[str, list[str]]:
        """Process name -> its stages in declaration order.

        A stage without `process` gets a group named after itself. Each fused group merges
        every group it touches; the merged group keeps the name of its earliest group. A TP
        stage's group is the prefix of its per-rank processes (`{group}_tp{rank}`).
        """
        group_of = {s.name: s.process or s.name for s in self.stages}
        declared = list(dict.fromkeys(group_of.values()))
        fused = ([group_of[n] for n in f if n in group_of] for f in self.fused_stages)
        merged = join_groups(declared, fused)
        name_of = {g: members[0] for members in merged for g in members}
        groups: dict[str, list[str]] = {}
        for s in self.stages:
            groups.setdefault(name_of[group_of[s.name]], []).append(s.name)
        return groups

    def process_of(self, stage_name: str) -> str:
        for group, members in self.process_groups().items():
            if stage_name in members:
                return group
        raise KeyError(f"unknown stage {stage_name!r}")

    def reachable_stages(self, from_stage: str) -> set[str]:
        """Stages reachable from `from_stage` (itself included) via `next` and `stream_to`."""
        self.stage(from_stage)
        return walk_graph({from_stage}, self._edges())

    def possible_stages_for(self, terminals: Iterable[str]) -> set[str]:
        """Stages on some entry-to-terminal path (via `next` or `stream_to`) for `terminals`.

        A request whose terminal set is `terminals` can only be affected by these stages.
        """
        targets = set(terminals)
        for t in targets:
            self.stage(t)
        if not targets:
            return set()
        forward = self.reachable_stages(self.resolved_entry_stage)
        reverse: dict[str, set[str]] = {n: set() for n in self.stage_names}
        for src, dsts in self._edges().items():
            for d in dsts:
                reverse.setdefault(d, set()).add(src)
        return forward & walk_graph(targets, reverse)

    def possible_stages(self, terminals: tuple[str, ...]) -> frozenset[str]:
        """`possible_stages_for(terminals)`, computed once per terminal set: what the
        coordinator and every stage host ask for each request."""
        found = self._possible.get(terminals)
        if found is None:
            found = self._possible[terminals] = frozenset(self.possible_stages_for(terminals))
        return found

    def _edges(self) -> dict[str, set[str]]:
        return {s.name: set(s.next_stages) | set(s.stream_to) for s in self.stages}


def _backend_conflict(shorthand: str, explicit: object) -> str:
    return f"relay_backend {short(shorthand)} conflicts with relay.backend {short(explicit)}"


# -- pydantic error conversion ---------------------------------------------------------


_stage_label = stage_label


def _format_loc(loc: tuple[Any, ...], data: Any, root: str) -> str:
    parts: list[str] = []
    rest = list(loc)
    if root == "pipeline" and len(rest) >= 2 and rest[0] == "stages" and isinstance(rest[1], int):
        raw_stages = data.get("stages") if isinstance(data, Mapping) else None
        head = f"stages[{_stage_label(raw_stages, rest[1])}]"
        rest = rest[2:]
    else:
        head = root
    for item in rest:
        # Keys of free-form mappings are input: shown clipped.
        parts.append(f"[{item}]" if isinstance(item, int) else f".{clip(str(item), 40)}")
    return head + "".join(parts)


def _format_msg(err: Mapping[str, Any]) -> str:
    kind = err.get("type")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field"
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    # pydantic capitalises its messages; ours continue a "location: " prefix.
    return msg[:1].lower() + msg[1:]


def validation_error_lines(exc: ValidationError, data: Any = None) -> list[str]:
    root = {"PipelineConfig": "pipeline", "StageConfig": "StageConfig"}.get(exc.title, exc.title)
    out: list[str] = []
    for err in exc.errors():
        line = f"{_format_loc(tuple(err['loc']), data, root)}: {_format_msg(err)}"
        if line not in out:
            out.append(line)
    return out


def _model_name(name: str) -> str:
    # A pipeline named after its model_path ("/models/X") is served as "X".
    return name.rstrip("/").rsplit("/", 1)[-1] or "pipeline"

"""Bounded loading (issue 20 fuzz findings, tests/fuzz/test_config_fuzz.py): every input
ends in a config or a ConfigError that names where the problem is, quickly, and no error
echoes its input unbounded."""

from __future__ import annotations

import datetime
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnirail.config import ConfigError, PipelineConfig, StageConfig, load_pipeline, validate
from omnirail.config.errors import MAX_LINE, MAX_PROBLEMS, clip, join_bounded, short
from omnirail.config.limits import (
    MAX_CPU_ID,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_MESSAGE_MB,
    MAX_STAGES,
    MAX_VALUES,
)
from tests.unit.config.helpers import F, config_error, pipe, st

# Far above what any of these takes once bounded (milliseconds), far below what each took
# before (seconds), with room for a busy host.
FAST_S = 2.0


@pytest.fixture
def timed() -> Iterator[None]:
    start = time.perf_counter()
    yield
    assert time.perf_counter() - start < FAST_S


def load_error(tmp_path: Path, text: str | bytes) -> str:
    p = tmp_path / "pipeline.yaml"
    if isinstance(text, str):
        text = text.encode()
    p.write_bytes(text)
    with pytest.raises(ConfigError) as ei:
        load_pipeline(p, resolve=False)
    message = str(ei.value)
    assert ei.value.source == str(p)
    return message.replace(str(p), "FILE")


def stage_yaml(extra: str = "") -> str:
    return f"stages:\n  - {{name: a, factory: '{F}', terminal: true{extra}}}\n"


# -- 1. alias bombs and unbounded echoes ----------------------------------------------------

BOMB = "\n".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
        *(
            f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]"
            for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        ),
    ]
)


@pytest.mark.parametrize("where", ["top", "cpus", "factory_args", "next"])
def test_alias_bomb_is_refused_while_composing(tmp_path: Path, where: str, timed: None) -> None:
    # 460 bytes expanding to 9^9 strings: was 8.6 s and 1.5 GiB (repr of the expansion).
    text = (
        BOMB + "\n" + stage_yaml() if where == "top" else BOMB + "\n" + stage_yaml(f", {where}: *i")
    )
    message = load_error(tmp_path, text)
    assert re.fullmatch(
        rf"FILE:\d+:\d+: YAML error: the document expands to more than {MAX_VALUES} values.*",
        message,
    )


def test_merge_key_bomb_is_refused(tmp_path: Path, timed: None) -> None:
    # `<<` copies the merged pairs: 12 merges of 12 merges ... is the same bomb.
    lines = ["m0: &m0 {x: 1, y: 2}"]
    lines += [f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 12)}]}}" for i in range(1, 9)]
    message = load_error(tmp_path, "\n".join(lines) + "\n" + stage_yaml())
    assert f"more than {MAX_VALUES} values" in message


@pytest.mark.parametrize(
    "text",
    ["a: &a [*a]\n", "a: &a {b: [*a]}\n", f"stages: &s [{{name: a, factory: '{F}', next: *s}}]\n"],
)
def test_recursive_alias_is_refused_at_its_line(tmp_path: Path, text: str) -> None:
    message = load_error(tmp_path, text)
    assert re.match(
        r"FILE:1:\d+: YAML error: alias 's?a?' is used inside the node it names", message
    )


def test_shared_and_cyclic_python_data_is_refused(timed: None) -> None:
    level: list[Any] = ["lol"] * 9
    for _ in range(8):
        level = [level] * 9
    e = config_error(pipe(st("a", terminal=True, cpus=level)), resolve=False)
    assert str(e).startswith("stages[a].cpus")
    assert f"more than {MAX_VALUES} values" in str(e)
    loop: dict[str, Any] = {}
    loop["self"] = loop
    e = config_error(pipe(st("a", terminal=True, factory_args=loop)), resolve=False)
    assert str(e) == "stages[a].factory_args.self: contains itself (a recursive alias or reference)"


def test_errors_echo_values_bounded() -> None:
    huge = "x" * 1_000_000
    e = config_error(
        pipe(
            st("a", next=[huge], gpu=huge, relay_to={huge: {}}),
            entry_stage=huge,
            runtime_overrides={huge: {}},
            relay_backend=huge,
        ),
        resolve=False,
    )
    assert all(len(line) < 300 for line in e.errors), e.errors
    assert "stages[a].gpu: expected a GPU id" in str(e)
    e = config_error(pipe(st("a", terminal=True, factory=huge)), resolve=False)
    assert str(e).startswith("stages[a].factory: invalid dotted path 'xxx")
    assert len(str(e)) < 300


def test_short_is_bounded_whatever_the_value() -> None:
    assert short("abc") == "'abc'"
    assert len(short("x" * 10**6)) <= 80
    assert short(10**5000) == f"<int of {(10**5000).bit_length()} bits>"
    assert len(short(10**1000)) <= 80
    level: list[Any] = [1]
    for _ in range(30):
        level = [level] * 50
    assert len(short(level)) <= 80
    assert clip("abc", 80) == "abc"
    assert clip("y" * 500, 80).startswith("y" * 50) and len(clip("y" * 500, 80)) <= 80
    assert join_bounded([str(i) for i in range(100)], limit=5) == "0, 1, 2, … 96 more …, 99"


def test_config_error_bounds_lines_and_problems() -> None:
    e = ConfigError(["a" * 10 * MAX_LINE] + [f"p{i}" for i in range(2 * MAX_PROBLEMS)])
    assert len(e.errors) == MAX_PROBLEMS + 1
    assert all(len(line) <= MAX_LINE for line in e.errors)
    assert e.errors[-1] == f"... and {MAX_PROBLEMS + 1} more problem(s) not listed"


# -- 2. CPU ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("cpus", ["0-20000000", "20000000", "0,1-99999999999", "1_0000000"])
def test_cpu_range_is_bounded_before_it_is_expanded(cpus: str, timed: None) -> None:
    # "0-20000000" was expanded to 20 million ids: 10 s and 1.4 GB.
    e = config_error(pipe(st("a", terminal=True, cpus=cpus)), resolve=False)
    assert str(e).startswith("stages[a].cpus: bad CPU list")
    assert f"past {MAX_CPU_ID}" in str(e)


def test_repeated_cpu_ranges_are_bounded(timed: None) -> None:
    # Each range is in bounds, together they would expand to a billion ids.
    e = config_error(pipe(st("a", terminal=True, cpus=",".join(["0-8191"] * 150_000))), False)
    assert str(e).endswith("its items name more than 16384 CPUs")
    assert len(str(e)) < 300


def test_cpu_ids_up_to_the_bound_are_accepted() -> None:
    cfg = PipelineConfig.from_dict(
        pipe(st("a", terminal=True, cpus=f"0-{MAX_CPU_ID}"), coordinator_cpus=[MAX_CPU_ID]),
        resolve=False,
    )
    assert len(cfg.stage("a").cpus or []) == MAX_CPU_ID + 1
    e = config_error(pipe(st("a", terminal=True), coordinator_cpus=[MAX_CPU_ID + 1]), False)
    assert str(e).startswith("pipeline.coordinator_cpus: expected a non-empty list of CPU ids")
    e = config_error(pipe(st("a", terminal=True, cpus="9" * 5000)), False)
    assert "is not a CPU id" in str(e) and len(str(e)) < 300


# -- 3. many stages --------------------------------------------------------------------------


def chain(n: int) -> dict[str, Any]:
    stages = [st(f"s{i}", next=f"s{i + 1}", relay={"pool_mb": 8}) for i in range(n - 1)]
    return pipe(*stages, st(f"s{n - 1}", terminal=True, stream_to=[]))


def test_too_many_stages_are_refused_before_validation(timed: None) -> None:
    # 4,000 chained stages took 18.7 s to validate.
    e = config_error(chain(4000), resolve=False)
    assert e.errors == [f"pipeline.stages: 4000 stages; at most {MAX_STAGES} are supported"]


def test_validation_is_linear_in_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts the reads of every stage's `next` during validation: a constant number per
    stage (the quadratic version read every stage's once per stage, several times)."""
    reads = 0
    original = StageConfig.next_stages

    def counted(self: StageConfig) -> list[str]:
        nonlocal reads
        reads += 1
        return original.__get__(self, StageConfig)

    def reads_for(n: int) -> int:
        nonlocal reads
        cfg = PipelineConfig.from_dict(chain(n), resolve=False)
        reads = 0
        validate(cfg, resolve=False)
        return reads

    monkeypatch.setattr(StageConfig, "next_stages", property(counted))
    small, large = reads_for(100), reads_for(400)
    assert large <= 5 * small, (small, large)


def test_largest_pipeline_validates_quickly(timed: None) -> None:
    cfg = PipelineConfig.from_dict(chain(MAX_STAGES), resolve=False)
    assert len(cfg.stages) == MAX_STAGES


def test_many_cycles_are_listed_bounded(timed: None) -> None:
    n = 30
    stages = [st(f"s{i}", next=[f"s{j}" for j in range(n) if j != i]) for i in range(n)]
    e = config_error(pipe(*stages, st("t", terminal=True)), resolve=False)
    cycles = [line for line in e.errors if "cycle in next graph" in line]
    assert len(cycles) == 10
    assert any(re.fullmatch(r"pipeline\.stages: \d+ more cycle\(s\) .*", x) for x in e.errors)
    assert all(len(line) < MAX_LINE for line in e.errors)


# -- 4. nesting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "a: " + "[" * 492 + "]" * 492 + "\n",
        "a: " + "{a: " * 492 + "1" + "}" * 492 + "\n",
        "[" * 200_000,  # the scanner was quadratic in open brackets
        stage_yaml(", factory_args: {x: " + "[" * 492 + "]" * 492 + "}"),
        "".join("  " * i + "- \n" for i in range(200)),
    ],
)
def test_deep_nesting_is_refused_at_its_line(tmp_path: Path, text: str, timed: None) -> None:
    # 492 brackets raised RecursionError.
    message = load_error(tmp_path, text)
    assert re.fullmatch(
        rf"FILE:\d+:\d+: YAML (syntax )?error: nested deeper than {MAX_DEPTH} levels", message
    )


def test_deep_python_data_is_refused() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    e = config_error(pipe(st("a", terminal=True, factory_args={"x": deep})), resolve=False)
    assert re.fullmatch(
        rf"stages\[a\]\.factory_args\.x(\[0\])+: nested deeper than {MAX_DEPTH} levels", str(e)
    )


def test_deep_py_config_object_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "deep.py"
    p.write_text(
        "from omnirail.config import PipelineConfig, StageConfig\n"
        "deep = []\n"
        "for _ in range(100_000):\n"
        "    deep = [deep]\n"
        f"stage = StageConfig(name='a', factory='{F}', terminal=True, factory_args={{'x': deep}})\n"
        "pipeline = PipelineConfig(stages=[stage])\n"
    )
    with pytest.raises(ConfigError, match="RecursionError"):
        load_pipeline(p, resolve=False)


# -- 5. PyYAML's own exceptions ------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("!!float true", "invalid float 'true'"),
        ('!!int ""', "invalid int ''"),
        ("!!timestamp x", "invalid timestamp 'x'"),
        ("2024-13-45", "invalid timestamp '2024-13-45'"),
        ("1" * 4301, "invalid int '111"),
        ("!!bool maybe", "invalid bool 'maybe'"),
        ('"\\U00110000"', "invalid escape sequence"),
        (
            "!!binary aGk=",
            "could not determine a constructor for the tag 'tag:yaml.org,2002:binary'",
        ),
        (
            "!!set {a: null}",
            "could not determine a constructor for the tag 'tag:yaml.org,2002:set'",
        ),
        ("!!python/object:os.system x", "could not determine a constructor"),
    ],
)
def test_malformed_scalars_are_config_errors_at_their_line(
    tmp_path: Path, value: str, problem: str
) -> None:
    message = load_error(tmp_path, stage_yaml() + f"name: {value}\n")
    assert re.match(r"FILE:3:\d+: YAML (syntax )?error: ", message), message
    assert problem in message
    assert len(message) < 400


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("a: 1\nb: \x00\n", "FILE:2:4: YAML syntax error: special characters are not allowed"),
        (b"a: \xff\n", "FILE: cannot read: 'utf-8' codec can't decode byte 0xff"),
        ("a: 1\n--- b\n", "FILE:2:1: YAML error: but found another document (expected a single"),
        ("a: *nowhere\n", "FILE:1:4: YAML error: found undefined alias 'nowhere'"),
    ],
)
def test_other_yaml_errors_name_their_place(
    tmp_path: Path, content: str | bytes, where: str
) -> None:
    assert load_error(tmp_path, content).startswith(where)


def test_timestamps_and_merge_keys_still_load(tmp_path: Path) -> None:
    p = tmp_path / "pipeline.yaml"
    p.write_text(
        f"stages:\n  - &a {{name: a, factory: '{F}', next: b, factory_args: {{day: 2024-01-02}}}}\n"
        "  - {<<: *a, name: b, next: null, terminal: true}\n"
    )
    cfg = load_pipeline(p, resolve=False)
    assert cfg.stage("b").factory_args == {"day": datetime.date(2024, 1, 2)}
    assert cfg.stage("b").terminal


@pytest.mark.parametrize(
    ("text", "where", "key"),
    [
        (
            stage_yaml() + "max_live_requests: 4\nmax_live_requests: 8\n",
            "FILE:4:1",
            "'max_live_requests'",
        ),
        (
            "stages:\n  - name: a\n    factory: x.y\n    terminal: true\n    max_queue: 1\n"
            "    max_queue: 9\n",
            "FILE:6:5",
            "'max_queue'",
        ),
        (stage_yaml() + "name: p\nx: {1: a, true: b}\n", "FILE:4:11", "True"),
    ],
)
def test_a_key_given_twice_is_refused_at_its_second_line(
    tmp_path: Path, text: str, where: str, key: str
) -> None:
    """PyYAML keeps the last of a repeated key and drops the first silently."""
    message = load_error(tmp_path, text)
    assert message.startswith(f"{where}: YAML error: key {key} is given twice"), message
    assert "(first at line" in message


def test_merged_keys_may_be_overridden(tmp_path: Path) -> None:
    p = tmp_path / "pipeline.yaml"
    p.write_text(
        "stages:\n  - &a {name: a, factory: x.y, max_queue: 4, next: b}\n"
        "  - {<<: [*a, *a], name: b, next: null, max_queue: 9, terminal: true}\n"
    )
    cfg = load_pipeline(p, resolve=False)
    assert (cfg.stage("a").max_queue, cfg.stage("b").max_queue) == (4, 9)


def test_oversized_file_is_refused(tmp_path: Path, timed: None) -> None:
    message = load_error(tmp_path, "#" * (MAX_FILE_BYTES + 1))
    assert message == f"FILE: larger than {MAX_FILE_BYTES >> 20} MiB; not a pipeline file"


# -- 6. relay_backend that is no name --------------------------------------------------------


@pytest.mark.parametrize("backend", [math.nan, 1, [], {}])
def test_relay_backend_must_be_a_name(backend: object) -> None:
    # `.nan` with `relay: {}` raised KeyError (nan != nan, then relay["backend"]).
    e = config_error(pipe(st("a", terminal=True), relay_backend=backend, relay={}), False)
    assert str(e).startswith("pipeline: relay_backend: expected a relay backend name, got ")


def test_relay_backend_shorthand_with_an_empty_relay() -> None:
    cfg = PipelineConfig.from_dict(pipe(st("a", terminal=True), relay_backend="nixl", relay={}))
    assert cfg.relay.backend == "nixl"


# -- 7. non-finite and out-of-range numbers ----------------------------------------------


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"default_timeout_s": math.inf}, "pipeline.default_timeout_s: input should be a finite"),
        ({"drain_s": math.nan}, "pipeline.drain_s: input should be a finite number"),
        ({"liveness_s": math.inf}, "pipeline.liveness_s: input should be a finite number"),
        ({"abort_ack_timeout_s": 1e12}, "pipeline.abort_ack_timeout_s: input should be less"),
        ({"endpoints": {"max_message_mb": 2048}}, "pipeline.endpoints.max_message_mb: input"),
        ({"max_input_mb": 4096}, "pipeline.max_input_mb: input should be less than or equal"),
        ({"max_live_requests": 2**40}, "pipeline.max_live_requests: input should be less"),
        ({"client_stream_buffer": 2**63}, "pipeline.client_stream_buffer: input should be"),
        ({"relay": {"pool_mb": 2**40}}, "pipeline.relay.pool_mb: input should be less than"),
        ({"relay": {"credit_mb": 2**40}}, "pipeline.relay.credit_mb: input should be less"),
        ({"relay": {"credits": 2**40}}, "pipeline.relay.credits: input should be less"),
        ({"relay": {"inline_bytes": 2**31}}, "pipeline.relay.inline_bytes: input should be"),
        ({"relay": {"world_size": 2**40}}, "pipeline.relay.world_size: input should be less"),
    ],
)
def test_pipeline_numbers_are_finite_and_bounded(fields: dict[str, Any], where: str) -> None:
    e = config_error(pipe(st("a", terminal=True), **fields), resolve=False)
    assert str(e).startswith(where), str(e)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"restart": {"window_s": math.nan}}, "stages[a].restart.window_s: input should be a fin"),
        ({"restart": {"backoff_s": math.inf}}, "stages[a].restart.backoff_s: input should be a fi"),
        ({"restart": {"max": 2**40}}, "stages[a].restart.max: input should be less than"),
        ({"stream": {"credit_mb": 2**40}}, "stages[a].stream.credit_mb: input should be less"),
        ({"stream": {"outbox_chunks": 2**40}}, "stages[a].stream.outbox_chunks: input should be"),
        ({"tp_size": 5000}, "stages[a].tp_size: input should be less than or equal to 1024"),
        ({"replicas": 5000}, "stages[a].replicas: input should be less than or equal to 1024"),
        ({"torch_threads": 2**31}, "stages[a].torch_threads: input should be less than"),
        ({"max_queue": 2**40}, "stages[a].max_queue: input should be less than or equal"),
        ({"gpu": 10**30}, "stages[a].gpu: expected a GPU id (0..1023)"),
        ({"relay": {"backend": "nixl", "options": {"peer_wait_s": math.inf}}}, ""),
        ({"env": {"X": "a\0b"}}, "stages[a].env.X: a variable's value cannot contain a NUL"),
    ],
)
def test_stage_numbers_are_finite_and_bounded(fields: dict[str, Any], where: str) -> None:
    e = config_error(pipe(st("a", terminal=True, **fields)), resolve=False)
    # The backend's options model refuses it (relay/options.py: allow_inf_nan=False).
    expected = where or "stages[a].relay.options.peer_wait_s: input should be a finite number"
    assert str(e).startswith(expected), str(e)


def test_bounds_themselves_are_accepted() -> None:
    cfg = PipelineConfig.from_dict(
        pipe(
            st("a", terminal=True, tp_size=1, replicas=1024, stream={"credits": 1 << 20}),
            endpoints={"max_message_mb": MAX_MESSAGE_MB},
            max_input_mb=MAX_MESSAGE_MB,
            default_timeout_s=7 * 24 * 3600,
            relay={"inline_bytes": MAX_MESSAGE_MB << 20},
        )
    )
    assert cfg.endpoints.max_message_mb == MAX_MESSAGE_MB

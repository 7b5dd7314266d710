"""Fuzzing of the config loader: what `load_pipeline` and `PipelineConfig.from_dict` do with
whatever file or data they are given.

Whatever the input, loading must return a config or raise `ConfigError`: never another
exception, a hang, or memory that grows with what the input expands to. Every problem a
ConfigError lists is bounded in length (no input is echoed unbounded) and says where it
is: `pipeline...`, `stages[...]...`, or the file (with `line:column` for YAML errors).

Inputs come in four kinds, one test each (the issue 20 findings each had a kind):

- random bytes, text over YAML's punctuation and soups of YAML tokens (tags, anchors,
  escapes, numbers at the edges of what PyYAML parses);
- YAML documents built from random nested nodes with random tags, anchors and aliases,
  placed where a pipeline's fields are read, and templates of the known attacks at random
  sizes (alias and merge-key bombs, deep nesting, recursive aliases);
- near-valid configs: real pipelines with random fields set to random values and types,
  deleted or added, given to `from_dict` as Python data (with objects YAML cannot make:
  cycles, shared-reference bombs, huge ints);
- the same, written as YAML and loaded from the file.

Each case is one draw of bytes decoded by `Cursor` (as in test_relay_descriptor_fuzz.py):
nested strategies cost hypothesis about a millisecond a case on a busy host, this a
tenth of it, and the bytes still shrink towards the first entry of every table.
"""

from __future__ import annotations

import gc
import math
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, note
from hypothesis import strategies as st

from omnirail.config import ConfigError, PipelineConfig, load_pipeline
from omnirail.config.errors import MAX_LINE, MAX_PROBLEMS, short
from omnirail.config.models import EndpointsConfig, RelayConfig, StageConfig, StreamConfig
from omnirail.config.security import Quota, QuotasConfig
from tests.unit.config.helpers import F, T, demo

# A small input is loaded in milliseconds of CPU (the largest here, at the bounds, in a
# tenth of a second); this much means a superlinear path.
SECONDS_PER_INPUT = 2.0
# The whole message of one error: inputs here are small, so are their problem lists.
MAX_MESSAGE = 10_000

try:
    _DUMPER: Any = yaml.CSafeDumper  # ten times faster than the Python one
except AttributeError:  # PyYAML built without libyaml
    _DUMPER = yaml.SafeDumper


class Cursor:
    """Reads a case's choices off its bytes; zeros once they run out."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        at = self.at
        self.at += 1
        return self.data[at] if at < len(self.data) else 0

    def below(self, n: int) -> int:
        return self.byte() % n if n > 1 else 0

    def pick(self, table: Any) -> Any:
        return table[self.below(len(table))]

    def take(self, n: int) -> bytes:
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk.ljust(n, b"\0")


# ----------------------------------------------------------------------------- checks

_LOCATED = re.compile(r"^(pipeline|stages\[|\.\.\. and \d+ more problem)")


def check_error(exc: ConfigError, path: Path | None) -> None:
    """Bounded, and every problem says where it is."""
    text = str(exc)
    assert len(text) < MAX_MESSAGE, f"{len(text)} characters"
    assert 1 <= len(exc.errors) <= MAX_PROBLEMS + 1
    for line in exc.errors:
        assert 0 < len(line) <= MAX_LINE + 40, line[:200]
        if path is not None and line.startswith(str(path)):
            if "YAML" in line:
                # YAML knows the position of everything it refuses.
                assert re.match(rf"^{re.escape(str(path))}:\d+:\d+: ", line), line[:200]
            continue
        assert _LOCATED.match(line), line[:200]


def check(load: Callable[[], object], path: Path | None = None) -> None:
    """`load` returns or raises ConfigError, quickly; anything else fails the test."""
    # CPU time, not wall time: other work on a busy host stalls an example without the
    # loader doing more (a hang that does not compute is pytest-timeout's to catch). The
    # cyclic GC is off while it runs: deep into a campaign, a full collection of all that
    # hypothesis keeps takes seconds and may land on any example.
    gc_was_on = gc.isenabled()
    gc.disable()
    start = time.process_time()
    try:
        load()
    except ConfigError as exc:
        elapsed = time.process_time() - start
        note(f"ConfigError: {str(exc)[:500]}")
        check_error(exc, path)
    else:
        elapsed = time.process_time() - start
    finally:
        if gc_was_on:
            gc.enable()
    assert elapsed < SECONDS_PER_INPUT, f"took {elapsed:.2f} s of CPU"


@pytest.fixture(scope="module")
def yaml_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Module scope: hypothesis runs the test body many times per fixture.
    return tmp_path_factory.mktemp("config_fuzz") / "pipeline.yaml"


def load_text(path: Path, content: str | bytes) -> None:
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    # A fresh file each time, removed after: rewriting one in place makes ext4 flush it
    # on close (auto_da_alloc), which cost more than loading it.
    path.write_bytes(content)
    try:
        check(lambda: load_pipeline(path, resolve=False), path)
    finally:
        path.unlink()


# ----------------------------------------------------------------------------- tables

# Scalars at the edges of what PyYAML's resolvers and constructors take.
SCALARS = (
    "a",
    "shm",
    "nixl",
    "torchdist",
    "0",
    "-1",
    "1",
    "2048",
    "0x1F",
    "0o17",
    "0b101",
    "1_000",
    "1:30:00",
    "+.inf",
    "-.inf",
    ".nan",
    ".NaN",
    "1e999",
    "-1e999",
    "1e-400",
    "4.9e-324",
    "1.7976931348623157e308",
    "9" * 4301,
    "9" * 400,
    "1" * 30,
    "true",
    "no",
    "~",
    "null",
    "",
    "''",
    '""',
    "2024-01-01",
    "2024-13-45",
    "2024-02-30T25:61:61Z",
    "0001-01-01 00:00:00 +99:99",
    '"\\U00110000"',
    '"\\UFFFFFFFF"',
    '"\\x00"',
    '"\\0"',
    '"\\ud800"',
    '"\\N\\L\\P\\_"',
    '"\\q"',
    "'it''s'",
    "0-20000000",
    "0-3,6",
    "4095-0",
    f"'{F}'",
    "'.models:create'",
    "'not a path'",
    "tcp://h:1",
    "x" * 200,
    "|\n  block\n",
    ">-\n  folded\n",
    "=",
    "<<",
    "?",
    "-",
    "!",
    "@",
    "`",
    "%",
    "#c",
    "\t",
    "é",
    "\u2028",
    "\ufeff",
)
TAGS = (
    "",
    "",
    "",
    "!!str ",
    "!!int ",
    "!!float ",
    "!!bool ",
    "!!null ",
    "!!timestamp ",
    "!!binary ",
    "!!set ",
    "!!omap ",
    "!!pairs ",
    "!!seq ",
    "!!map ",
    "!!merge ",
    "!!value ",
    "!!python/object:os.system ",
    "!!python/name:os.system ",
    "!local ",
    "!<tag:yaml.org,2002:int> ",
    "!<!> ",
    "! ",
)
ANCHORS = ("a", "b", "c", "x" * 100)
# Pipeline fields and keys of each level: random nodes land where models read them.
PIPELINE_KEYS = (*PipelineConfig.model_fields, "relay_backend", "<<", "junk", "")
STAGE_KEYS = (*StageConfig.model_fields, "<<", "junk")
RELAY_KEYS = (*RelayConfig.model_fields, "<<")
NESTED_KEYS = {
    "endpoints": tuple(EndpointsConfig.model_fields),
    "stream": tuple(StreamConfig.model_fields),
    "relay": RELAY_KEYS,
    "options": ("peer_wait_s", "fetch_timeout_s", "copy_threads", "init_method", "ucx_config"),
    "quotas": (*QuotasConfig.model_fields, *Quota.model_fields),
}
ALL_KEYS = tuple(
    dict.fromkeys(PIPELINE_KEYS + STAGE_KEYS + RELAY_KEYS + sum(NESTED_KEYS.values(), ()))
)
TOKENS = (
    *(t for t in TAGS if t),
    *(f"&{a} " for a in ANCHORS[:3]),
    *(f"*{a}" for a in ANCHORS[:3]),
    "[",
    "]",
    "{",
    "}",
    ", ",
    ": ",
    "- ",
    "? ",
    "<<: ",
    "\n",
    "\n  ",
    "\n    - ",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "%TAG ! tag:x,2000:\n",
    "stages: ",
    "name: ",
    "factory: ",
    "terminal: true",
    "cpus: ",
    "'",
    '"',
    "\\",
    "#",
    "|",
    ">",
    "\t",
    "\r",
    "\x00",
    "\x85",
    "\ufeff",
    *SCALARS[:40],
)
YAML_CHARS = "{}[],:-?&*!|>'\"#%@`\\ \n\t.0123456789abcdefxEe+_<=~\x00\x85\ufeff\u2028é"


# ----------------------------------------------------------------------------- 1. bytes


@given(st.binary(max_size=200))
def test_random_bytes_and_token_soup(yaml_file: Path, case: bytes) -> None:
    """Bytes as the file, as characters of YAML's syntax, or as a soup of YAML tokens."""
    mode, body = (case[0] % 3, case[1:]) if case else (0, b"")
    if mode == 0:
        content: str | bytes = body
    elif mode == 1:
        content = "".join(YAML_CHARS[b % len(YAML_CHARS)] for b in body)
    else:
        content = "".join(TOKENS[b % len(TOKENS)] for b in body)
    load_text(yaml_file, content)


# ----------------------------------------------------------------------------- 2. YAML


def yaml_node(c: Cursor, depth: int = 0) -> str:
    """A random flow node: scalars with tags, anchors and aliases, sequences, mappings."""
    kind = c.below(10 if depth < 3 else 5)
    anchor = f"&{c.pick(ANCHORS)} " if c.below(6) == 0 else ""
    if kind <= 2:
        return f"{anchor}{c.pick(TAGS)}{c.pick(SCALARS)}"
    if kind == 3:
        return f"*{c.pick(ANCHORS)}"
    if kind == 4:
        return f"{anchor}{c.pick(TAGS)}{c.pick(ALL_KEYS)}"
    if kind <= 6:
        items = ", ".join(yaml_node(c, depth + 1) for _ in range(c.below(4)))
        return f"{anchor}{c.pick(TAGS)}[{items}]"
    pairs = ", ".join(
        f"{c.pick(ALL_KEYS) if c.below(4) else yaml_node(c, depth + 1)}: {yaml_node(c, depth + 1)}"
        for _ in range(c.below(4))
    )
    return f"{anchor}{c.pick(TAGS)}{{{pairs}}}"


def _stage(extra: str = "") -> str:
    return f"{{name: a, factory: '{F}', terminal: true{extra}}}"


def _bomb(c: Cursor, merge: bool) -> str:
    """Billion laughs: each level names the previous one `fanout` times."""
    levels, fanout = 1 + c.below(10), 1 + c.below(12)
    lines = ["l0: &l0 {x: lol}" if merge else "l0: &l0 [lol, lol]"]
    for i in range(1, levels):
        refs = ", ".join([f"*l{i - 1}"] * fanout)
        lines.append(f"l{i}: &l{i} {{<<: [{refs}]}}" if merge else f"l{i}: &l{i} [{refs}]")
    where = c.pick(("factory_args", "env", "cpus", "gpu", "next", "name"))
    lines.append(f"stages: [{{name: a, factory: '{F}', terminal: true, {where}: *l{levels - 1}}}]")
    return "\n".join(lines) + "\n"


def yaml_document(c: Cursor) -> str:
    mode = c.below(12)
    if mode == 0:  # a random node at the top
        return yaml_node(c) + "\n"
    if mode == 1:  # random top-level fields of a pipeline with one valid stage
        fields = "".join(
            f"{c.pick(PIPELINE_KEYS)}: {yaml_node(c)}\n" for _ in range(1 + c.below(3))
        )
        return f"stages: [{_stage()}]\n{fields}"
    if mode in (2, 3, 4):  # random fields of a stage
        extra = "".join(f", {c.pick(STAGE_KEYS)}: {yaml_node(c)}" for _ in range(1 + c.below(3)))
        return f"stages: [{_stage(extra)}]\n"
    if mode == 5:  # random fields of a nested level (relay, endpoints, stream, options)
        level = c.pick(tuple(NESTED_KEYS))
        body = ", ".join(f"{c.pick(NESTED_KEYS[level])}: {yaml_node(c)}" for _ in range(2))
        if level in ("stream", "options"):
            inner = (
                f"{{{body}}}" if level == "stream" else f"{{backend: nixl, options: {{{body}}}}}"
            )
            key = "stream" if level == "stream" else "relay"
            return f"stages: [{_stage(f', {key}: {inner}')}]\n"
        return f"stages: [{_stage()}]\n{level}: {{{body}}}\n"
    if mode in (6, 7):
        return _bomb(c, merge=mode == 7)
    if mode == 8:  # deep nesting, flow or block
        depth = c.byte() * 4  # up to 1020: far past MAX_DEPTH, cheap to write
        if c.below(2):
            return "a: " + "[" * depth + "]" * depth + "\n"
        return "".join("  " * i + "- \n" for i in range(min(depth, 80)))
    if mode == 9:  # recursive and undefined aliases, duplicate anchors
        return c.pick(
            (
                "a: &a [*a]\n",
                "a: &a {b: *a}\n",
                "stages: &s [{name: a, factory: x.y, next: *s}]\n",
                "a: *nowhere\n",
                "a: &a 1\nb: &a 2\n",
                "<<: *a\n",
                "a: &a {<<: *a}\n",
            )
        )
    if mode == 10:  # several documents, directives, odd starts
        return c.pick(
            ("", "---\n---\n", "--- a\n--- b\n", "%YAML 2.0\n---\na: 1\n", "\ufeffa: 1\n")
        )
    # mode 11: many stages referring to each other at random
    n = 1 + c.below(16)
    stages = []
    for i in range(n):
        targets = ", ".join(f"s{c.below(n)}" for _ in range(c.below(3)))
        factory = f"&f '{F}'" if i == 0 else "*f"  # an alias: short to parse
        stages.append(f"{{name: s{i}, factory: {factory}, next: [{targets}]}}")
    return f"stages: [{', '.join(stages)}, {_stage()}]\n"


@given(st.binary(min_size=1, max_size=96))
def test_random_yaml_documents(yaml_file: Path, case: bytes) -> None:
    """YAML built from random nodes (tags, anchors, aliases) where pipeline fields are read,
    and the known attacks at random sizes."""
    text = yaml_document(Cursor(case))
    note(text[:2000])
    load_text(yaml_file, text)


# ----------------------------------------------------------------------------- 3. mutations


def _shared_bomb() -> list[Any]:
    # 9^7 values in all, from 7 lists of 9 references: what an alias bomb loads as.
    level: list[Any] = ["lol"] * 9
    for _ in range(6):
        level = [level] * 9
    return level


def _cycle() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


def _deep(n: int) -> list[Any]:
    deep: list[Any] = []
    for _ in range(n):
        deep = [deep]
    return deep


# Values a mutation sets, YAML-dumpable ones first (both routes), then Python-only ones.
VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    2048,
    4095,
    (1 << 31) - 1,
    1 << 31,
    1 << 63,
    10**100,
    10**4000,
    0.0,
    -0.0,
    0.5,
    1e-300,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "a",
    "b",
    "shm",
    "nixl",
    "ucx",
    "torchdist",
    "inline",
    "cuda",
    "tcp://h:1",
    "tcp://",
    "0-20000000",
    "0-3,6",
    "3-1",
    "0,,1",
    "99999999999999999999999999999999999",
    "\x00",
    "A\x00B",
    "é\u2028",
    "x" * 100,
    "x" * 20_000,
    "9" * 4301,
    F,
    f"{T}:merge",
    f"{T}:NOT_CALLABLE",
    f"{T}:missing",
    "no_such_module_omnirail:f",
    ".models:create",
    "not a dotted path",
    [],
    [0],
    [0, 0],
    [0, 1],
    ["a"],
    ["a", "a"],
    ["b", "c"],
    [None],
    [[]],
    {},
    {"a": 1},
    {"backend": "nixl"},
    {"backend": "torchdist", "rank": 0, "world_size": 1},
    {"init_method": "tcp://h:1", "peer_wait_s": math.inf},
    {"": None},
    {1: 2},
    {None: []},
    list(range(40)),
)
PY_ONLY: tuple[Any, ...] = (
    _shared_bomb(),
    _cycle(),
    _deep(3000),
    _deep(70),
    list(range(3000)),
    list(range(200_000)),
    ",".join(["0-8191"] * 20_000),
    {f"k{i}": i for i in range(60_000)},
    10**5000,
    2**64 + 0.5,
    b"bytes",
    (1, 2),
    {1, 2},
    object(),
    frozenset(),
)
_TEXT = "abs_-0Zé \x00\n"  # no '.' or ':': random text never names a module to import


def value(c: Cursor, py: bool, depth: int = 0) -> Any:
    kind = c.below(10)
    if kind <= 3:
        return c.pick(VALUES)
    if kind == 4:  # an int of any width and sign
        n = int.from_bytes(c.take(1 + c.below(9)), "big")
        return -n if c.below(2) else n
    if kind == 5:  # any float, NaN and the infinities included
        return struct.unpack("<d", c.take(8))[0]
    if kind == 6:
        return "".join(c.pick(_TEXT) for _ in range(c.below(8)))
    if kind == 7 and depth < 3:
        return [value(c, py, depth + 1) for _ in range(c.below(4))]
    if kind == 8 and depth < 3:
        return {c.pick(ALL_KEYS): value(c, py, depth + 1) for _ in range(c.below(4))}
    if py and c.below(3) == 0:
        return c.pick(PY_ONLY)
    return c.pick(VALUES)


def _quickstart() -> dict[str, Any]:
    return {
        "name": "quickstart",
        "stages": [
            {"name": "pre", "factory": F, "next": ["text", "image"], "cpus": "0-1"},
            {"name": "text", "factory": F, "next": "fuse", "relay": {"pool_mb": 8}},
            {"name": "image", "factory": F, "next": "fuse", "gpu": 0},
            {
                "name": "fuse",
                "factory": F,
                "wait_for": ["text", "image"],
                "merge_fn": f"{T}:merge",
                "terminal": True,
            },
        ],
    }


def _edges() -> dict[str, Any]:
    return {
        "relay": {"backend": "nixl", "options": {"peer_wait_s": 1.0}},
        "stages": [
            {"name": "a", "factory": F, "next": "b", "relay_to": {"b": {"backend": "shm"}}},
            {"name": "b", "factory": F, "terminal": True, "cpus": "0-1", "process": "p"},
        ],
    }


def _fused() -> dict[str, Any]:
    return {
        "fused_stages": [["a", "b"]],
        "stages": [
            {"name": "a", "factory": F, "next": "b", "stream": {"credits": 4}},
            {"name": "b", "factory": F, "terminal": True, "stream_to": ["c"]},
            {"name": "c", "factory": F, "terminal": True, "process": "p"},
        ],
    }


def _knobs() -> dict[str, Any]:
    return {
        "endpoints": {"max_message_mb": 64},
        "default_timeout_s": 30.0,
        "coordinator_cpus": "0-1",
        "security": {
            "quotas": {
                "default": {"weight": 1, "max_live_requests": 8},
                "principals": {"web": {"weight": 2.5, "requests_per_s": 4, "burst": 8}},
            }
        },
        "stages": [
            {
                "name": "a",
                "factory": F,
                "terminal": True,
                "relay": {
                    "backend": "torchdist",
                    "rank": 0,
                    "world_size": 1,
                    "options": {"init_method": "tcp://h:1"},
                },
                "restart": {"max": 1, "window_s": 5.0},
                "stream": {"credits": 4},
                "env": {"X": "1"},
                "gpu": 0,
                "cpus": [0, 1],
            }
        ],
    }


def _tiny() -> dict[str, Any]:
    return {
        "stages": [
            {"name": "a", "factory": F, "next": "b"},
            {"name": "b", "factory": F, "terminal": True},
        ]
    }


# The YAML route takes the first two, the smallest (parsing costs about 40 µs a node):
# what it adds is how values read back from YAML, whatever the base. The Python route
# takes all.
BASES: tuple[Callable[[], dict[str, Any]], ...] = (
    _tiny,
    _edges,
    _fused,
    _knobs,
    _quickstart,
    demo,
)
YAML_BASES = 2


def test_bases_are_valid() -> None:
    for base in BASES:
        PipelineConfig.from_dict(base(), resolve=True)


_CONSTANTS = frozenset(id(v) for v in VALUES + PY_ONLY)


def _containers(data: Any) -> list[Any]:
    """The dicts and lists of `data` a mutation may change (not the shared constants)."""
    found, todo = [], [data]
    while todo and len(found) < 200:
        node = todo.pop()
        if id(node) in _CONSTANTS:
            continue
        if isinstance(node, dict):
            found.append(node)
            todo.extend(node.values())
        elif isinstance(node, list):
            found.append(node)
            todo.extend(node)
    return found


def mutated(c: Cursor, py: bool, bases: int) -> dict[str, Any]:
    """A base pipeline with 1 to 4 random changes: a field set to a random value (an
    existing key or any field name of any level), deleted, or a list item changed."""
    data = BASES[c.below(bases)]()
    for _ in range(1 + c.below(4)):
        target = c.pick(_containers(data))
        op = c.below(4)
        if isinstance(target, dict):
            keys = list(target) or list(ALL_KEYS)
            key = c.pick(keys) if c.below(2) else c.pick(ALL_KEYS)
            if op == 0:
                target.pop(key, None)
            else:
                target[key] = value(c, py)
        elif op == 0 and target:
            del target[c.below(len(target))]
        elif op == 1 or not target:
            target.append(value(c, py))
        else:
            target[c.below(len(target))] = value(c, py)
    return data


@given(st.binary(min_size=1, max_size=64))
def test_near_valid_configs_from_dict(case: bytes) -> None:
    """Real pipelines with random fields changed, as Python data (dotted paths resolved:
    only the table's paths can name a module)."""
    c = Cursor(case)
    data = mutated(c, py=True, bases=len(BASES))
    note(short(data, 2000))
    resolve = c.below(4) == 0
    check(lambda: PipelineConfig.from_dict(data, resolve=resolve))


@given(st.binary(min_size=1, max_size=64))
def test_near_valid_configs_as_yaml(yaml_file: Path, case: bytes) -> None:
    """The same changes written as YAML (shared values become anchors and aliases)."""
    c = Cursor(case)
    data = mutated(c, py=False, bases=YAML_BASES)
    text = yaml.dump(data, Dumper=_DUMPER, width=1 << 20)
    note(text[:2000])
    load_text(yaml_file, text)

"""Reading a YAML pipeline file into plain data, bounded and total.

`yaml.safe_load` is neither (issue 20 fuzz findings): an alias bomb expands to millions
of values, 500 nested brackets overflow the composer's recursion, and malformed scalars
escape as PyYAML's own ValueError, IndexError, KeyError or AttributeError (`!!float true`,
`!!int ""`, `!!timestamp x`, `"\\U00110000"`, an int of more than 4300 digits). `read_yaml`
turns every failure into a `ConfigError` naming `file:line:column`, using `ConfigLoader`:

- a SafeLoader that builds only what a pipeline holds: null, bool, int, float, str,
  timestamps (dates in `factory_args`), lists, mappings and `<<` merge keys. `!!binary`,
  `!!set`, `!!omap` and `!!pairs` (bytes, sets and lists of pairs, which no field takes)
  are refused at their line like any unknown tag.
- composing counts the values the document expands to (an alias counts the values of
  what it names, every time) and the nesting depth, and stops at `MAX_VALUES` /
  `MAX_DEPTH` (`omnirail.config.limits`) with the line of the offending node; an alias
  inside the node it names (a recursive structure) is refused too.
- the scanner refuses flow collections (`[`, `{`) nested past `MAX_DEPTH` as it reads
  them: it scans ahead of the composer, quadratically in the open brackets.
- a scalar its constructor cannot build (a malformed int, float, bool or timestamp) or
  an escape the scanner cannot decode is reported at its line instead of escaping as a
  Python error.
- a key given twice in one mapping is refused at its second line (PyYAML keeps the last
  and drops the first without a word, so a repeated `max_queue:` or `next:` would change
  a pipeline silently). Keys a `<<` merge brings in may be overridden, as YAML says.

Files past `MAX_FILE_BYTES` are refused before parsing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.scanner import ScannerError

from omnirail.config.errors import ConfigError, clip, short
from omnirail.config.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES

_TAG = "tag:yaml.org,2002:"
# Types no pipeline field takes; their tags are refused like unknown ones.
_REFUSED_TAGS = ("binary", "set", "omap", "pairs")
# Exceptions PyYAML's scanner and constructors raise on input they do not expect.
_PYYAML_BUGS = (ValueError, ArithmeticError, LookupError, TypeError, AttributeError)
_SYNTAX = "YAML syntax error"


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader limited to the types a pipeline holds, with bounded expansion and depth
    (see the module docstring)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._values = 0  # values the document expands to so far
        # id(node) -> the values it expands to, once composed; a node being composed has
        # none yet, so an alias to it is recursive.
        self._sizes: dict[int, int] = {}
        self._keys_checked: set[int] = set()  # mappings whose own keys were checked

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:
                size = self._sizes.get(id(target))
                if size is None:
                    raise ComposerError(
                        None,
                        None,
                        f"alias {clip(event.anchor, 40)!r} is used inside the node it names "
                        "(recursive structures are not supported)",
                        event.start_mark,
                    )
                self._count(size, event)
            return super().compose_node(parent, index)  # the undefined alias error
        event = self.peek_event()
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark
            )
        before = self._values
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._count(1, event)
        self._sizes[id(node)] = self._values - before
        return node

    def _count(self, n: int, event: Any) -> None:
        self._values += n
        if self._values > MAX_VALUES:
            raise ComposerError(
                None,
                None,
                f"the document expands to more than {MAX_VALUES} values (an alias counts "
                "each time it is used); refusing to expand it",
                event.start_mark,
            )

    def flatten_mapping(self, node: MappingNode) -> None:
        # Every mapping is flattened (its merges expanded, in place) before it is built,
        # and a merge flattens what it merges first: so this sees each mapping's own keys
        # once, before any merged key joins them.
        if id(node) not in self._keys_checked:
            self._keys_checked.add(id(node))
            self._refuse_repeated_keys(node)
        super().flatten_mapping(node)

    def _refuse_repeated_keys(self, node: MappingNode) -> None:
        first: dict[Any, Any] = {}  # key -> the mark of its first use
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _TAG + "merge":
                continue  # merges may be overridden; a non-scalar key is refused later
            # A plain `=` key resolves to the value tag, which flattening turns into "=".
            key = "=" if key_node.tag == _TAG + "value" else self.construct_object(key_node)
            mark = first.get(key)
            if mark is None:
                first[key] = key_node.start_mark
            else:
                raise ConstructorError(
                    None,
                    None,
                    f"key {short(key)} is given twice in one mapping (first at line "
                    f"{mark.line + 1}); give it once",
                    key_node.start_mark,
                )

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # The scanner reads ahead past every '[' or '{' that may start a simple key and
        # checks each open one per token: quadratic in the nesting (4,000 brackets take
        # 0.7 s, a megabyte of them hours). Composing would refuse the depth anyway, but
        # only after the scanner got there.
        if self.flow_level >= MAX_DEPTH:
            raise ScannerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)

    def scan_flow_scalar_non_spaces(self, double: bool, start_mark: Any) -> Any:
        # "\U00110000" passes the scanner's hex check and then fails in chr().
        try:
            return super().scan_flow_scalar_non_spaces(double, start_mark)
        except _PYYAML_BUGS as exc:
            raise ScannerError(
                "while scanning a quoted scalar",
                start_mark,
                f"invalid escape sequence: {clip(str(exc))}",
                self.get_mark(),
            ) from None


def _checked(kind: str, construct: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`construct` with the scalar's mark on whatever it raises for a malformed value."""

    def checked(loader: Any, node: Any) -> Any:
        try:
            return construct(loader, node)
        except yaml.YAMLError:
            raise
        except _PYYAML_BUGS as exc:
            value = node.value if isinstance(node, ScalarNode) else None
            raise ConstructorError(
                None, None, f"invalid {kind} {short(value)} ({clip(str(exc))})", node.start_mark
            ) from None

    return checked


# Scalars whose constructors raise Python errors on malformed values.
_CHECKED_TAGS = ("null", "bool", "int", "float", "timestamp")
# The class's own table (PyYAML's add_constructor would copy SafeLoader's the same way).
ConfigLoader.yaml_constructors = {
    tag: _checked(kind, fn) if kind in _CHECKED_TAGS else fn
    for tag, fn in yaml.SafeLoader.yaml_constructors.items()
    if (kind := (tag or "").removeprefix(_TAG)) not in _REFUSED_TAGS
}


def read_yaml(p: Path) -> Any:
    """The data of YAML file `p`; every problem is a ConfigError naming `p` (and the line
    and column when there is one)."""
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(f"{p}: larger than {MAX_FILE_BYTES >> 20} MiB; not a pipeline file")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read: {clip(str(exc), 200)}") from None
    return read_yaml_text(text, p)


def read_yaml_text(text: str, p: Path | str) -> Any:
    """The data of YAML `text`, read as `read_yaml` reads a file; errors name `p` (a file,
    or what the text is, such as a command-line flag)."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_FILE_BYTES >> 20} MiB")
    loader: ConfigLoader | None = None
    try:
        # The reader checks the characters as it is made: constructed inside the try.
        loader = ConfigLoader(text)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or type(exc).__name__
        if exc.problem and exc.context:  # "but found another document" needs its context
            problem = f"{exc.problem} ({clip(exc.context, 100)})"
        # Composing and constructing read well-formed YAML: what they refuse is content.
        what = "YAML error" if isinstance(exc, ComposerError | ConstructorError) else _SYNTAX
        raise ConfigError(f"{_at(p, mark)}: {what}: {clip(problem, 200)}") from None
    except yaml.reader.ReaderError as exc:
        # Raised for a character YAML forbids; it knows the offset, not the line.
        where = _at_offset(p, text, exc.position)
        raise ConfigError(f"{where}: {_SYNTAX}: {clip(exc.reason, 200)}") from None
    except (yaml.YAMLError, *_PYYAML_BUGS, RecursionError) as exc:
        # Nothing else is known to escape; should PyYAML raise something new, it is still
        # a broken file, reported where the reader stopped.
        where = _at(p, loader.get_mark() if loader is not None else None)
        raise ConfigError(
            f"{where}: {_SYNTAX}: {type(exc).__name__}: {clip(str(exc), 200)}"
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def _at(p: Path | str, mark: Any) -> str:
    if mark is None:
        return str(p)
    return f"{p}:{mark.line + 1}:{mark.column + 1}"


def _at_offset(p: Path | str, text: str, offset: int) -> str:
    line = text.count("\n", 0, offset)
    column = offset - (text.rfind("\n", 0, offset) + 1)
    return f"{p}:{line + 1}:{column + 1}"

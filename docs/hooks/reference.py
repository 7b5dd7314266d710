"""Reference pages generated from the code when the site is built (an MkDocs hook).

A page holds a marker where a generated part goes:

- `<!-- reference:config -->`: every field of every pydantic model reachable from
  `omnirail.config.PipelineConfig`, and of each relay backend's options model
  (`omnirail.relay.registry`): name, type, default, bounds, description;
- `<!-- reference:cli -->`: every `omnirail` command, from the argparse parser the command
  line itself runs (`omnirail.cli.commands.build_parser`).

Nothing in these parts is written by hand, so a field or flag added to the code appears in
the docs at the next build. A config field without a description is a warning, which
`mkdocs build --strict` turns into a failure (tests/unit/docs/ checks the same).

The hook imports omnirail from the checkout it lives in, laid out as the wheel installs it
(pyproject's `package-dir`), whatever the environment has installed.
"""

from __future__ import annotations

import argparse
import enum
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MARKER = "<!-- reference:config -->"
CLI_MARKER = "<!-- reference:cli -->"
log = logging.getLogger("mkdocs.plugins.omnirail_reference")


# -- importing omnirail from this checkout ------------------------------------------------


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the subpackages pyproject's `package-dir` maps (`omnirail.relay` -> relay/)
    in this checkout, before any installed copy."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def use_checkout(root: Path = ROOT) -> None:
    """Makes `import omnirail` (and its mapped subpackages) load from `root`."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    mapped = pyproject["tool"]["setuptools"].get("package-dir", {})
    dirs = {name: root / folder for name, folder in mapped.items() if name}
    if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder(dirs))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get("omnirail")
    if loaded is not None and Path(loaded.__file__ or "").resolve().parent != root / "omnirail":
        log.warning("omnirail was imported from %s before the docs hook ran", loaded.__file__)


# -- cells ---------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text for a Markdown table cell: `|`, `<` and `>` escaped outside code spans, one
    line."""
    parts = str(text).replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def code(text: str) -> str:
    """`text` as a code span (one that holds backticks gets a longer fence)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


# -- the configuration ---------------------------------------------------------------------


def anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (through unions, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def reachable_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """`root` and every model its fields reach, breadth first, each once."""
    order: list[type[BaseModel]] = [root]
    i = 0
    while i < len(order):
        for field in order[i].model_fields.values():
            for model in _models_in(field.annotation):
                if model not in order:
                    order.append(model)
        i += 1
    return order


def relay_option_models() -> dict[str, type[BaseModel]]:
    """Backend name -> its options model, from the one table of backends."""
    from omnirail.relay import registry

    return {name: b.options for name, b in registry.BACKENDS.items()}


def config_models(root: type[BaseModel] | None = None) -> list[type[BaseModel]]:
    """Every model the configuration reference documents: those reachable from `root`
    (default `PipelineConfig`), then the relay backends' options models."""
    if root is None:
        from omnirail.config import PipelineConfig

        root = PipelineConfig
    models = reachable_models(root)
    for model in relay_option_models().values():
        if model not in models:
            models.append(model)
    return models


def type_name(annotation: Any, linked: Iterable[type[BaseModel]] = ()) -> str:
    """A field's type as a reader writes it in YAML terms (`int | None`, `list[str]`,
    `"a" | "b"`); a documented model is its name."""
    linked = tuple(linked)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    if origin is typing.Annotated:
        return type_name(args[0], linked)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a, linked) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a, linked) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """A field's default as YAML would spell it; "required" when it has none."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, str):
        return code(f'"{value}"')
    if isinstance(value, dict | list) and not value:
        return code("{}" if isinstance(value, dict) else "[]")
    return code(repr(value).replace("'", '"') if isinstance(value, dict | list) else value)


_BOUNDS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Gt, "gt", "> {}"),
    (annotated_types.Ge, "ge", "≥ {}"),
    (annotated_types.Lt, "lt", "< {}"),
    (annotated_types.Le, "le", "≤ {}"),
    (annotated_types.MinLen, "min_length", "at least {} long"),
    (annotated_types.MaxLen, "max_length", "at most {} long"),
)


def bounds_text(field: FieldInfo) -> str:
    """A field's constraints (`≥ 0`, `≤ 65535`, lengths, a pattern, strictness)."""
    out: list[str] = []
    for item in field.metadata:
        for kind, attr, fmt in _BOUNDS:
            if isinstance(item, kind):
                out.append(fmt.format(getattr(item, attr)))
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches {code(pattern)}")
        if getattr(item, "strict", None) is True:
            out.append("strict type")
    return ", ".join(out)


def missing_descriptions(models: Iterable[type[BaseModel]]) -> list[str]:
    """`Model.field` for every field without a description."""
    return [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]


def model_section(
    model: type[BaseModel], title: str, linked: Iterable[type[BaseModel]] = (), level: int = 3
) -> str:
    """One model's heading, docstring and field table."""
    linked = tuple(linked)
    lines = [f"{'#' * level} {title} {{ #{anchor(model)} }}", ""]
    doc = (model.__doc__ or "").strip()
    if doc and doc != (BaseModel.__doc__ or "").strip():
        lines += [_dedent(doc), ""]
    if not model.model_fields:
        return "\n".join([*lines, "No fields.", ""])
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        kind = cell(code(type_name(field.annotation, linked)))
        refs = [m for m in _models_in(field.annotation) if m in linked]
        if refs:
            kind += " " + ", ".join(f"([{m.__name__}](#{anchor(m)}))" for m in refs)
        lines.append(
            f"| {code(name)} | {kind} | {cell(default_text(field))} | "
            f"{cell(bounds_text(field))} | {cell(field.description or '')} |"
        )
    return "\n".join([*lines, ""])


def _dedent(doc: str) -> str:
    first, _, rest = doc.partition("\n")
    import textwrap

    return (first + "\n" + textwrap.dedent(rest)).strip()


def config_reference(root: type[BaseModel] | None = None) -> str:
    """The configuration reference: a section per model reachable from `root` (default
    `PipelineConfig`), then one per relay backend's options."""
    models = config_models(root)
    options = relay_option_models()
    by_model: dict[type[BaseModel], list[str]] = {}
    for backend, model in options.items():
        by_model.setdefault(model, []).append(backend)
    out = ["## Pipeline", ""]
    for model in models:
        if model in by_model:
            continue
        out.append(model_section(model, model.__name__, models))
    out += [
        "## Relay options",
        "",
        "What `relay.options` may hold, per backend (the backend the level's merged relay "
        "config selects). Unknown keys are refused; values keep their types strictly.",
        "",
    ]
    for model, backends in by_model.items():
        title = ", ".join(f"`{b}`" for b in backends) + f": {model.__name__}"
        out.append(model_section(model, title, models))
    return "\n".join(out)


# -- the command line ----------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _usage(parser: argparse.ArgumentParser, width: int = 88) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=width)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _argument_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str | None:
    if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
        return None
    if action.help == argparse.SUPPRESS:
        return None
    formatter = argparse.HelpFormatter(parser.prog)
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs != 0:
            metavar = formatter._get_default_metavar_for_optional(action)
            names += " " + formatter._format_args(action, metavar)
    else:
        names = formatter._format_args(
            action, formatter._get_default_metavar_for_positional(action)
        )
    help_text = formatter._expand_help(action) if action.help else ""
    if action.choices and not isinstance(action.choices, dict):
        choices = "one of: " + ", ".join(str(c) for c in action.choices)
        help_text = f"{help_text}; {choices}" if help_text else choices
    default = action.default
    hidden = default is None or default is False or default is argparse.SUPPRESS
    shown = (
        ""
        if hidden
        or default == []
        or action.required
        or isinstance(action, argparse._StoreTrueAction)
        else code(default)
    )
    optional_positional = action.nargs in ("?", "*")
    required = action.required or (not action.option_strings and not optional_positional)
    return f"| {code(names)} | {'yes' if required else ''} | {cell(shown)} | {cell(help_text)} |"


def parser_section(parser: argparse.ArgumentParser, help_text: str = "", level: int = 2) -> str:
    """A command's heading, what it does, usage and argument table; its subcommands follow."""
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    text = parser.description or help_text
    if text:
        lines += [cell(text) if "|" in text else text, ""]
    lines += ["```text", _usage(parser), "```", ""]
    rows = [r for a in parser._actions if (r := _argument_row(parser, a))]
    if rows:
        lines += ["| argument | required | default | what |", "|---|---|---|---|", *rows, ""]
    for name, sub in _subparsers(parser):
        lines.append(parser_section(sub, _help_of(parser, name), level + (level < 3)))
    return "\n".join(lines)


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference: the top-level command, then each subcommand in the order the
    parser declares them."""
    if parser is None:
        from omnirail.cli.commands import build_parser

        parser = build_parser()
    rows = [f"| [`{name}`](#{_slug(sub.prog)}) | {cell(_help_of(parser, name))} |"
            for name, sub in _subparsers(parser)]  # fmt: skip
    index = ["| command | what it does |", "|---|---|", *rows, ""]
    sections = [parser_section(sub, _help_of(parser, name)) for name, sub in _subparsers(parser)]
    return "\n".join(["```text", _usage(parser), "```", "", *index, *sections])


def _slug(text: str) -> str:
    """The anchor MkDocs' toc gives a heading made of `text` in a code span."""
    return re.sub(r"[^a-z0-9_\- ]", "", text.lower()).strip().replace(" ", "-")


# -- MkDocs hooks --------------------------------------------------------------------------

_GENERATORS: dict[str, Callable[[], str]] = {
    CONFIG_MARKER: config_reference,
    CLI_MARKER: cli_reference,
}


def on_config(config: Any) -> Any:
    use_checkout()
    missing = missing_descriptions(config_models())
    for name in missing:
        log.warning("config field %s has no description (Field(description=...))", name)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, generate in _GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown

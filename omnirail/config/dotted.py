"""Resolve dotted paths (`pkg.mod:attr` or `pkg.mod.attr`) to Python objects.

Config files name factories and hooks by dotted path. A path that starts with a dot
(`.models:create`, `.pkg.mod.fn`) names a module in the config file's own directory,
imported as a submodule of a package made for that directory (`_omnirail_dir_<hash>`), so
two pipelines' `models.py` never collide and modules of one directory import each other
with relative imports (`from .text import VOCAB`). Paths without the dot are imported as
usual, with the config file's directory first on sys.path. Resolution imports the module, so it
runs the module's top-level code: config files are trusted like any other code the
operator runs. Results are cached per (path, base_dir) because stages resolve the same
hooks once per stage instance and imports take the import lock.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import threading
from types import ModuleType
from typing import Any

from omnirail.config.errors import short

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_COLON_RE = re.compile(rf"\A({_DOTTED}):({_DOTTED})\Z")
# The dot-only form needs a module and an attribute, so at least two components.
_DOT_RE = re.compile(rf"\A{_IDENT}(?:\.{_IDENT})+\Z")
# Relative to the config file's directory: `.mod:attr`, `.mod.attr`, `.pkg.mod:attr`.
_REL_COLON_RE = re.compile(rf"\A\.({_DOTTED}):({_DOTTED})\Z")
_REL_DOT_RE = re.compile(rf"\A\.{_IDENT}(?:\.{_IDENT})+\Z")
DIR_PACKAGE_PREFIX = "_omnirail_dir_"

_cache: dict[tuple[str, str | None], Any] = {}
_lock = threading.Lock()


def syntax_error(path: object) -> str | None:
    """Returns why `path` is not a well-formed dotted path, or None when it is."""
    if not isinstance(path, str):
        return f"expected a dotted path string, got {type(path).__name__}"
    if any(r.match(path) for r in (_COLON_RE, _DOT_RE, _REL_COLON_RE, _REL_DOT_RE)):
        return None
    return (
        f"invalid dotted path {short(path)}: expected 'pkg.module:attr' or 'pkg.module.attr' "
        "(or '.module:attr' for a module next to the config file)"
    )


def dir_package(base_dir: str) -> str:
    """The package name standing for `base_dir` (registered on first use).

    The directory's `__init__.py`, when it has one, runs as the package's own code.
    """
    real = os.path.realpath(base_dir)
    digest = hashlib.sha1(real.encode(), usedforsecurity=False).hexdigest()[:12]
    name = f"{DIR_PACKAGE_PREFIX}{digest}"
    if name in sys.modules:
        return name
    init = os.path.join(real, "__init__.py")
    if os.path.isfile(init):
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[real])
    else:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [real]
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return name


def add_sys_path(base_dir: str | None) -> None:
    """Puts `base_dir` first on sys.path (once) so modules next to a config file import."""
    if not base_dir or base_dir in sys.path:
        return
    sys.path.insert(0, base_dir)
    # Finders cache directory listings; a directory new to sys.path must be rescanned.
    importlib.invalidate_caches()


def resolve(path: str, base_dir: str | None = None) -> Any:
    """Imports and returns the object `path` names.

    Raises ValueError for a malformed path, ImportError when a module cannot be imported
    (including errors raised by the module's own code) and AttributeError when the module
    lacks the attribute. Every message starts with the path, e.g.
    "cannot import 'examples.x:y': No module named 'examples.x'".
    """
    key = (path, base_dir)
    with _lock:
        if key in _cache:
            return _cache[key]
    err = syntax_error(path)
    if err is not None:
        raise ValueError(err)
    add_sys_path(base_dir)
    if path.startswith("."):
        obj = _resolve_relative(path, base_dir)
    elif ":" in path:
        mod_name, attr_path = path.split(":", 1)
        obj: Any = _import(path, mod_name)
        obj = _getattrs(path, obj, attr_path.split("."))
    else:
        obj = _resolve_dots(path)
    with _lock:
        _cache[key] = obj
    return obj


def _resolve_relative(path: str, base_dir: str | None) -> Any:
    if not base_dir:
        raise ImportError(
            f"cannot import {path!r}: a path starting with '.' names a module next to the "
            "config file, and this config has no file"
        )
    try:
        package = dir_package(base_dir)
    except (Exception, SystemExit) as exc:
        raise ImportError(
            f"cannot import {path!r}: {base_dir}/__init__.py failed: {type(exc).__name__}: {exc}"
        ) from exc
    absolute = package + path
    try:
        if ":" in absolute:
            mod_name, attr_path = absolute.split(":", 1)
            return _getattrs(absolute, _import(absolute, mod_name), attr_path.split("."))
        return _resolve_dots(absolute)
    except (ImportError, AttributeError) as exc:
        # Say it in the config's terms: the path as written and the directory, not the
        # package name made up for it.
        message = str(exc).replace(repr(absolute), repr(path))
        message = message.replace(f"'{package}.", "'.").replace(f"'{package}'", repr(base_dir))
        raise type(exc)(f"{message} (in {base_dir})") from exc


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def _import(path: str, mod_name: str) -> ModuleType:
    try:
        return importlib.import_module(mod_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {path!r}: {exc}", name=mod_name) from exc
    except (Exception, SystemExit) as exc:  # sys.exit() at import too
        # A module that fails while executing is reported as an import failure of the
        # path, with the original error kept as the cause.
        raise ImportError(
            f"cannot import {path!r}: {type(exc).__name__} while importing {mod_name!r}: {exc}",
            name=mod_name,
        ) from exc


def _getattrs(path: str, obj: Any, names: list[str]) -> Any:
    for name in names:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            owner = (
                f"module {obj.__name__!r}"
                if isinstance(obj, ModuleType)
                else f"{type(obj).__name__} {getattr(obj, '__qualname__', obj)!r}"
            )
            raise AttributeError(
                f"cannot resolve {path!r}: {owner} has no attribute {name!r}"
            ) from None
    return obj


def _resolve_dots(path: str) -> Any:
    # Walk from the top package down, importing submodules while the next component is
    # not already an attribute; the first component that is neither ends the module part.
    parts = path.split(".")
    obj: Any = _import(path, parts[0])
    i = 1
    while i < len(parts) and isinstance(obj, ModuleType):
        name = parts[i]
        if hasattr(obj, name):
            obj = getattr(obj, name)
            i += 1
            continue
        sub = f"{obj.__name__}.{name}"
        try:
            obj = importlib.import_module(sub)
        except ModuleNotFoundError as exc:
            if exc.name != sub:
                raise ImportError(f"cannot import {path!r}: {exc}", name=sub) from exc
            if i == len(parts) - 1:
                # Last component: most likely a misspelt attribute, not a module.
                raise AttributeError(
                    f"cannot resolve {path!r}: module {obj.__name__!r} has no attribute {name!r}"
                ) from None
            raise ImportError(f"cannot import {path!r}: {exc}", name=sub) from exc
        except ImportError as exc:
            raise ImportError(f"cannot import {path!r}: {exc}", name=sub) from exc
        except (Exception, SystemExit) as exc:
            raise ImportError(
                f"cannot import {path!r}: {type(exc).__name__} while importing {sub!r}: {exc}",
                name=sub,
            ) from exc
        i += 1
    return _getattrs(path, obj, parts[i:])


def accepts(fn: Any, param: str) -> bool:
    """Whether `fn` takes a parameter `param` by keyword (injected factory arguments)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    p = sig.parameters.get(param)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)

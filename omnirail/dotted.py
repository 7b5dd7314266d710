"""Resolve dotted paths (`pkg.mod:attr` or `pkg.mod.attr`) to Python objects.

Config files name factories and hooks by dotted path. Resolution imports the module, so it
runs the module's top-level code: config files are trusted like any other code the
operator runs. Results are cached per (path, base_dir) because stages resolve the same
hooks once per stage instance and imports take the import lock.
"""

from __future__ import annotations

import importlib
import re
import sys
import threading
from types import ModuleType
from typing import Any

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_COLON_RE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")
# The dot-only form needs a module and an attribute, so at least two components.
_DOT_RE = re.compile(rf"^{_IDENT}(?:\.{_IDENT})+$")

_cache: dict[tuple[str, str | None], Any] = {}
_lock = threading.Lock()


def syntax_error(path: object) -> str | None:
    """Returns why `path` is not a well-formed dotted path, or None when it is."""
    if not isinstance(path, str):
        return f"expected a dotted path string, got {type(path).__name__}"
    if _COLON_RE.match(path) or _DOT_RE.match(path):
        return None
    return f"invalid dotted path {path!r}: expected 'pkg.module:attr' or 'pkg.module.attr'"


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
    if ":" in path:
        mod_name, attr_path = path.split(":", 1)
        obj: Any = _import(path, mod_name)
        obj = _getattrs(path, obj, attr_path.split("."))
    else:
        obj = _resolve_dots(path)
    with _lock:
        _cache[key] = obj
    return obj


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def _import(path: str, mod_name: str) -> ModuleType:
    try:
        return importlib.import_module(mod_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {path!r}: {exc}", name=mod_name) from exc
    except Exception as exc:
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
        except Exception as exc:
            raise ImportError(
                f"cannot import {path!r}: {type(exc).__name__} while importing {sub!r}: {exc}",
                name=sub,
            ) from exc
        i += 1
    return _getattrs(path, obj, parts[i:])

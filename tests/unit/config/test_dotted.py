"""Tests for omnirail.config.dotted: both path forms, error messages, base_dir and the cache."""

from __future__ import annotations

import collections
import importlib
import os.path
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnirail.config import dotted

VALUE = "original"


class Holder:
    @staticmethod
    def method() -> str:
        return "ok"


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory off sys.path and a unique module name to write there."""
    name = f"omnirail_dotted_{uuid.uuid4().hex[:8]}"
    yield tmp_path, name
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
    dotted.clear_cache()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("os.path:join", os.path.join),
        ("os.path.join", os.path.join),
        ("collections:OrderedDict", collections.OrderedDict),
        ("collections.OrderedDict", collections.OrderedDict),
        ("collections:OrderedDict.fromkeys", collections.OrderedDict.fromkeys),
        ("tests.unit.config.test_dotted:Holder.method", Holder.method),
        ("tests.unit.config.test_dotted.Holder.method", Holder.method),
        ("importlib.util.find_spec", importlib.util.find_spec),
    ],
)
def test_resolve_both_forms(path: str, expected: object) -> None:
    assert dotted.resolve(path) == expected


@pytest.mark.parametrize(
    "path",
    ["", "os", "os:", ":join", "os::path", "a b.c", "os.path:join:x", "1mod.x", "os.", "os..x"],
)
def test_syntax_errors(path: str) -> None:
    assert dotted.syntax_error(path) is not None
    with pytest.raises(ValueError, match="invalid dotted path"):
        dotted.resolve(path)


def test_syntax_error_for_non_string() -> None:
    assert dotted.syntax_error(3) == "expected a dotted path string, got int"


def test_valid_syntax() -> None:
    assert dotted.syntax_error("a.b") is None
    assert dotted.syntax_error("a:b") is None
    assert dotted.syntax_error("a.b_c:D.e") is None


def test_missing_module_colon_form() -> None:
    with pytest.raises(ImportError) as ei:
        dotted.resolve("examples.x:y")
    assert str(ei.value) == "cannot import 'examples.x:y': No module named 'examples.x'"


def test_missing_top_module_dot_form() -> None:
    with pytest.raises(ImportError, match="No module named 'nonexistent_mod_xyz'"):
        dotted.resolve("nonexistent_mod_xyz.foo")


def test_missing_submodule_dot_form() -> None:
    with pytest.raises(ImportError, match=r"cannot import 'examples\.nope\.fn'.*'examples\.nope'"):
        dotted.resolve("examples.nope.fn")


def test_missing_attribute_both_forms() -> None:
    with pytest.raises(AttributeError) as ei:
        dotted.resolve("os.path:nope")
    assert (
        str(ei.value) == "cannot resolve 'os.path:nope': module 'posixpath' has no attribute 'nope'"
    )
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        dotted.resolve("os.path.nope")
    with pytest.raises(AttributeError, match="'Holder' has no attribute 'nope'"):
        dotted.resolve("tests.unit.config.test_dotted:Holder.nope")


def test_module_error_is_import_error(module_dir: tuple[Path, str]) -> None:
    d, name = module_dir
    (d / f"{name}.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ImportError) as ei:
        dotted.resolve(f"{name}:f", str(d))
    assert "RuntimeError" in str(ei.value)
    assert "boom at import" in str(ei.value)
    assert isinstance(ei.value.__cause__, RuntimeError)


@pytest.mark.parametrize("form", [":f", ".f"])
def test_a_module_that_exits_at_import_is_an_import_error(
    module_dir: tuple[Path, str], form: str
) -> None:
    d, name = module_dir
    pkg = d / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import sys\nsys.exit(2)\n")
    with pytest.raises(ImportError, match=r"SystemExit while importing .*mod.*: 2"):
        dotted.resolve(f"{name}.mod{form}", str(d))


def test_missing_dependency_is_reported_as_import_error(module_dir: tuple[Path, str]) -> None:
    d, name = module_dir
    pkg = d / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import nonexistent_dep_q\n\ndef f():\n    pass\n")
    # The dependency's name, not the path's last component, must be blamed.
    for path in (f"{name}.mod.f", f"{name}.mod:f"):
        with pytest.raises(ImportError, match="No module named 'nonexistent_dep_q'"):
            dotted.resolve(path, str(d))


def test_base_dir_is_added_to_sys_path(module_dir: tuple[Path, str]) -> None:
    d, name = module_dir
    (d / f"{name}.py").write_text("def make():\n    return 7\n")
    with pytest.raises(ImportError):
        dotted.resolve(f"{name}:make")
    fn = dotted.resolve(f"{name}:make", str(d))
    assert fn() == 7
    assert sys.path[0] == str(d)
    dotted.add_sys_path(str(d))
    assert sys.path.count(str(d)) == 1


def test_cache_returns_same_object_until_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    dotted.clear_cache()
    path = "tests.unit.config.test_dotted:VALUE"
    assert dotted.resolve(path) == "original"
    monkeypatch.setattr(sys.modules[__name__], "VALUE", "changed")
    assert dotted.resolve(path) == "original"
    dotted.clear_cache()
    assert dotted.resolve(path) == "changed"
    dotted.clear_cache()


def test_failures_are_not_cached(module_dir: tuple[Path, str]) -> None:
    d, name = module_dir
    with pytest.raises(ImportError):
        dotted.resolve(f"{name}:make", str(d))
    (d / f"{name}.py").write_text("def make():\n    return 1\n")
    importlib.invalidate_caches()
    assert dotted.resolve(f"{name}:make", str(d))() == 1


# ---- paths relative to the config file's directory -----------------------------------


def _write_pkg_dir(root: Path, marker: str) -> Path:
    root.mkdir()
    (root / "models.py").write_text(f"from .helpers import VALUE\nMARK = {marker!r}\n")
    (root / "helpers.py").write_text("VALUE = 42\n")
    return root


def test_relative_path_names_a_module_next_to_the_config(tmp_path: Path) -> None:
    base = _write_pkg_dir(tmp_path / "a", "a")
    try:
        assert dotted.resolve(".models:MARK", str(base)) == "a"
        assert dotted.resolve(".models.VALUE", str(base)) == 42  # sibling, relative import
    finally:
        dotted.clear_cache()


def test_relative_modules_of_two_directories_do_not_collide(tmp_path: Path) -> None:
    a = _write_pkg_dir(tmp_path / "a", "a")
    b = _write_pkg_dir(tmp_path / "b", "b")
    try:
        assert dotted.resolve(".models:MARK", str(a)) == "a"
        assert dotted.resolve(".models:MARK", str(b)) == "b"
        assert "models" not in sys.modules or not hasattr(sys.modules["models"], "MARK")
    finally:
        dotted.clear_cache()


def test_relative_path_errors_name_the_path_and_directory(tmp_path: Path) -> None:
    base = _write_pkg_dir(tmp_path / "c", "c")
    try:
        with pytest.raises(ImportError) as ei:
            dotted.resolve(".nope:x", str(base))
        assert str(ei.value) == f"cannot import '.nope:x': No module named '.nope' (in {base})"
        with pytest.raises(AttributeError) as ai:
            dotted.resolve(".models:missing", str(base))
        assert "'.models:missing'" in str(ai.value) and "'missing'" in str(ai.value)
        assert dotted.DIR_PACKAGE_PREFIX not in str(ai.value)
        with pytest.raises(ImportError, match="has no file"):
            dotted.resolve(".models:MARK")
    finally:
        dotted.clear_cache()


@pytest.mark.parametrize("path", [".models:f", ".pkg.mod:f", ".mod.attr"])
def test_relative_syntax_is_accepted(path: str) -> None:
    assert dotted.syntax_error(path) is None


@pytest.mark.parametrize("path", [".", "..models:f", ".models", ".:f"])
def test_relative_syntax_errors(path: str) -> None:
    assert dotted.syntax_error(path) is not None

"""The public API: every name in __all__ exists, is documented, and functions show an example."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import fsdp_tp

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", fsdp_tp.__all__)
def test_public_name_exists_and_is_documented(name):
    obj = getattr(fsdp_tp, name)
    if isinstance(obj, (str, tuple)):  # constants are documented in their module
        return
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 40, f"fsdp_tp.{name} needs a docstring"
    if inspect.isfunction(obj):
        assert ">>>" in doc, f"fsdp_tp.{name}: the docstring needs a runnable example"


@pytest.mark.parametrize("module", [m for m in vars(fsdp_tp).values() if isinstance(m, types.ModuleType)])
def test_every_module_declares_all(module):
    assert isinstance(getattr(module, "__all__", None), list), module.__name__


def test_the_front_door_is_the_users_path_and_shadows_no_submodule():
    assert len(fsdp_tp.__all__) <= 19, fsdp_tp.__all__
    assert len(set(fsdp_tp.__all__)) == len(fsdp_tp.__all__)
    for name in fsdp_tp.__all__:
        assert importlib.util.find_spec(f"fsdp_tp.{name}") is None, f"fsdp_tp.{name} shadows a module"
    # every module of the package is importable under its own name
    for info in pkgutil.walk_packages(fsdp_tp.__path__, "fsdp_tp."):
        if info.name == "fsdp_tp.__main__":  # `python -m fsdp_tp`: running it is the command
            continue
        assert isinstance(getattr(importlib.import_module(info.name), "__all__", None), list), info.name


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"\*\*Run the tests\*\*.*?\n\n    ([^\n]+)\n", readme, re.S).group(1)
    script = (ROOT / ".ci" / "run").read_text()
    assert runs_in_order(command, script), (command, script)
    # negative controls: a command changed, or two swapped, is not the README's command
    parts = command.split(" && ")
    assert not runs_in_order(" && ".join([*parts[:-1], "python -m pytest -x"]), script)
    assert not runs_in_order(" && ".join([parts[1], parts[0], *parts[2:]]), script)


def runs_in_order(command: str, script: str) -> bool:
    """Whether `script` runs the `a && b && c` list `command` as consecutive lines a, b, c.

    CI writes one command a line because `set -e` does not stop inside an `&&` list.
    """
    lines = [line.strip() for line in script.splitlines()]
    parts = command.split(" && ")
    return any(lines[i : i + len(parts)] == parts for i in range(len(lines)))


_REFERENCE = re.compile(r"`~?(fsdp_tp(?:\.\w+)+)[`(]")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            try:
                obj = getattr(obj, part)
            except (AttributeError, DeprecationWarning):  # (an old path's warning, an error here)
                return False
        return True
    return False


def test_every_name_the_docs_and_docstrings_cite_exists():
    """``fsdp_tp.x.y`` in backticks (a Sphinx role or a code span), in the package's source and
    in docs/: each names a module or an object where it says (moved code leaves none stale; an
    old path, which warns, is stale too: pyproject's filters make its warning an error)."""
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    cited = {m for f in files for m in _REFERENCE.findall(f.read_text())}
    stale = sorted(name for name in cited if not _resolves(name))
    assert len(cited) > 50 and not stale, stale  # (89 distinct names when written)


def test_negative_control_a_moved_name_is_caught():
    assert _REFERENCE.findall("see :func:`~fsdp_tp.linen.layers.attend_moved`") == [
        "fsdp_tp.linen.layers.attend_moved"
    ]
    assert not _resolves("fsdp_tp.linen.layers.attend_moved") and _resolves("fsdp_tp.attention.attend")

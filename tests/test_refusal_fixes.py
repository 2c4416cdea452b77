"""Issue 82: for every refusal the suite raises, the fix its message names is applied by the test
that raises it, as a user would, and accepted (``tests/refusals.py``).

A test function that expects a :class:`~fsdp_tp.errors.RuleError` reads its fix off the
message (``named_fix``, ``role_named``) and runs it, or is listed in ``BY_HAND`` with why no
test can apply that fix by the message. This file reads the suite's source: a refusal added
without its fix applied fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.refusals import BY_HAND

TESTS = Path(__file__).parent
_FIXERS = {"named_fix", "role_named", "stored_as_named"}


def _expects_a_refusal(node: ast.AST) -> bool:
    """``pytest.raises(RuleError, ...)`` anywhere in ``node``."""
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "raises"
        and n.args
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id == "RuleError"
        for n in ast.walk(node)
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _unfixed(source: str, file: str) -> list[str]:
    """``file::name`` of each test function in ``source`` that expects a refusal and applies no
    fix the message names: it calls no fixer, nor reads a helper of the file's that does."""
    body = ast.parse(source).body
    fixers = set(_FIXERS)
    for node in body:  # (a module-level function or table whose body reads a fix off a message)
        named = [node.name] if isinstance(node, ast.FunctionDef) else []
        named += [t.id for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)]
        if named and not named[0].startswith("test") and _names(node) & _FIXERS:
            fixers |= set(named)
    return [
        f"{file}::{node.name}"
        for node in body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
        if _expects_a_refusal(node) and not _names(node) & fixers
    ]


def _refusing_tests() -> tuple[list[str], list[str]]:
    """Every test function expecting a refusal, and those that apply no named fix."""
    every, unfixed = [], []
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        every += [
            f"{path.name}::{n.name}"
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test") and _expects_a_refusal(n)
        ]
        unfixed += _unfixed(source, path.name)
    return every, unfixed


def test_every_refusal_the_suite_raises_has_the_fix_it_names_applied():
    every, unfixed = _refusing_tests()
    assert len(every) > 40, every  # (the scan sees the suite's refusals)
    missing = [name for name in unfixed if name not in BY_HAND]
    assert not missing, (
        f"refusals whose named fix no test applies (apply it, or say why in BY_HAND): {missing}"
    )
    stale = [name for name in BY_HAND if name not in unfixed]
    assert not stale, f"BY_HAND names tests that apply their fix or do not exist: {stale}"
    assert all(len(why) > 60 for why in BY_HAND.values())


def test_negative_control_a_refusal_without_its_fix_is_seen():
    bare = "def test_x():\n    with pytest.raises(RuleError, match='no'):\n        run()\n"
    fixed = bare + "    run(fix=named_fix(refused, 'x'))\n"
    helper = "def _fix(refused):\n    return named_fix(refused, 'x')\n" + bare + "    _fix(refused)\n"
    assert _unfixed(bare, "f.py") == ["f.py::test_x"]
    assert _unfixed(fixed, "f.py") == [] and _unfixed(helper, "f.py") == []

"""Every warning of the library's is an :class:`fsdp_tp.errors.FsdpTpWarning`, emitted through
one helper (:func:`fsdp_tp.errors.warn`) at the user's line, where Python shows it and a filter
by module applies, never at a line inside the library. (The other warnings' lines are checked
where each is raised: ``test_fsdp_units``, ``test_rules``, ``test_plan_check``, ``test_auto_tp``,
``test_dropout``.)"""

from __future__ import annotations

import ast
import pathlib
import tomllib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx
from fsdp_tp import errors
from fsdp_tp.errors import FsdpTpWarning, UnmatchedRuleWarning

PACKAGE = pathlib.Path(fsdp_tp.__file__).parent
# _aliases's module __getattr__ warns at the exact frame that read an old path (stacklevel 2:
# its reader, never a walk), the library's own included.
EXACT = {"errors.py", "_aliases.py"}


def _direct_warns(source: str, where: str) -> list[str]:
    """``where:line`` of each ``warnings.warn(...)`` in ``source``."""
    return [
        f"{where}:{node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "warn"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "warnings"
    ]


def test_the_library_warns_only_through_the_one_helper():
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        where = file.relative_to(PACKAGE).as_posix()
        if where not in EXACT:
            found += _direct_warns(file.read_text(), where)
    assert found == []
    # (negative control) a warning with a stacklevel of its own is seen
    assert _direct_warns("import warnings\nwarnings.warn(w, stacklevel=3)\n", "m") == ["m:2"]


def test_every_library_warning_is_one_kind_and_the_suite_makes_it_an_error():
    kinds = [getattr(errors, n) for n in errors.__all__ if n.endswith("Warning") and n != "FsdpTpWarning"]
    assert len(kinds) == 6 and all(issubclass(k, FsdpTpWarning) for k in kinds), kinds
    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    assert "error::fsdp_tp.errors.FsdpTpWarning" in config["tool"]["pytest"]["ini_options"]["filterwarnings"]


def _unmatched_linen():
    model = fsdp_tp.shard_by_rules(nn.Dense, [("kernel", P()), ("wq/kernel", P("fsdp"))])(4)
    mesh = fsdp_tp.make_mesh({"fsdp": 8})

    def init(x):  # the user's line: the trace reaches the library from here
        return model.init(jax.random.key(0), x)

    jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P()), jnp.ones((2, 4)))


def _unmatched_nnx():
    fsdp_tp.nnx.shard_by_rules(lambda rngs: nnx.Linear(4, 4, rngs=rngs), [("kernel", P()), ("wq", P())])


@pytest.mark.parametrize("make", [_unmatched_linen, _unmatched_nnx], ids=["linen", "nnx"])
def test_a_rule_matching_nothing_is_said_at_the_user_s_line(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    said = [w for w in caught if w.category is UnmatchedRuleWarning]
    assert len(said) == 1 and "['wq" in str(said[0].message), [str(w.message) for w in caught]
    assert said[0].filename == __file__, f"{said[0].filename}:{said[0].lineno}"


def test_negative_control_with_no_line_of_the_user_s_the_warning_stays_at_the_library_s(monkeypatch):
    """Every frame the library's (``python -m fsdp_tp``): the warning points where it was raised,
    never at nothing. And the frames read as the user's: this file's and site-packages' (which
    holds the user's installed code too), not jax's or Python's own."""
    assert not errors._is_library(__file__) and not errors._is_library(pytest.__file__)
    assert errors._is_library(jax.__file__) and errors._is_library(ast.__file__)
    monkeypatch.setattr(errors, "_is_library", lambda filename: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _unmatched_nnx()
    assert caught[0].filename.startswith(str(PACKAGE)), caught[0].filename

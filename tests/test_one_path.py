"""One path to each public name (issue 58 point 2).

A name's canonical path is the shallowest public module whose ``__all__`` lists it; a deeper
listing is allowed only on the way down to where the name is defined (``fsdp_tp.make_mesh`` and
``fsdp_tp.mesh.make_mesh``), never beside it (the roles were listed by six modules). Every
other path 0.1 and 0.2 wrote is a row of :data:`fsdp_tp._aliases.MOVED`: it reads the very
object with one ``DeprecationWarning`` naming the canonical path, and no page, docstring or
message of the project names it. So with a Linen layer's field 0.2 named another way
(:data:`fsdp_tp._renamed.RENAMED`: ``axis_name``, ``sequence_axis``, ``sequence_parallel``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

import fsdp_tp
from fsdp_tp._aliases import _MODULES, MOVED, canonical
from fsdp_tp._renamed import DEPRECATED, RENAMED, renamed_keywords

ROOT = Path(__file__).resolve().parents[1]


def _public_modules() -> list[str]:
    names = ["fsdp_tp"]
    for info in pkgutil.walk_packages(fsdp_tp.__path__, "fsdp_tp."):
        if not any(part.startswith("_") for part in info.name.split(".")) and info.name not in _MODULES:
            names.append(info.name)
    return names


@functools.cache
def listings() -> dict[int, list[str]]:
    """``{id(object): [every 'module.name' whose module's __all__ lists it]}``."""
    found: dict[int, list[str]] = defaultdict(list)
    for name in _public_modules():
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if not isinstance(obj, str | int | type(fsdp_tp)):  # a module is a path, not a name
                found[id(obj)].append(f"{name}.{attr}")
    return found


def beside(paths: list[str]) -> list[str]:
    """The listings of one object that are not on the way down to its deepest one."""
    deepest = max(paths, key=lambda p: p.count("."))
    home = deepest.rpartition(".")[0]
    return [p for p in paths if not (home + ".").startswith(p.rpartition(".")[0] + ".")]


def test_every_public_name_is_listed_on_one_path():
    found = listings()
    assert len(found) > 100  # (the package's public names when written: 160)
    several = {tuple(paths): beside(paths) for paths in found.values() if beside(paths)}
    assert not several, several
    listed = {p for paths in found.values() for p in paths}
    assert not listed & {m.old for m in MOVED}, "an old path is still in an __all__"


def test_negative_control_a_name_listed_beside_its_home_is_caught():
    assert beside(
        ["fsdp_tp.tp.ColumnParallel", "fsdp_tp.nnx.ColumnParallel", "fsdp_tp.tp._matmul.ColumnParallel"]
    )
    assert not beside(["fsdp_tp.make_mesh", "fsdp_tp.mesh.make_mesh"])


@pytest.mark.parametrize("moved", MOVED, ids=lambda m: m.old)
def test_each_old_path_reads_the_same_object_with_one_warning_naming_the_new(moved):
    module, _, name = moved.old.rpartition(".")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = getattr(importlib.import_module(module), name)
    assert old is canonical(moved.new)
    assert [str(w.message) for w in caught] == [moved.message], caught
    assert caught[0].category is DeprecationWarning and caught[0].filename == __file__  # the reader's line
    assert f"write {moved.new}" in moved.message and moved.removed in moved.message
    # the path it names is the canonical one: a module, or the shallowest listing of the object
    paths = listings().get(id(old), [moved.new])
    assert min(paths, key=lambda p: p.count(".")) == moved.new, paths


def test_an_old_import_warns_once_at_the_users_line_in_a_fresh_process():
    """0.1's ``from fsdp_tp.tp_rules import mlp_rules``, 0.2's ``from fsdp_tp.nnx import
    ColumnParallel``: they work, each name warning once, from the user's file."""
    source = (
        "from fsdp_tp.tp_rules import mlp_rules, ColumnParallel\n"
        "from fsdp_tp.nnx import RowParallel, shard_by_rules\n"
        "import fsdp_tp.tp as tp\n"
        "print(mlp_rules.__module__, ColumnParallel is tp.ColumnParallel, RowParallel is tp.RowParallel)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c", source], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.split() == ["fsdp_tp.linen.tp_rules", "True", "True"], (
        done.stderr
    )
    warned = re.findall(r"<string>:\d+: DeprecationWarning: (.*)", done.stderr)
    says = "is deprecated since 0.2.0 and goes in 0.3.0: write"
    assert warned == [
        f"fsdp_tp.tp_rules.mlp_rules {says} fsdp_tp.linen.tp_rules.mlp_rules",
        f"fsdp_tp.tp_rules.ColumnParallel {says} fsdp_tp.tp.ColumnParallel",
        f"fsdp_tp.nnx.RowParallel {says} fsdp_tp.tp.RowParallel",
    ], done.stderr


def old_paths_named(text: str) -> set[str]:
    """The old paths ``text`` writes: ``fsdp_tp.nnx.ColumnParallel``, or ``from fsdp_tp.nnx
    import (..., ColumnParallel)``, or one of the modules that are nothing but old paths."""
    named = {m.old for m in MOVED if re.search(rf"\b{re.escape(m.old)}\b", text)}
    named |= {m for m in _MODULES if re.search(rf"\b{re.escape(m)}\b", text)}
    for module, inside, line in re.findall(r"from (fsdp_tp[\w.]*) import (?:\(([^)]*)\)|([\w ,]*))", text):
        for name in re.findall(r"\w+", re.sub(r"#[^\n]*|\bas\b", ",", inside or line)):
            if f"{module}.{name}" in {m.old for m in MOVED} | set(_MODULES):
                named.add(f"{module}.{name}")
    return named


# What names old paths on purpose: the table, the changelog's list of them, this test.
_ON_PURPOSE = {"src/fsdp_tp/_aliases.py", "CHANGELOG.md", "tests/test_one_path.py"}


def test_no_page_docstring_or_message_names_an_old_path():
    files = [
        *ROOT.glob("*.md"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
        ROOT / "conftest.py",
        ROOT / "pyproject.toml",
    ]
    named = {
        str(f.relative_to(ROOT)): found
        for f in files
        if str(f.relative_to(ROOT)) not in _ON_PURPOSE and (found := old_paths_named(f.read_text()))
    }
    assert not named, named


def test_negative_control_old_paths_in_a_text_are_found():
    text = (
        "from fsdp_tp.nnx import (\n    ColumnParallel,\n    shard_by_rules,\n)\nfsdp_tp.tp.column_input(x)\n"
    )
    assert old_paths_named(text) == {"fsdp_tp.nnx.ColumnParallel", "fsdp_tp.tp.column_input"}
    assert old_paths_named("import fsdp_tp.tp_rules") == {"fsdp_tp.tp_rules"}
    assert old_paths_named("from fsdp_tp import fsdp") == {"fsdp_tp.fsdp"}
    two = "from fsdp_tp.testing import check_sharded\nfrom fsdp_tp.linen.tp_rules import ColumnParallel\n"
    assert old_paths_named(two) == {"fsdp_tp.linen.tp_rules.ColumnParallel"}  # (one line read into the next)
    clean = "from fsdp_tp.tp import ColumnParallel\nfsdp_tp.linen.fsdp.gather_params\nfsdp_tp.linen.tp_rules"
    assert old_paths_named(clean) == set()


_OLD_VALUE = {"axis_name": "tensor", "sequence_axis": 1, "sequence_parallel": True}


_FIELDS = [row for row in RENAMED if not row.of_a_function]
_KEYWORDS = [row for row in RENAMED if row.of_a_function]


@pytest.mark.parametrize("row", _FIELDS, ids=lambda r: f"{r.owner}.{r.old}")
def test_each_renamed_field_sets_the_new_one_with_one_warning_naming_it(row):
    """The layer built with the old field name is the layer built with the new one (its value
    converted: ``sequence_parallel=True`` is ``sequence_dim=1``), after one warning; both
    names at once, a TypeError naming both."""
    layer = getattr(fsdp_tp, row.owner)
    size = (4, 2) if row.owner == "VocabParallelEmbed" else (4,)
    if row.owner == "AttentionBlock":
        size = (2, 4)
    given = _OLD_VALUE[row.old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = layer(*size, **{row.old: given})
    assert [str(w.message) for w in caught] == [row.message(given)], caught
    assert caught[0].filename == __file__  # the line that built it: shown by default in __main__
    assert f"write {row.owner}({row.new}=" in row.message(given) and "0.3.0" in row.message(given)
    assert old == layer(*size, **{row.new: row.value(given)}) and getattr(old, row.old) is not given
    with pytest.raises(TypeError, match=f"{row.old}={given!r} and {row.new}="):
        layer(*size, **{row.old: given, row.new: 0 if row.new == "sequence_dim" else "expert"})


def renamed_fields_named(text: str) -> set[str]:
    """The old field names ``text`` passes to a Linen layer of :data:`RENAMED` on one line."""
    owners = "|".join(sorted({row.owner for row in _FIELDS}))
    return {
        f"{owner}.{row.old}"
        for owner, call in re.findall(rf"\b({owners})\(([^\n]*)", text)
        for row in _FIELDS
        if row.owner == owner and re.search(rf"\b{row.old}=", call)
    }


def test_no_page_or_example_passes_a_renamed_field():
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    files += [*(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    named = {
        str(f.relative_to(ROOT)): found
        for f in files
        if str(f.relative_to(ROOT)) not in _ON_PURPOSE and (found := renamed_fields_named(f.read_text()))
    }
    assert not named, named
    # negative control: 0.2's spelling is found, the new one is not
    assert renamed_fields_named("fsdp_tp.MLPBlock(16, axis_name=None, sequence_parallel=True)") == {
        "MLPBlock.axis_name",
        "MLPBlock.sequence_parallel",
    }
    assert renamed_fields_named("ColumnParallelDense(32, axis='tensor', sequence_dim=1)") == set()


# One dialect (issue 83 point 5): a mesh axis is `axis` (several: `axes`), an array dim `dim`.
_OLD_KEYWORD = {"axis_name": "tensor", "axis_names": ("data",), "sequence_axis": 1, "sequence_parallel": True}
_OLD_DIALECT = ("axis_name", "axis_names", "sequence_axis")  # (a flag `sequence_parallel` is a setting)


@pytest.mark.parametrize("row", _KEYWORDS, ids=lambda r: f"{r.owner}.{r.old}")
def test_each_renamed_keyword_is_passed_as_the_new_one_with_one_warning_naming_it(row):
    """The function takes the new name only; the old one, passed to it, is passed as the new one
    (its value converted) after one warning at the caller's line; both at once, a TypeError."""
    function = canonical(f"fsdp_tp.{row.owner}")
    parameters = inspect.signature(function).parameters
    assert function._fsdp_tp_renamed == row.owner and row.new in parameters, row
    assert row.old not in parameters or row.old == "axis"  # (gather_from_axis's axis: a dim, then)
    given = 1 if row.new == "dim" else _OLD_KEYWORD[row.old]
    passes = renamed_keywords(row.owner)(lambda **given: given)  # (the table's translation alone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert passes(**{row.old: given}) == {row.new: row.value(given)}
    assert [str(w.message) for w in caught] == [row.message(given)] and caught[0].filename == __file__
    other = 0 if row.new in ("dim", "sequence_dim") else "expert"
    with pytest.raises(
        TypeError, match=re.escape(f"{row.old}={given!r} and {row.new}={other!r} name one setting twice")
    ):
        passes(**{row.old: given, row.new: other})


def test_a_call_written_for_0_2_computes_as_the_new_one_after_its_warnings():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from fsdp_tp.collectives import gather_from_axis
    from fsdp_tp.tp.pieces import add_bias_once

    mesh = fsdp_tp.make_mesh({"tensor": 8})
    x, bias = jnp.arange(16.0).reshape(8, 2), jnp.ones(2)
    run = lambda f: jax.shard_map(
        lambda x: f(x)[None], mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor")
    )(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = run(
            lambda x: add_bias_once(gather_from_axis(x, axis=0, axis_name="tensor"), bias, "tensor", True)
        )
    assert [w.filename for w in caught] == [__file__] * 3, [str(w.message) for w in caught]
    new = run(lambda x: add_bias_once(gather_from_axis(x, dim=0, axis="tensor"), bias, "tensor", 1))
    assert jnp.array_equal(old, new) and jnp.array_equal(new, jnp.broadcast_to(x + 1, (8, 8, 2)))
    # (negative control) the function itself takes 0.2's keywords no more: the table passes them
    with pytest.raises(TypeError, match="axis_name"):
        run(lambda x: inspect.unwrap(gather_from_axis)(x, axis=0, axis_name="tensor"))


def _misnamed(function) -> list[str]:
    """The parameters of ``function`` (a public callable) in 0.2's dialect: a mesh axis not
    ``axis``/``axes``, an array dim not ``dim``. A Linen layer's deprecated field is not one."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in parameters
        if p.default is not DEPRECATED
        and (p.name in _OLD_DIALECT or (p.name == "axis" and p.annotation in (int, "int")))
    ]


def test_every_public_function_names_a_mesh_axis_axis_and_an_array_dim_dim():
    said = {}
    for name in _public_modules():
        if name.split(".")[1:2] in (["cli"], ["bench"], ["recipe"]):
            continue  # (the command and its recipe: not a library a user calls)
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            for function in [obj, *(vars(obj).values() if inspect.isclass(obj) else ())]:
                if callable(function) and (found := _misnamed(function)):
                    said[f"{name}.{attr}"] = found
    assert not said, said

    # (negative control) 0.2's gather_from_axis is found
    def gather_from_axis(x, axis: int, axis_name):
        return x

    assert _misnamed(gather_from_axis) == ["axis", "axis_name"]


def test_a_column_layer_called_prepared_computes_as_before_with_one_warning():
    """0.1's ``ColumnParallelDense(...)(x, prepared=True)`` (the caller passed the input through
    *f*) still computes the layer on the input as it is, the same numbers and gradients as the
    layer applying *f* itself, after one ``DeprecationWarning`` at the caller's line naming
    0.3.0 and what to write; a role's call no longer takes the flag (tests/test_layering.py)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from fsdp_tp.tp.pieces import column_input

    mesh, layer = fsdp_tp.make_mesh({"data": 2, "tensor": 4}), fsdp_tp.ColumnParallelDense(8)
    x = jnp.arange(24.0).reshape(2, 12) / 24
    params = jax.jit(jax.shard_map(layer.init, mesh=mesh, in_specs=(P(), P()), out_specs=P("tensor")))
    variables = params(jax.random.key(0), x)

    def loss(variables, x, prepared):
        def local(variables, x):
            x = column_input(x, "tensor") if prepared else x
            return jnp.sum(layer.apply(variables, x, prepared=prepared) ** 2)[None]

        specs = (P("tensor"), P())
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("tensor"), check_vma=False)
        return run(variables, x).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.value_and_grad(loss, argnums=(0, 1))(variables, x, True)
    assert [w.category for w in caught] == [DeprecationWarning], caught
    assert caught[0].filename == __file__, caught[0].filename  # (the line that called the layer)
    assert "prepared=True" in str(caught[0].message) and "0.3.0" in str(caught[0].message)
    assert "HeadParallel" in str(caught[0].message)
    want = jax.value_and_grad(loss, argnums=(0, 1))(variables, x, False)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    # (negative control) the prepared layer given the input without f: its input gradient is
    # this device's share only, not the sum (unchecked, nothing else sums it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unprepared = jax.grad(
            lambda x: jax.shard_map(
                lambda v, x: jnp.sum(layer.apply(v, x, prepared=True) ** 2)[None],
                mesh=mesh,
                in_specs=(P("tensor"), P()),
                out_specs=P("tensor"),
                check_vma=False,
            )(variables, x).sum()
        )(x)
    assert not jnp.allclose(unprepared, want[1][1])

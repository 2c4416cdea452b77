"""Partition rules: ``(pattern, spec)`` pairs that say how each parameter is laid out.

A parameter's *path* is its keys joined by ``/``, as in
``"encoder/layers_3/attn/query/kernel"`` (under ``nn.scan`` the stacked
parameters keep the scan's name, e.g. ``"blocks/mlp/wi/kernel"``, with the
layer dim first). ``pattern`` is a regular expression searched in the path
(``re.search``: anchor it with ``^``/``$`` to match whole paths); ``spec`` is
a ``PartitionSpec`` (or tuple) naming, per dim, the mesh axis or axes that
split it. The first rule that matches wins; unmatched leaves get ``default``.

Flax's logical annotations are the second source: a leaf boxed by
``nn.with_logical_partitioning`` that no rule matches is laid out by
``nn.logical_axis_rules`` (passed, or the ones active in flax's context).

>>> import jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> rules = [(r"attn/(query|key|value)/kernel$", P("fsdp", "tensor")), (r"kernel$", P("fsdp"))]
>>> params = {"attn": {"query": {"kernel": jnp.ones((8, 8))}}, "mlp": {"kernel": jnp.ones((8, 4))}}
>>> specs_from_rules(params, rules, make_mesh({"fsdp": 2, "tensor": 4}))   # first match wins
{'attn': {'query': {'kernel': P('fsdp', 'tensor')}}, 'mlp': {'kernel': P('fsdp',)}}
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._axes import entry_axes
from ._types import PyTree
from .errors import IndivisibleShapeError, RuleError, UnmatchedRuleWarning

__all__ = [
    "REPLICATED",
    "Rules",
    "compile_rules",
    "named_shardings",
    "path_of",
    "spec_for",
    "specs_from_rules",
]

Rules = Sequence[tuple[str, PartitionSpec | tuple]]
REPLICATED = PartitionSpec()


@dataclass(frozen=True)
class CompiledRule:
    pattern: str
    regex: re.Pattern
    spec: PartitionSpec


def compile_rules(rules: Rules, caller: str = "rules") -> tuple[CompiledRule, ...]:
    """Checks and compiles ``(pattern, spec)`` pairs; a :class:`~fsdp_tp.errors.RuleError` names a bad one.

    >>> compile_rules([("kernel$", (None, "fsdp"))])[0].spec
    P(None, 'fsdp')
    >>> compile_rules([("ker(nel", ("fsdp",))])
    Traceback (most recent call last):
    ...
    fsdp_tp.errors.RuleError: rules: rule pattern 'ker(nel' is not a regular expression: ...
    """
    compiled = []
    for rule in rules:
        pattern, regex, spec = split_rule(
            rule, caller, "(pattern, spec) pair, e.g. ('kernel$', P(None, 'fsdp'))"
        )
        if not isinstance(spec, PartitionSpec | tuple):
            raise RuleError(
                f"{caller}: rule {pattern!r} -> {spec!r}: give a PartitionSpec or a tuple of axis names."
            )
        compiled.append(CompiledRule(pattern, regex, PartitionSpec(*spec)))
    return tuple(compiled)


def split_rule(rule, caller: str, expected: str) -> tuple[str, re.Pattern, Any]:
    """``(pattern, compiled pattern, value)`` of a ``(pattern, value)`` rule, or a clear RuleError."""
    if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
        raise RuleError(f"{caller}: rule {rule!r} is not a {expected}.")
    try:
        return rule[0], re.compile(rule[0]), rule[1]
    except re.error as err:
        raise RuleError(f"{caller}: rule pattern {rule[0]!r} is not a regular expression: {err}.") from None


def path_of(key_path) -> str:
    """``"a/b/kernel"`` from a JAX key path (dict keys, attributes, indices)."""
    return jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")


def _check(path: str, shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: Mapping) -> PartitionSpec:
    if len(spec) > len(shape):
        raise RuleError(f"{path}: spec {spec} names {len(spec)} dims but the parameter has shape {shape}.")
    seen: dict = {}
    for dim, entry in enumerate(spec):
        for axis in entry_axes(entry):
            if axis not in axis_sizes:
                raise RuleError(
                    f"{path}: spec {spec} names mesh axis {axis!r}, but the mesh has axes "
                    f"{dict(axis_sizes)}; use one of those names."
                )
            if axis in seen:
                raise RuleError(
                    f"{path}: spec {spec} uses mesh axis {axis!r} on dims {seen[axis]} and {dim}; an axis "
                    f"can split one dim of a parameter. Split the other dim over another axis."
                )
            seen[axis] = dim
        parts = math.prod(axis_sizes[a] for a in entry_axes(entry))
        if shape[dim] % parts:
            raise IndivisibleShapeError(
                f"{path}: dim {dim} (size {shape[dim]}) of shape {shape} is not divisible by mesh axes "
                f"{entry_axes(entry)} (size {parts}) of spec {spec}; make it a multiple of {parts} or "
                f"change the rule."
            )
    return spec


def spec_for(
    path: str,
    shape: tuple[int, ...],
    rules: Sequence[CompiledRule],
    axis_sizes: Mapping,
    default: PartitionSpec = REPLICATED,
    logical_names: tuple | None = None,
    logical_axis_rules=None,
) -> tuple[PartitionSpec, int | None]:
    """The checked spec of one parameter and the index of the rule that gave it (None: not a rule).

    >>> rules = compile_rules([("attn/.*kernel$", (None, "tensor")), ("kernel$", ("fsdp",))])
    >>> spec_for("layer/attn/query/kernel", (8, 16), rules, {"fsdp": 2, "tensor": 4})
    (P(None, 'tensor'), 0)
    >>> spec_for("layer/mlp/kernel", (8, 16), rules, {"fsdp": 2, "tensor": 4})
    (P('fsdp',), 1)
    """
    for index, rule in enumerate(rules):
        if rule.regex.search(path):
            return _check(path, shape, rule.spec, axis_sizes), index
    if logical_names is not None:
        mesh_axes = nn.logical_to_mesh_axes(logical_names, logical_axis_rules)
        return _check(path, shape, PartitionSpec(*(mesh_axes or ())), axis_sizes), None
    return _check(path, shape, default, axis_sizes), None


def warn_unmatched(rules: Sequence[CompiledRule], used: set[int], paths: Sequence[str], caller: str) -> None:
    """Warns once, listing every rule that matched no parameter (a typo's usual symptom)."""
    unused = [rule.pattern for index, rule in enumerate(rules) if index not in used]
    if unused:
        sample = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
        warnings.warn(
            UnmatchedRuleWarning(
                f"{caller}: rules matching no parameter: {unused}; parameter paths look like: {sample}. "
                f"Fix the patterns or drop those rules."
            ),
            stacklevel=3,
        )


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned | nn.LogicallyPartitioned)


def specs_from_rules(
    tree: PyTree,
    rules: Rules,
    mesh,
    default: PartitionSpec = REPLICATED,
    logical_axis_rules=None,
) -> PyTree:
    """The ``PartitionSpec`` of every leaf of a plain pytree (arrays or shape structs), by rules.

    For ``jax.jit`` users: pass the result to :func:`named_shardings`. Leaves
    boxed with logical names fall back to ``logical_axis_rules`` (or flax's
    active ones). Every spec is checked against the mesh: axis names, one
    dim per axis, divisibility.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 2, "tensor": 4})
    >>> params = {"attn": {"kernel": jnp.ones((8, 16))}, "mlp": {"kernel": jnp.ones((8, 16))}}
    >>> specs_from_rules(params, [("attn/kernel", P(None, "tensor")), ("kernel", P("fsdp"))], mesh)
    {'attn': {'kernel': P(None, 'tensor')}, 'mlp': {'kernel': P('fsdp',)}}
    """
    compiled = compile_rules(rules, "specs_from_rules")
    logical = logical_axis_rules if logical_axis_rules is not None else nn.get_logical_axis_rules()
    used: set[int] = set()
    paths: list[str] = []

    def leaf_spec(key_path, leaf):
        path = path_of(key_path)
        paths.append(path)
        names = tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else None
        value = leaf.value if _is_box(leaf) else leaf
        spec, index = spec_for(path, tuple(value.shape), compiled, mesh.shape, default, names, logical)
        if index is not None:
            used.add(index)
        return spec

    specs = jax.tree_util.tree_map_with_path(leaf_spec, tree, is_leaf=_is_box)
    warn_unmatched(compiled, used, paths, "specs_from_rules")
    return specs


def named_shardings(specs: PyTree, mesh) -> PyTree:
    """``NamedSharding(mesh, spec)`` for every spec: the ``out_shardings`` of ``jax.jit``.

    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> named_shardings({"w": P("fsdp")}, make_mesh({"fsdp": 8}))["w"].spec
    P('fsdp',)
    """
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )

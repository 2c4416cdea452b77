"""Partition rules: ``(pattern, spec)`` pairs that say how each parameter is laid out.

A parameter's *path* is its keys joined by ``/``, as in
``"encoder/layers_3/attn/query/kernel"`` (under ``nn.scan`` the stacked
parameters keep the scan's name, e.g. ``"blocks/mlp/wi/kernel"``, with the
layer dim first). ``pattern`` is a regular expression searched in the path
(``re.search``: anchor it with ``^``/``$`` to match whole paths); ``spec`` is
a ``PartitionSpec`` (or tuple) naming, per dim, the mesh axis or axes that
split it. The first rule that matches wins; unmatched leaves get ``default``. This is
the library's one rule grammar: ``shard_by_rules``'s storage rules and tp rules and
``specs_from_rules`` all search their patterns in the same full path.

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from flax.core.spmd import get_logical_axis_rules
from jax.sharding import PartitionSpec

from ._layout import check_fit
from ._tree import named_shardings as named_shardings
from ._tree import path_of as path_of
from ._types import PyTree, is_box, logical_names
from .errors import RuleError, UnmatchedRuleWarning, warn

__all__ = [
    "REPLICATED",
    "Rules",
    "as_spec",
    "compile_rules",
    "logical_spec",
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
    if isinstance(rules, str):
        raise RuleError(
            f"{caller}: rules {rules!r} is a string; give a list of (pattern, spec) pairs, e.g. "
            f"[({rules!r}, P(None, 'fsdp'))]."
        )
    compiled = []
    for rule in rules:
        pattern, regex, spec = split_rule(
            rule, caller, "(pattern, spec) pair, e.g. ('kernel$', P(None, 'fsdp'))"
        )
        compiled.append(CompiledRule(pattern, regex, as_spec(spec, caller, f"rule {pattern!r} ->")))
    return tuple(compiled)


def as_spec(value, caller: str, what: str) -> PartitionSpec:
    """``value`` as a ``PartitionSpec`` (a spec, or a tuple of per-dim entries). A bare string
    is refused: it would be read as one axis name per character.

    >>> as_spec(("fsdp", None), "rules", "default=")
    P('fsdp', None)
    >>> as_spec("fsdp", "shard_by_rules", "default=")
    Traceback (most recent call last):
    ...
    fsdp_tp.errors.RuleError: shard_by_rules: default= 'fsdp' is a string, not a spec; write P('fsdp') ...
    """
    if isinstance(value, str):
        raise RuleError(
            f"{caller}: {what} {value!r} is a string, not a spec; write P({value!r}) to split dim 0 "
            f"over mesh axis {value!r}, or P() to keep the array whole."
        )
    if not isinstance(value, PartitionSpec | tuple):
        raise RuleError(f"{caller}: {what} {value!r}: give a PartitionSpec or a tuple of axis names.")
    return PartitionSpec(*value)


def split_rule(rule, caller: str, expected: str) -> tuple[str, re.Pattern, Any]:
    """``(pattern, compiled pattern, value)`` of a ``(pattern, value)`` rule, or a clear RuleError."""
    if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
        raise RuleError(f"{caller}: rule {rule!r} is not a {expected}.")
    try:
        return rule[0], re.compile(rule[0]), rule[1]
    except re.error as err:
        raise RuleError(
            f"{caller}: rule pattern {rule[0]!r} is not a regular expression: {err}. Fix the pattern, or "
            f"match its text literally: ({re.escape(rule[0])!r}, ...)."
        ) from None


def logical_spec(names: Sequence, logical_axis_rules: Sequence | None = None) -> PartitionSpec:
    """The spec of an array whose dims carry logical ``names``, by ``(logical, mesh axes)``
    rules in order of precedence (``None``: the rules active in flax's context): each named
    dim takes the first rule naming it whose mesh axes no other dim holds; a dim no rule
    places stays whole. Flax's own semantics (``nn.logical_to_mesh_axes``), in the core so
    every front end maps its logical names alike (a property test holds them equal).

    >>> logical_spec(("batch", "length", "heads", "features"),
    ...              [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")])
    P('X', None, 'Y', None)
    """
    rules = get_logical_axis_rules() if logical_axis_rules is None else logical_axis_rules
    if not isinstance(rules, tuple | list):
        raise RuleError(f"logical_axis_rules must be a sequence of (logical name, mesh axes), got {rules!r}.")
    names = tuple(names)
    repeated = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if repeated:
        raise RuleError(f"logical names {names}: {repeated} name more than one dim; name each dim once.")
    unset = object()
    out: list = [unset if isinstance(n, str) else n for n in names]

    def held(entry) -> set:
        return {a for a in jax.tree.leaves(entry) if a is not None and a is not PartitionSpec.UNCONSTRAINED}

    for logical, mesh_axes in rules:
        if logical in names and out[names.index(logical)] is unset:
            taken = set().union(*(held(e) for e in out if e is not unset))
            if not held(mesh_axes) & taken:
                out[names.index(logical)] = mesh_axes
    return PartitionSpec(*(None if e is unset else e for e in out))


def spec_for(
    path: str,
    shape: tuple[int, ...],
    rules: Sequence[CompiledRule],
    axis_sizes: Mapping,
    default: PartitionSpec = REPLICATED,
    logical_names: tuple | None = None,
    logical_axis_rules=None,
    check: bool = True,
) -> tuple[PartitionSpec, int | None]:
    """The spec of one parameter and the index of the rule that gave it (None: not a rule);
    checked against ``shape`` and ``axis_sizes`` unless ``check=False`` (callers that check
    many leaves at once, to report every failing one).

    >>> rules = compile_rules([("attn/.*kernel$", (None, "tensor")), ("kernel$", ("fsdp",))])
    >>> spec_for("layer/attn/query/kernel", (8, 16), rules, {"fsdp": 2, "tensor": 4})
    (P(None, 'tensor'), 0)
    >>> spec_for("layer/mlp/kernel", (8, 16), rules, {"fsdp": 2, "tensor": 4})
    (P('fsdp',), 1)
    """
    index = next((i for i, rule in enumerate(rules) if rule.regex.search(path)), None)
    if index is not None:
        spec = rules[index].spec
    elif logical_names is not None:
        spec = logical_spec(logical_names, logical_axis_rules)
    else:
        spec = default
    if check:
        check_fit([(path, shape, spec)], axis_sizes, "change the rule")
    return spec, index


def unmatched_warning(
    rules: Sequence[CompiledRule], used: set[int], paths: Sequence[str], caller: str
) -> UnmatchedRuleWarning | None:
    """The warning that lists every rule that matched no parameter (a typo's usual symptom)."""
    unused = [rule.pattern for index, rule in enumerate(rules) if index not in used]
    if not unused:
        return None
    sample = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
    return UnmatchedRuleWarning(
        f"{caller}: rules matching no parameter: {unused}; parameter paths look like: {sample}. "
        f"Fix the patterns or drop those rules."
    )


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
    default = as_spec(default, "specs_from_rules", "default=")
    logical = logical_axis_rules if logical_axis_rules is not None else get_logical_axis_rules()
    used: set[int] = set()

    def leaf_spec(key_path, leaf):
        path = path_of(key_path)
        names = logical_names(leaf)
        value = leaf.value if is_box(leaf) else leaf
        spec, index = spec_for(path, value.shape, compiled, mesh.shape, default, names, logical, check=False)
        if index is not None:
            used.add(index)
        checks.append((path, tuple(value.shape), spec))
        return spec

    checks: list[tuple] = []
    specs = jax.tree_util.tree_map_with_path(leaf_spec, tree, is_leaf=is_box)
    check_fit(checks, mesh.shape, "change the rule")  # every leaf that does not fit, at once
    if warning := unmatched_warning(compiled, used, [c[0] for c in checks], "specs_from_rules"):
        warn(warning)
    return specs

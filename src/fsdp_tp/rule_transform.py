"""``shard_by_rules``: a module transform that lays parameters out by partition rules.

Init keeps each device's block of every parameter as its rule (or its flax
logical names) says; every call all-gathers the blocks for compute, and the
backward pass reduce-scatters the mean gradient, per axis — FSDP with a layout
the user chooses, over any mesh axes, with no collectives to write. Axes that
the model's own tensor-parallel layers split (their ``nn.Partitioned`` names)
are left to those layers.
"""

from __future__ import annotations

import contextvars
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

from ._axes import as_axis_tuple, axes_named, bound_axis_names, entry_axes, local_slice
from ._types import AxisNames, PyTree
from .collectives import gather_array_with_mean_grads, gather_from_axis
from .errors import RuleError
from .fsdp import _gather_leaf, input_varying, keep_module_name, map_params, module_path
from .rules import REPLICATED, CompiledRule, Rules, compile_rules, path_of, spec_for, warn_unmatched

__all__ = ["shard_by_rules"]

_warned: set[tuple] = set()


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned | nn.LogicallyPartitioned)


def _block(value: jax.Array, spec: PartitionSpec) -> jax.Array:
    """This device's block of ``value`` under ``spec`` (a dim over several axes: major first)."""
    for dim, entry in enumerate(spec):
        if entry_axes(entry):
            value = local_slice(value, dim, entry)
    return value


def _merge(path: str, names: tuple, spec: PartitionSpec) -> tuple:
    """The box names after splitting by ``spec`` a value some layer already split as ``names``."""
    merged = list(names)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        if names[dim] is not None:
            raise RuleError(
                f"{path}: the rule splits dim {dim} over {entry!r}, but its layer already splits that dim "
                f"over {names[dim]!r}; give that dim None in the rule."
            )
        if twice := set(entry_axes(entry)) & axes_named(names):
            raise RuleError(
                f"{path}: the rule uses mesh axis {sorted(twice, key=str)[0]!r}, which its layer already "
                f"splits another dim over (names {names}); an axis can split one dim of a parameter."
            )
        merged[dim] = entry
    return tuple(merged)


def _shard(params: PyTree, rules: tuple[CompiledRule, ...], default, logical) -> PyTree:
    sizes = {axis: jax.lax.axis_size(axis) for axis in bound_axis_names()}
    prefix = module_path()
    used: set[int] = set()
    paths: list[str] = []

    def leaf_fn(key_path, leaf):
        path = "/".join(p for p in (prefix, path_of(key_path).removeprefix("params/")) if p)
        paths.append(path)
        value = leaf.value if _is_box(leaf) else leaf
        logical_names = tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else None
        names = tuple(leaf.names) if type(leaf) is nn.Partitioned else (None,) * np.ndim(value)
        spec, index = spec_for(path, np.shape(value), rules, sizes, default, logical_names, logical)
        if index is not None:
            used.add(index)
        # Dims the layer split are already local: check divisibility on the others only.
        merged = _merge(path, names, spec)
        value = _block(value, spec)
        return nn.Partitioned(value, merged) if any(n is not None for n in merged) else value

    out = jax.tree_util.tree_map_with_path(leaf_fn, params, is_leaf=_is_box)
    key = (id(rules), tuple(sorted(set(range(len(rules))) - used)))
    # No parameters: an apply (nothing is created), where no rule can match anything.
    if paths and key not in _warned:
        _warned.add(key)
        warn_unmatched(rules, used, paths, "shard_by_rules")
    return out


def _gather(params: PyTree, axes: frozenset, batch_axes: frozenset) -> PyTree:
    vary = input_varying()

    def leaf_fn(leaf):
        if not isinstance(leaf, nn.Partitioned):
            return leaf
        # Minor axes of a dim first, so each gather joins contiguous blocks.
        order = [a for entry in leaf.names for a in reversed(entry_axes(entry)) if a in axes]
        for axis in order:
            # Over a batch axis every device's gradient is a part of the mean (reduce-scatter
            # it, / N); over any other axis all devices computed the same one (slice it).
            gather = gather_array_with_mean_grads if axis in batch_axes else gather_from_axis
            leaf = _gather_leaf(leaf, axis, vary, gather)
        return leaf

    return jax.tree.map(leaf_fn, params, is_leaf=_is_box)


def _rule_axes(rules: tuple[CompiledRule, ...], default: PartitionSpec, logical) -> frozenset:
    specs = [rule.spec for rule in rules] + [default]
    axes = {axis for spec in specs for entry in spec for axis in entry_axes(entry)}
    for _, target in logical:
        axes |= set(entry_axes(target))
    return frozenset(axes)


def shard_by_rules(
    target,
    rules: Rules = (),
    default: PartitionSpec = REPLICATED,
    logical_axis_rules=None,
    batch_axes: AxisNames = ("data", "fsdp"),
):
    """Wraps a Flax module class so its parameters are stored as ``rules`` lay them out.

    ``rules``: ``(pattern, spec)`` pairs over parameter paths (see
    :mod:`fsdp_tp.rules`), first match wins; ``default`` for unmatched
    leaves; leaves boxed by ``nn.with_logical_partitioning`` that no rule
    matches follow ``logical_axis_rules`` (default: flax's active
    ``nn.logical_axis_rules``). ``batch_axes``: the axes the batch is split
    over; a gather over one of them averages the gradient over it (FSDP), a
    gather over any other axis (``tensor``: every device there sees the same
    batch) slices it. Paths start at the wrapped module's own path,
    so wrapping the top-level model gives full paths, and then a rule that
    matched nothing is reported (:class:`~fsdp_tp.errors.UnmatchedRuleWarning`).

    The parameter tree, names and init are ``target``'s on every mesh.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(4, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> model = shard_by_rules(MLP, [("hidden/kernel", P("fsdp", None)), ("out/kernel", P("fsdp"))])()
    >>> _, specs = init_sharded(lambda r, x: model.init(r, x)["params"], mesh, (P(), P()),
    ...                         jax.random.key(0), jnp.ones((2, 8)))
    >>> specs["hidden"]["kernel"], specs["out"]["kernel"], specs["out"]["bias"]
    (P('fsdp', None), P('fsdp', None), P())
    """
    compiled = compile_rules(rules, "shard_by_rules")
    default = PartitionSpec(*default)
    batch = frozenset(as_axis_tuple(batch_axes))
    mapped = map_params(
        target,
        trans_in=lambda params: _gather(params, _rule_axes(compiled, default, _LOGICAL.get()), batch),
        trans_out=lambda params: _shard(params, compiled, default, _LOGICAL.get()),
    )

    class ByRules(mapped):  # type: ignore[valid-type, misc]
        @nn.nowrap
        def __call__(self, *args, **kwargs):
            token = _LOGICAL.set(
                logical_axis_rules if logical_axis_rules is not None else nn.get_logical_axis_rules()
            )
            try:
                # The module unboxes its logical params inside shard_map, where a sharding
                # constraint naming manual axes is an error: let the names map to nothing
                # there; the transform has read the rules and lays the params out itself.
                with nn.logical_axis_rules(()):
                    return super().__call__(*args, **kwargs)
            finally:
                _LOGICAL.reset(token)

    return keep_module_name(ByRules, target)


_LOGICAL: contextvars.ContextVar[Any] = contextvars.ContextVar("fsdp_tp_logical_rules", default=())

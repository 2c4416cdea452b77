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
from jax.sharding import PartitionSpec

from ._axes import as_axis_tuple, bound_axis_names, entry_axes
from ._gather import gather
from ._transform import (
    check_module_class,
    input_varying,
    keep_module_name,
    map_params,
    store,
    warn_once,
)
from ._types import AxisNames
from .precision import MixedPrecision, checked_policy
from .rules import REPLICATED, CompiledRule, Rules, compile_rules, spec_for, unmatched_warning

__all__ = ["shard_by_rules"]


def _by_rules(rules: tuple[CompiledRule, ...], default: PartitionSpec, logical):
    """The rules' layout choice; it records which rules matched, to report the others."""
    sizes = {axis: jax.lax.axis_size(axis) for axis in bound_axis_names()}
    used: set[int] = set()
    paths: list[str] = []

    def choose(path: str, shape: tuple, _names: tuple, logical_names) -> PartitionSpec:
        paths.append(path)
        spec, index = spec_for(path, shape, rules, sizes, default, logical_names, logical, check=False)
        if index is not None:
            used.add(index)
        return spec

    return choose, used, paths


def _store_by_rules(params, rules: tuple[CompiledRule, ...], default: PartitionSpec, logical):
    choose, used, paths = _by_rules(rules, default, logical)
    out = store(params, choose)
    # No parameters: an apply (nothing is created), where no rule can match anything.
    if paths and (warning := unmatched_warning(rules, used, paths, "shard_by_rules")):
        warn_once((id(rules), tuple(sorted(set(range(len(rules))) - used))), warning)
    return out


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
    mixed_precision: MixedPrecision | None = None,
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
    ``mixed_precision``: the dtypes the gathers over ``batch_axes`` and their gradients'
    reduce-scatters move (:class:`~fsdp_tp.precision.MixedPrecision`; default: as stored).

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
    check_module_class(target, "shard_by_rules")
    compiled = compile_rules(rules, "shard_by_rules")
    default = PartitionSpec(*default)
    batch = frozenset(as_axis_tuple(batch_axes))
    policy = checked_policy(mixed_precision, "shard_by_rules")
    mapped = map_params(
        target,
        trans_in=lambda params: gather(
            params,
            _rule_axes(compiled, default, _LOGICAL.get()),
            batch,
            input_varying(),
            policy,
            at_read=True,
        ),
        trans_out=lambda params: _store_by_rules(params, compiled, default, _LOGICAL.get()),
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

"""``shard_by_rules``: a module transform that lays parameters out by partition rules.

Init keeps each device's block of every parameter as its rule (or its flax
logical names) says; every call all-gathers the blocks for compute, and the
backward pass reduce-scatters the mean gradient, per axis — FSDP with a layout
the user chooses, over any mesh axes, with no collectives to write. Axes that
the model's own tensor-parallel layers split (their ``nn.Partitioned`` names)
are left to those layers.

:func:`shard_by_rules` checks its arguments into a frozen :class:`RulesTransform` (the compiled
rules, the precision policy, the axes, the plan-check memo) whose ``gather``, ``store`` and
``__call__`` the class it makes (:meth:`RulesTransform.module`) runs. ``tp_rules="auto"`` tries
each plan it finds on the same transform with the plan's roles (:meth:`RulesTransform.with_roles`),
not through :func:`shard_by_rules` again.

Long because the transform and its front door are one concept: the door's 60 lines are its
docstring and 0.1's positional order, the rest the transform they describe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from .._aliases import REMOVED_IN
from .._axes import bound_axis_names, entry_axes
from .._batch import DEFAULT_BATCH_AXES, checked_batch_axes, resolve_batch_axes
from .._check.plain import laid_out
from .._sequence_split import sequence_split
from .._types import AxisName, AxisNames
from ..errors import RuleError, warn
from ..precision import MixedPrecision, checked_policy
from ..rules import REPLICATED, CompiledRule, Rules, as_spec, compile_rules, spec_for, unmatched_warning
from ..tp._find.driver import AUTO_AXIS
from ..tp._front import (
    CompiledRole,
    RolePlan,
    axes_of,
    compile_tp_rules,
    require_no_tp_axis,
    spec_source,
    with_split,
)
from ._auto import AutoRules
from ._call import calling, current
from ._check import check_call
from ._gather import gather
from ._local_compute import Seen, local_compute
from ._transform import (
    check_module_class,
    input_varying,
    keep_module_name,
    map_params,
    store,
    warn_once,
)
from .tp_rules import LINEN

__all__ = ["RulesTransform", "shard_by_rules"]


@dataclasses.dataclass(frozen=True)
class RulesTransform:
    """One :func:`shard_by_rules` transform, checked and compiled: what every call of the
    class it makes reads. ``gather`` and ``store`` are its ``nn.map_variables`` transforms
    (the blocks gathered for compute; a new parameter's block kept as its rule says), and the
    class's ``__call__`` is this one's. Under ``tp_rules="auto"``, ``found`` finds the roles
    per call; the axes the roles split over are the call's (read off its ``Seen``). ``checked``
    is the memo of the plan checks made (fields, input shapes, axis sizes), the one field that
    grows."""

    target: type[nn.Module]
    rules: tuple[CompiledRule, ...]
    default: PartitionSpec
    logical_axis_rules: Any
    batch_names: tuple[AxisName, ...] | None
    policy: MixedPrecision | None
    tp: tuple[CompiledRole, ...]  # () under "auto": ``found`` gives each call's
    roles_over: frozenset[str]  # the axes the tp rules compute over (AUTO_AXIS under "auto")
    found: AutoRules | None = None
    checked: set = dataclasses.field(default_factory=set, compare=False, repr=False)

    @classmethod
    def of(cls, target, rules, default, logical_axis_rules, batch_axes, mixed_precision, tp_rules):
        """:func:`shard_by_rules`'s arguments checked (each refusal names the argument and the
        fix) and compiled."""
        check_module_class(target, "shard_by_rules")
        compiled = compile_rules(rules, "shard_by_rules")
        default = as_spec(default, "shard_by_rules", "default=")
        batch_names = checked_batch_axes(batch_axes, "shard_by_rules")
        policy = checked_policy(mixed_precision, "shard_by_rules")
        if _is_auto(tp_rules) and hasattr(target, "tp_plans"):
            raise RuleError(
                f"shard_by_rules: {target.__name__} has its own attribute tp_plans, where tp_rules='auto' "
                f"keeps the plans it finds; rename it, or pass the plan: tp_rules=find_tp_rules(...)."
            )
        whole = cls(target, compiled, default, logical_axis_rules, batch_names, policy, (), frozenset())
        return whole.with_roles(tp_rules)

    def with_roles(self, tp_rules) -> RulesTransform:
        """This transform with ``tp_rules`` (the user's, a found plan's, or ``"auto"``) checked
        and compiled: how ``"auto"`` tries a plan it found, with the storage as given."""
        auto = _is_auto(tp_rules)
        tp = () if auto else compile_tp_rules(tp_rules, "shard_by_rules")
        parts = [
            (f"tp rule {r.pattern!r}{' (within)' * bool(i)}", part)
            for r in tp
            for i, part in enumerate(r.role.parts())
        ]
        computes = {"tp_rules='auto'": AUTO_AXIS} if auto else {label: part.axis for label, part in parts}
        on_batch = {label for label, part in parts if part.on_batch_axis}
        _require_separate_axes(
            {k: a for k, a in computes.items() if k not in on_batch}, self.batch_names or DEFAULT_BATCH_AXES
        )
        found = AutoRules(self.target, lambda plan: self.with_roles(plan).module()) if auto else None
        return dataclasses.replace(
            self, tp=tp, roles_over=frozenset(computes.values()), found=found, checked=set()
        )

    def module(self) -> type[nn.Module]:
        """The class this transform makes: ``target``'s, its parameters gathered and stored
        by :meth:`gather` and :meth:`store`, its call this transform's."""
        mapped = map_params(
            self.target, trans_in=self.gather, trans_out=self.store, batch_axes=self.batch_axes
        )
        by = self

        class ByRules(mapped):  # type: ignore[valid-type, misc]
            @nn.nowrap
            def __call__(self, *args, **kwargs):
                return by(self, super().__call__, args, kwargs)

        if self.found is not None:  # the plan found for each tensor size met, as an NNX ShardedModel's
            ByRules.tp_plans = self.found.plans  # type: ignore[attr-defined]
        return keep_module_name(ByRules, self.target)

    def batch_axes(self) -> tuple:
        return resolve_batch_axes(self.batch_names, "shard_by_rules")

    def local_axes(self) -> frozenset[str]:
        """The axes this call's roles split over: a role's axis stays split, never gathered."""
        seen = current().seen
        return self.roles_over | axes_of(r.role for r in (seen.plan.rules if seen is not None else ()))

    def gather(self, params):
        """The blocks of ``params`` gathered for compute over the rules' axes (a role's stays split)."""
        local = self.local_axes()
        axes = _rule_axes(self.rules, self.default, current().logical) - local
        return gather(
            params, axes, self.batch_axes(), input_varying(), self.policy, at_read=True, local=local
        )

    def store(self, params):
        """``params`` (new ones: an init) stored as the rules lay them out; a rule that matched
        none of them is reported, once."""
        seen, logical = current().seen, current().logical
        sizes = {axis: jax.lax.axis_size(axis) for axis in bound_axis_names()}
        tp_axes, used, paths = self.local_axes(), set(), []

        def choose(path: str, shape: tuple, _names: tuple, logical_names) -> PartitionSpec:
            paths.append(path)
            spec, index = spec_for(
                path, shape, self.rules, sizes, self.default, logical_names, logical, check=False
            )
            if index is not None:
                used.add(index)
            source = spec_source(index, self.rules, logical_names is not None)
            if splits := seen.plan.splits.get(path):
                for split in splits:
                    spec = with_split(path, spec, len(shape), split, source)
                return spec
            require_no_tp_axis(path, spec, tp_axes, source)
            return spec

        out = store(params, choose)
        seen.params.extend(paths)
        # No parameters: an apply (nothing is created), where no rule can match anything.
        if paths and (warning := unmatched_warning(self.rules, used, paths, "shard_by_rules")):
            warn_once((id(self.rules), tuple(sorted(set(range(len(self.rules))) - used))), warning)
        return out

    def __call__(self, module: nn.Module, call: Callable, args: tuple, kwargs: dict):
        """``call(*args, **kwargs)``, the mapped module's call, with its tp roles: the rules' or
        those found for this call; an init checks every tp rule named a module, and the plan
        is checked against the unsharded model before anything trains."""
        tp = self.found(module, args, kwargs) if self.found is not None else self.tp
        seen = Seen(RolePlan(tp, LINEN))
        logical = self.logical_axis_rules
        logical = logical if logical is not None else nn.get_logical_axis_rules()
        with calling(logical=logical, seen=seen):
            # The module unboxes its logical params inside shard_map, where a sharding
            # constraint naming manual axes is an error: let the names map to nothing
            # there; the transform has read the rules and lays the params out itself.
            with nn.logical_axis_rules(()), local_compute(seen) if tp else contextlib.nullcontext():
                with laid_out():  # (checked here, after: no plain check of its modules' calls)
                    out = call(*args, **kwargs)
            if tp and seen.params:  # an init: every tp rule must have named a submodule
                seen.plan.require_all_matched(seen.params)
            if tp or sequence_split() is not None:  # before anything trains: the unsharded model's blocks
                check_call(module, self.target, args, kwargs, tp, self.checked)
            return out


def _rule_axes(rules: tuple[CompiledRule, ...], default: PartitionSpec, logical) -> frozenset:
    specs = [rule.spec for rule in rules] + [default]
    axes = {axis for spec in specs for entry in spec for axis in entry_axes(entry)}
    for _, target in logical:
        axes |= set(entry_axes(target))
    return frozenset(axes)


# What 0.1 took positionally after ``rules``, in its order: keyword-only now, as NNX's.
_ONCE_POSITIONAL = ("default", "logical_axis_rules", "batch_axes", "mixed_precision", "tp_rules")


def shard_by_rules(
    target,
    rules: Rules = (),
    *positional,
    default: PartitionSpec = REPLICATED,
    logical_axis_rules=None,
    batch_axes: AxisNames | None = None,
    mixed_precision: MixedPrecision | None = None,
    tp_rules=(),
):
    """Wraps a Flax module class so its parameters are stored as ``rules`` lay them out.
    Every argument after ``rules`` is keyword-only, as :func:`fsdp_tp.nnx.shard_by_rules`'s
    (given positionally, in 0.1's order, it still works, with a ``DeprecationWarning``).

    ``rules``: ``(pattern, spec)`` pairs over parameter paths (see
    :mod:`fsdp_tp.rules`), first match wins; ``default`` for unmatched
    leaves; leaves boxed by ``nn.with_logical_partitioning`` that no rule
    matches follow ``logical_axis_rules`` (default: flax's active
    ``nn.logical_axis_rules``). ``batch_axes``: the axes the batch is split
    over; a gather over one of them averages the gradient over it (FSDP), a
    gather over any other axis (``tensor``: every device there sees the same
    batch) slices it. Left out, they are the step's (:func:`~fsdp_tp.shard_step`'s
    ``batch_specs``), else those of ``("data", "fsdp")`` the mesh has; given, they must be
    the step's (a :class:`~fsdp_tp.errors.BatchAxesError` says when they are not). Paths
    start at the wrapped module's own path, so wrapping the top-level model gives full
    paths, and then a rule that matched nothing is reported (:class:`~fsdp_tp.errors.UnmatchedRuleWarning`).
    ``mixed_precision``: the dtypes the gathers over ``batch_axes`` and their gradients'
    reduce-scatters move (:class:`~fsdp_tp.precision.MixedPrecision`; default: as stored).
    ``tp_rules``: ``(pattern, role)`` pairs naming submodules (by path) that compute on their
    slices over a mesh axis, Megatron-style (:mod:`fsdp_tp.tp`): the role's split is
    added to the storage rule's layout, and that axis is never gathered. A
    :class:`~fsdp_tp.tp.auto.TPPlan` gives its rules; ``"auto"`` finds them over mesh axis
    ``tensor`` from what the model computes on the call's inputs (:func:`~fsdp_tp.linen.find_tp_rules`),
    the plan for each ``tensor`` size then readable as ``model.tp_plans[size]``.

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
    if positional:
        given = dict(
            default=default,
            logical_axis_rules=logical_axis_rules,
            batch_axes=batch_axes,
            mixed_precision=mixed_precision,
            tp_rules=tp_rules,
        )
        default, logical_axis_rules, batch_axes, mixed_precision, tp_rules = _by_name(positional, given)
    by = RulesTransform.of(target, rules, default, logical_axis_rules, batch_axes, mixed_precision, tp_rules)
    return by.module()


def _is_auto(tp_rules) -> bool:
    return isinstance(tp_rules, str) and tp_rules == "auto"


def _by_name(positional: tuple, given: dict) -> tuple:
    """The keyword arguments with ``positional`` (0.1's order after ``rules``) in their places,
    and a warning naming the call to write; a value given both ways is a ``TypeError``."""
    unset = {n: inspect.signature(shard_by_rules).parameters[n].default for n in _ONCE_POSITIONAL}
    if len(positional) > len(_ONCE_POSITIONAL):
        raise TypeError(
            f"shard_by_rules takes target and rules positionally, then {', '.join(_ONCE_POSITIONAL)} by "
            f"name; got {2 + len(positional)} positional arguments."
        )
    names = _ONCE_POSITIONAL[: len(positional)]
    if twice := [n for n in names if given[n] != unset[n]]:
        raise TypeError(f"shard_by_rules got {twice[0]}= positionally and by name: pass it once, by name.")
    warn(
        DeprecationWarning(
            f"fsdp_tp.shard_by_rules(target, rules, {', '.join(names)}) positionally is deprecated since "
            f"0.2.0 and goes in {REMOVED_IN}: write shard_by_rules(target, rules, "
            f"{', '.join(f'{n}=...' for n in names)}) (keyword-only after rules, as in "
            f"fsdp_tp.nnx.shard_by_rules)"
        )
    )
    return tuple((given | dict(zip(names, positional, strict=True)))[n] for n in _ONCE_POSITIONAL)


def _require_separate_axes(computes: dict[str, str], batch: tuple) -> None:
    """An axis tp rules compute over (``{which rule: its axis}``) holds slices the modules
    compute on: no batch axis. (A storage rule may name it only on the dim a role splits,
    where it agrees: ``with_split``.)"""
    for which, axis in computes.items():
        if axis in batch:
            raise RuleError(
                f"shard_by_rules: {which} computes over mesh axis {axis!r}, which "
                f"batch_axes also names; the tp axis holds slices the module computes on and is never "
                f"averaged. Split the batch over other axes (e.g. 'data', 'fsdp')."
            )

"""Where an NNX model's parameters live, for one set of tp rules: :class:`Placement`, and the
layouts ``tp_rules="auto"`` finds per tensor-axis size (:class:`Placements`).

The storage rules give each parameter a spec once (:class:`~fsdp_tp.nnx.ShardedModel`); the
tp rules' roles add their splits to it. Explicit rules give one layout, fixed when the model
is laid out, so a wrong rule is named before anything runs. ``"auto"`` traces the model's
call once, there, and finds the plan for the tensor axis's size where the size is known:
per device, under ``jax.shard_map`` (kv heads are kept whole, or attention left whole, by
that size), one plan per size.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax.sharding import PartitionSpec

from .._axes import axes_named, bound_axis_names
from ..errors import RuleError
from ..rules import logical_spec, spec_for
from ..tp._find.driver import FindCall, Sizes, find, warn_left_whole
from ..tp._front import compile_tp_rules, spec_source, with_split
from ..tp.auto import TPPlan
from ._layers import Path, path_text
from ._tp import role_plan
from ._traced import traced

__all__ = ["Placement", "Placements", "storage_specs"]


def _annotation(variable: nnx.Variable, logical_axis_rules) -> PartitionSpec | None:
    """The spec the model's own annotation gives (``nnx.with_partitioning`` / ``out_sharding``):
    logical names mapped by ``logical_axis_rules`` (or the Variable's ``sharding_rules``),
    else the names taken as mesh axes, as flax does."""
    names = variable.get_metadata("out_sharding", None)
    if names is None:
        return None
    names = tuple(names)
    rules = (
        logical_axis_rules
        if logical_axis_rules is not None
        else variable.get_metadata("sharding_rules", None)
    )
    return logical_spec(names, rules) if rules is not None else PartitionSpec(*names)


def storage_specs(params: list, rules, default, logical_axis_rules) -> tuple[dict[Path, tuple], set[int]]:
    """Each parameter's storage spec before any role's split, as ``(spec, ndim, where it came
    from)`` by path, and the indices of the storage rules that matched: the first matching
    rule's spec, else the model's own annotation, else ``default``."""
    storage: dict[Path, tuple] = {}
    used: set[int] = set()
    for path, variable in params:
        shape = variable.get_raw_value().shape
        names = _annotation(variable, logical_axis_rules)
        spec, index = spec_for(path_text(path), shape, rules, {}, default, None, None, check=False)
        if index is None and names is not None:
            spec = names
        if index is not None:
            used.add(index)
        storage[path] = (spec, len(shape), spec_source(index, rules, names is not None))
    return storage, used


class Placement:
    """``specs`` (parameter path -> its storage spec with its role's split), ``gathered`` (the
    axes each is gathered over where read: all its spec names but the one its role computes
    its slice over), ``roles`` (:class:`~fsdp_tp.tp._role_plan.RolePlan`) and ``first_split`` (the
    parameters a rule splits on their first dim, which ``nnx.scan`` cannot take as a layer
    dim: its error names them)."""

    def __init__(self, abstract: nnx.Module, storage: dict[Path, tuple], tp_rules: Any, caller: str):
        self.roles = role_plan(abstract, compile_tp_rules(tp_rules, caller), [path_text(p) for p in storage])
        self.specs: dict[Path, PartitionSpec] = {}
        for path, (spec, ndim, source) in storage.items():
            for split in self.roles.splits.get(path_text(path), ()):  # (others: gathered over any axis)
                spec = with_split(path_text(path), spec, ndim, split, source)
            self.specs[path] = spec
        axes = frozenset(a for spec in self.specs.values() for a in axes_named(spec))
        self.gathered = {
            path: axes - {axis for _, axis, _ in self.roles.splits.get(path_text(path), ())}
            for path in self.specs
        }
        self.first_split = tuple(
            path_text(p) for p, spec in self.specs.items() if len(spec) and axes_named(spec[:1])
        )


class Placements:
    """The layout of each tensor-axis size: the one of explicit ``tp_rules``, built here (a
    wrong rule is named before anything runs), or under ``"auto"`` the model's call traced
    here once on ``inputs``, and per size the plan found (:attr:`plans`) and its layout."""

    def __init__(
        self, abstract: nnx.Module, storage: dict[Path, tuple], tp_rules, inputs, caller: str, attempt=None
    ):
        self.auto = isinstance(tp_rules, str) and tp_rules == "auto"
        _check_inputs(self.auto, tp_rules, inputs, caller)
        self._abstract, self._storage, self._caller = abstract, storage, caller
        self._attempt = attempt  # (): the model initialized, merged and called on inputs=, here
        self.plans: dict[int | None, TPPlan] = {}
        self._layouts: dict = {}  # by (tensor size, expert size) under "auto"; None: the rules' one
        if self.auto:
            self._graph, self._layers = traced(abstract, tuple(inputs), {})
        else:
            self._layouts[None] = Placement(abstract, storage, tp_rules, caller)

    def __call__(self) -> Placement:
        """The layout for the bound tensor axis's size (``None`` where the mesh has none: the
        roles then name the missing axis at init); outside the step, the one found so far."""
        if not self.auto:
            return self._layouts[None]
        if not bound_axis_names():
            return self._outside()
        sizes = Sizes.here(f"{self._caller} with tp_rules='auto'")
        key = (sizes.size, sizes.expert_size)
        if key not in self._layouts:
            attempt = None if self._attempt is None else (lambda p, _: self._attempt_with(key, p))
            plan = find(FindCall(self._caller, lambda: (self._graph, self._layers), attempt), sizes)
            self.plans[sizes.size] = plan
            warn_left_whole(plan, sizes.size, self._caller, sizes.axis, sizes.expert_size)
            self._layouts[key] = Placement(self._abstract, self._storage, plan, self._caller)
        return self._layouts[key]

    def _attempt_with(self, key: tuple, plan: TPPlan) -> None:
        """The model under ``plan`` traced on ``inputs=``, which checks it (the layout for
        ``key`` is ``plan``'s while it runs)."""
        self._layouts[key] = Placement(self._abstract, self._storage, plan, self._caller)
        try:
            self._attempt(self._graph)  # (the unsharded call on inputs=, traced once, here)
        finally:
            del self._layouts[key]

    def _outside(self) -> Placement:
        if len(self._layouts) != 1:
            raise RuleError(
                f"{self._caller}: with tp_rules='auto' the layout is the plan found for the tensor "
                f"axis's size, known under the mesh; {len(self._layouts)} plans were found so far "
                f"(sizes {sorted(map(str, self._layouts))}). Read the specs fsdp_tp.init_sharded "
                f"returns, or the plan as .tp_plans[size]."
            )
        return next(iter(self._layouts.values()))


def _check_inputs(auto: bool, tp_rules, inputs, caller: str) -> None:
    """``inputs`` given exactly with ``"auto"``, as a tuple of the call's arguments."""
    if auto and inputs is None:
        raise RuleError(
            f"{caller}: tp_rules='auto' finds the plan from what the model computes on its inputs; "
            f"pass them: {caller}(make_model, ..., tp_rules='auto', inputs=(x,)) (the call's "
            f"positional arguments, arrays or jax.ShapeDtypeStruct)."
        )
    if inputs is not None and not auto and not tp_rules:
        raise RuleError(
            f"{caller}: inputs= is what the tp plan is found and checked on (at init), and there are "
            f"no tp_rules; it is unused. Drop it, or pass tp_rules."
        )
    if inputs is not None and not isinstance(inputs, tuple | list):
        raise RuleError(
            f"{caller}: the plan is found and checked on the call on inputs=, a tuple of its positional "
            f"arguments (arrays or jax.ShapeDtypeStruct); got {type(inputs).__name__}. Pass e.g. "
            f"inputs=(tokens,)."
        )

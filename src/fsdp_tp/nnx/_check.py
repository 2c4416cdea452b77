"""An NNX model's tp plan checked against what the model computes, before anything trains: the
core's :func:`~fsdp_tp._check.driver.check_plan` over one device's trace of the model's call under
the plan and the unsharded model's trace on the same inputs.

:meth:`~fsdp_tp.nnx.ShardedModel.merge` gives the model it builds a class whose call checks
first (:func:`checked_class`), once per input shapes and axis sizes: inside the step, where the
inputs and the sizes are known, and at init where ``inputs=`` gave the call's arguments. NNX
records no module in a trace, so both traces run on throwaway models whose modules' calls
name their paths (:func:`scoped`): the pairs and the errors say which module made what.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._check.driver import PlanCall, checking, own_trace
from .._check.driver import check_call as drive
from .._sequence_split import sequence_split
from .._tree import static_split
from ..tp._front import Graph, RolePlan, spelled
from ._swap import Swap
from ._traced import MARK, scoped
from ._traced import traced as traced_call

__all__ = ["PlanChecks", "check_call", "checked_class"]

_CALLER = "fsdp_tp.nnx.shard_by_rules"


def check_call(
    model: nnx.Module,
    reference: nnx.Module,
    plan: RolePlan,
    args: tuple,
    kwargs: dict,
    checked: set,
    where: str,
    traced: Graph | None = None,
) -> None:
    """Refuses (``RuleError``) ``plan`` where the merged ``model``'s call on ``args`` does not
    compute blocks of the unsharded ``reference``'s (abstract), once per input shapes and sizes
    (:func:`~fsdp_tp._check.driver.check_call`). ``traced``: the unsharded call on these inputs,
    where the caller has traced it."""
    if not checking() or (not plan.roles and sequence_split() is None):
        return  # (the check's own trace of the call, or nothing to check: nothing read)
    arrays, rebuild = static_split(args, kwargs)

    def unsharded(whole=None) -> Graph:
        if traced is not None and whole is None:
            return traced
        shaped = [jax.ShapeDtypeStruct(whole(a.shape) if whole else a.shape, a.dtype) for a in arrays]
        return _graph(reference, shaped, rebuild)

    # (on the inputs' shapes alone: a device's inputs vary over the batch axes under check_vma,
    # and the casts JAX puts between them and the whole parameters hide the matmuls from the finder)
    shapes = lambda: rebuild([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays])
    # (each rule once, as matched: a role's children say "(inside)")
    said = {f"({pattern!r}, {spelled(role)})": None for role, pattern, _ in plan.roles.values()}
    call = PlanCall(
        roles=tuple(role for role, _, _ in plan.roles.values()),
        written=f"the tp rules [{', '.join(said)}]",
        where=where,
        same=repr(([(a.shape, a.dtype) for a in arrays], rebuild([None] * len(arrays)))),
        local=lambda: _graph(model, arrays, rebuild),
        unsharded=unsharded,
        named=_named(plan),
        rules=plan.rules,
        # (a plan the finder made gives every einsum its letter: no hint to trace for)
        finder=(lambda: traced_call(reference, *shapes())) if traced is None else None,
    )
    drive(call, checked)


def _graph(model: nnx.Module, arrays: list, rebuild) -> Graph:
    """``model``'s call traced on a throwaway copy whose modules name their paths (the roles
    without rings: a ring calls a layer per chunk, the same numbers)."""
    graphdef, state = nnx.split(model)

    def call(state, values):
        call_args, call_kwargs = rebuild(values)
        return scoped(_streamed(nnx.merge(graphdef, state)))(*call_args, **call_kwargs)

    with own_trace():  # (no check of the check's own trace; roles without rings)
        return Graph.trace(call, state, arrays)


def _streamed(model: nnx.Module) -> nnx.Module:
    """``model`` (a throwaway copy) with a stand-in stream for each ``nnx.Dropout`` and dropping
    ``nnx.MultiHeadAttention`` that holds none: a model that takes its rngs at call time
    (``model(x, rngs=nnx.Rngs(dropout=key))``) is checked on ``inputs=``, which carry no call's
    rngs. The trace is abstract and the library draws each device's block of the unsharded mask
    from whatever key the call gives: only which key is stood in for, never what is computed."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Dropout) and getattr(node, "rngs", None) is None:
            object.__setattr__(node, "rngs", nnx.Rngs(**{node.rng_collection: 0}))
        elif isinstance(node, nnx.MultiHeadAttention) and node.dropout_rate and node.rngs is None:
            object.__setattr__(node, "rngs", nnx.Rngs(dropout=0).dropout)
    return model


def _named(plan: RolePlan):
    """A name stack of :func:`scoped` modules as the innermost module a rule names there and
    its role as written."""
    roles = {path: (role, pattern) for path, (role, pattern, _) in plan.roles.items()}

    def named(scope: str) -> tuple[str, str]:
        modules = [part[len(MARK) :] for part in scope.split("/") if part.startswith(MARK)]
        inner = modules[-1].replace(".", "/") if modules else ""  # (jnp.einsum scopes its equation)
        parts = inner.split("/")
        for end in range(len(parts), 0, -1):
            if (found := roles.get("/".join(parts[:end]))) is not None:
                role, pattern = found
                return "/".join(parts[:end]), f"{spelled(role)} (tp rule {pattern!r})"
        return inner, "the tp rules"

    return named


class PlanChecks:
    """A :class:`~fsdp_tp.nnx.ShardedModel`'s plan checks: called with the merged model and a
    call's arguments (the class :func:`checked_class` gives the model calls it first), and
    :meth:`attempt`, the plan checked on ``inputs=`` and ``kwargs``, the call's keyword
    arguments where they are known (``tp_rules="auto"`` fits its plan so, at init, under the
    mesh; ``find_tp_rules(size=)`` on an abstract mesh, with its call's keyword arguments)."""

    def __init__(self, sharded: Any, inputs: tuple | None, kwargs: dict | None = None):
        self.sharded, self.inputs, self.kwargs = sharded, inputs, dict(kwargs or {})
        self.reference: nnx.Module | None = None  # the unsharded model, abstract
        self.checked: set = set()  # (input shapes, axis sizes) whose plan the trace has checked

    def __call__(self, model: nnx.Module, args: tuple, kwargs: dict, traced: Graph | None = None) -> None:
        s = self.sharded
        if self.reference is None:
            params, rest = nnx.from_flat_state(s._params), nnx.from_flat_state(s._rest)
            self.reference = nnx.merge(s.graphdef, params, rest)
        check_call(model, self.reference, s._layouts().roles, args, kwargs, self.checked, _CALLER, traced)

    def at_init(self, params: dict, model_state: dict) -> None:
        """Explicit rules with ``inputs=``: the plan checked at init (per device, under the mesh)
        on the model merged from this device's blocks; ``"auto"`` checked its plan as it found it."""
        if self.inputs is None or self.sharded._layouts.auto or not self.sharded._layouts().roles.roles:
            return
        args = tuple(jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in self.inputs)
        self(self.sharded.merge(params, model_state), args, {})

    def attempt(self, traced: Graph | None = None) -> None:
        """The model initialized and merged, abstractly, here, and its plan checked on
        ``inputs=`` (``traced``: the unsharded call on them, where the caller has it)."""
        arrays, rebuild = static_split(tuple(self.inputs or ()), self.kwargs)

        def check(rng, values):
            model = self.sharded.merge(*self.sharded.init(rng))
            self(model, *rebuild(values), traced)  # (the check alone: no call of the model)

        jax.make_jaxpr(check)(jax.random.key(0), [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays])


@Swap.kind("plan check")
def checked_class(cls: type, check: Any) -> dict:
    """A model whose ``__call__`` first runs ``check(model, args, kwargs)``."""

    def __call__(self, *args, **kwargs):
        check(self, args, kwargs)
        return cls.__call__(self, *args, **kwargs)

    return {"__call__": __call__}

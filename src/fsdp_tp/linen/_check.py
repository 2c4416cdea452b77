"""A Linen model's tp plan checked against what the model computes, before anything trains:
the core's :func:`~fsdp_tp._check.driver.check_plan` over one device's trace of the model's call
under the plan and the unsharded model's trace on the same inputs.

:func:`check_call` runs where :func:`~fsdp_tp.shard_by_rules`'s model is first called with a plan
on inputs of a shape (its init, inside :func:`~fsdp_tp.init_sharded`): it traces, abstractly,
the call as each device computes it (the stored blocks, the roles' collectives) and, unless
the caller has it (``tp_rules="auto"`` traced it to find the plan), the unsharded model's init
computing its output. Once per model fields, input shapes and axis sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from .._check.driver import PlanCall, checking, own_trace
from .._check.driver import check_call as drive
from .._tree import static_split
from ..tp._front import CompiledRole, Graph, module_of, role_of, spelled
from ._call import calling, current
from ._traced import traced_on_shapes

__all__ = ["check_call", "fields_of", "reference_graph", "traced_as"]


def traced_as(graph: Graph) -> contextlib.AbstractContextManager[Any]:
    """Within, a plan check of a call on ``graph``'s inputs reads ``graph`` as the unsharded call."""
    return calling(traced=graph)


def fields_of(module: nn.Module, target: type) -> dict[str, Any]:
    """The fields ``module`` was built with, as ``target``'s constructor takes them."""
    return {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(target)
        if f.init and f.name not in ("parent", "name")
    }


def reference_graph(
    module: nn.Module, args: tuple, kwargs: dict, streams: dict, whole: Callable | None = None
) -> Graph:
    """The unsharded ``module``'s init computing its output on ``args`` (each array's shape
    through ``whole``, where given), read as a graph: its parameters are what the initializers
    make, its output what the model returns."""
    arrays, rebuild = static_split(args, kwargs)

    def init(values):
        call_args, call_kwargs = rebuild(values)
        out, variables = module.init_with_output(streams, *call_args, **call_kwargs)
        return out, variables.get("params", {})

    shaped = [jax.ShapeDtypeStruct(whole(a.shape) if whole else a.shape, a.dtype) for a in arrays]
    return Graph.trace_init(init, shaped)


def check_call(
    module: nn.Module,
    target: type,
    args: tuple,
    kwargs: dict,
    rules: tuple[CompiledRole, ...],
    checked: set,
    reference: Graph | None = None,
    where: str = "",
) -> None:
    """Refuses (``RuleError``) a plan under which ``module``'s call on ``args`` does not compute
    blocks of the unsharded ``target``'s, once per fields, input shapes and axis sizes
    (:func:`~fsdp_tp._check.driver.check_call`). ``reference``: the unsharded trace on these
    inputs, where the caller has it; ``where``: the caller a refusal names (else
    ``shard_by_rules(<target>)``)."""
    if not checking():
        return  # (the check's own trace of the call: not even its fields read)
    fields = fields_of(module, target)
    arrays, rebuild = static_split(args, kwargs)
    # (a dropout stream whether or not the call has one: an init may run without it)
    scope_rngs = module.scope.rngs if module.scope is not None else {}
    streams = {name: jax.random.key(0) for name in ("params", "dropout", *scope_rngs)}
    plain = target(**fields, parent=None)
    given = reference if reference is not None else current().traced

    def unsharded(whole=None) -> Graph:
        if given is not None and whole is None:
            return given
        return reference_graph(plain, args, kwargs, streams, whole)

    call = PlanCall(
        roles=tuple(r.role for r in rules),
        written=f"the tp rules [{', '.join(f'({r.pattern!r}, {spelled(r.role)})' for r in rules)}]",
        where=where or f"shard_by_rules({target.__name__})",
        same=repr((fields, [(a.shape, a.dtype) for a in arrays], rebuild([None] * len(arrays)))),
        local=lambda: _local_graph(module, fields, arrays, rebuild, streams),
        unsharded=unsharded,
        named=_named(rules),
        rules=rules,
        # (a plan the finder made gives every einsum its letter: no hint to trace for)
        finder=(lambda: traced_on_shapes(plain, args, kwargs)) if given is None else None,
    )
    drive(call, checked)


def _local_graph(module, fields, arrays, rebuild, streams) -> Graph:
    """One device's trace of the call under the plan: the blocks ``module`` stores, the roles
    (without rings: a ring calls a layer per chunk, the same numbers)."""
    sharded = type(module)(**fields, parent=None)
    rngs = {name: key for name, key in streams.items() if name != "params"}
    mutable = [name for name in module.variables if name != "params"]  # (batch statistics, sown values)

    def call(variables, values):
        call_args, call_kwargs = rebuild(values)
        return sharded.apply(variables, *call_args, rngs=rngs, mutable=mutable, **call_kwargs)[0]

    with own_trace():  # (no check of the check's own trace; roles without rings)
        return Graph.trace(call, module.variables, arrays)


def _named(rules: tuple[CompiledRole, ...]) -> Callable[[str], tuple[str, str]]:
    """A Linen name stack (``Model/attn/q/q``: the model, then module paths; a role's clone
    repeats its own name) as the module a rule names there and its role as written."""

    def named(scope: str) -> tuple[str, str]:
        parts = module_of(scope).split("/")[1:]
        for end in range(len(parts), 0, -1):
            path = "/".join(parts[:end])
            if (found := role_of(path, rules)) is not None:
                role, pattern, _ = found
                return path, f"{spelled(role)} (tp rule {pattern!r})"
        return "/".join(parts), "the tp rules"

    return named

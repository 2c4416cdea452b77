"""The Megatron plan of an NNX model, found from what it computes: :func:`find_tp_rules`.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up, self.down = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
...     def __call__(self, x):
...         return self.down(nnx.gelu(self.up(x)))
>>> print(find_tp_rules(MLP(nnx.Rngs(0)), jnp.ones((2, 8))))
tp_rules = [
    (r"^up$", ColumnParallel()),
    (r"^down$", RowParallel()),
]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from .._trace import trace_per_device
from ..errors import RuleError
from ..rules import REPLICATED
from ..tp._plan import calling, fitted, require_size
from ..tp.auto import Graph, TPPlan, find_plan
from ..tp.roles import Layer
from ._check import PlanChecks, scoped
from ._tp import NNX, layer_of, path_text

__all__ = ["find_tp_rules", "traced"]


def find_tp_rules(
    model: nnx.Module,
    *args: Any,
    axis: str = "tensor",
    size: int | None = None,
    outputs_split: bool = False,
    **kwargs: Any,
) -> TPPlan:
    """The tp rules Megatron's plan gives ``model`` (built, or abstract from
    ``nnx.eval_shape``) called on ``args`` (arrays or ``jax.ShapeDtypeStruct``; ``kwargs``
    passed to the call as well): traced once, abstractly, its ``nnx.Dropout`` and attention
    dropout off (the library draws each device's block of their masks, whatever the plan).
    ``size``, ``outputs_split`` and the result: as :func:`fsdp_tp.linen.find_tp_rules`'s (with
    ``size``, the plan is checked against a device's trace on an abstract mesh of that size, a
    region the check refuses left whole with its reason). Its ``rules`` go to
    :func:`fsdp_tp.nnx.shard_by_rules` as ``tp_rules=``."""
    if not isinstance(model, nnx.Module):
        cls = model if isinstance(model, type) else type(model)
        got = f"the class {cls.__name__}" if isinstance(model, type) else f"a {cls.__name__}"
        # (by its classes' modules: this front end imports no flax.linen)
        linen = any(c.__module__.startswith("flax.linen") for c in cls.__mro__)
        fix = (
            "a Linen module's plan is fsdp_tp.linen.find_tp_rules'"
            if linen
            else "build it (or nnx.eval_shape(lambda: Model(..., rngs=nnx.Rngs(0))) traces it abstractly)"
        )
        raise RuleError(
            f"fsdp_tp.nnx.find_tp_rules takes a built NNX model and its call's inputs; got {got}: {fix}."
        )
    require_size(size, f"fsdp_tp.nnx.find_tp_rules({type(model).__name__})")
    graph, layers = traced(model, args, kwargs)
    plan = find_plan(graph, layers, axis, size, outputs_split)
    if size is None:
        return plan
    from ._model import ShardedModel  # (the model's layout imports this module)

    graphdef, state = nnx.split(model)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v), v.dtype), state)
    # a constructor of the same model (any values: only shapes are traced)
    make = lambda rngs: nnx.merge(graphdef, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    mesh = AbstractMesh((size,), (axis,), axis_types=(AxisType.Auto,))

    def attempt(p: TPPlan) -> None:  # (stored whole but for the roles: the plan is what is checked)
        sharded = ShardedModel(make, [(r".", REPLICATED)], p.rules, REPLICATED, None, None)
        trace_per_device(lambda: PlanChecks(sharded, args).attempt(graph), mesh, (), ())

    return fitted(plan, attempt)


def traced(model: nnx.Module, args: tuple, kwargs: dict) -> tuple[Graph, dict[str, Layer]]:
    """``model``'s call on ``args`` read as a :class:`~fsdp_tp.tp.auto.Graph`, its parameters
    the inputs, and the layers a role could compute, by path: what a plan is found from."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    flat = {path_text(path): (path, variable) for path, variable in nnx.to_flat_state(params)}
    layers = {
        path_text(path): layer_of(node, path_text(path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and NNX.of(type(node)) is not None
    }

    def forward(values: dict, rest: nnx.State, args: tuple, kwargs: dict):
        state = nnx.from_flat_state([(flat[p][0], flat[p][1].replace(value)) for p, value in values.items()])
        built = scoped(nnx.merge(graphdef, state, rest))  # (named as the plan check's traces are)
        for _, node in nnx.iter_graph(built):
            if isinstance(node, nnx.Dropout | nnx.MultiHeadAttention):
                # The library draws each device's block of their masks (fsdp_tp.dropout): the
                # plan is the model's without them. Noise a model draws itself stays in.
                node.deterministic = True
        return built(*args, **kwargs)

    values = {p: variable.get_raw_value() for p, (_, variable) in flat.items()}
    with calling(type(model).__name__, args, kwargs):
        return Graph.trace(forward, values, rest, args, kwargs), layers

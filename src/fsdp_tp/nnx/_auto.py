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

from .._axes import TENSOR
from ..errors import RuleError
from ..rules import REPLICATED
from ..tp._find.driver import FindCall, Sizes, find
from ..tp._front import EXPERT
from ..tp.auto import TPPlan
from ._check import PlanChecks
from ._model import ShardedModel
from ._traced import traced

__all__ = ["find_tp_rules"]


def find_tp_rules(
    model: nnx.Module,
    *args: Any,
    axis: str = TENSOR,
    size: int | None = None,
    outputs_split: bool = False,
    expert_size: int | None = None,
    expert_axis: str = EXPERT,
    **kwargs: Any,
) -> TPPlan:
    """The tp rules Megatron's plan gives ``model`` (built, or abstract from
    ``nnx.eval_shape``) called on ``args`` (arrays or ``jax.ShapeDtypeStruct``; ``kwargs``
    passed to the call as well): traced once, abstractly, its ``nnx.Dropout`` and attention
    dropout off (the library draws each device's block of their masks, whatever the plan).
    ``size``, ``outputs_split`` and the result: as :func:`fsdp_tp.linen.find_tp_rules`'s (with
    ``size``, the plan is checked against a device's trace on an abstract mesh of that size, a
    region the check refuses left whole with its reason). ``expert_size``: a mixture's expert
    layers go on ``expert_axis`` of that size (:class:`~fsdp_tp.tp.ExpertParallel`, the
    bank's last layer sending the tokens back), as ``"auto"`` puts them where the mesh has an
    expert axis that splits the batch (with ``expert_size`` alone, the plan is the experts'). Its
    ``rules`` go to
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
    caller = f"fsdp_tp.nnx.find_tp_rules({type(model).__name__})"
    graphdef, state = nnx.split(model)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v), v.dtype), state)
    # a constructor of the same model (any values: only shapes are traced)
    make = lambda rngs: nnx.merge(graphdef, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

    def attempt(plan: TPPlan, graph) -> None:  # (stored whole but for the roles: the plan is checked)
        sharded = ShardedModel(make, [(r".", REPLICATED)], plan.rules, REPLICATED, None, None)
        PlanChecks(sharded, args, kwargs).attempt(graph)

    call = FindCall(caller, lambda: traced(model, args, kwargs), attempt)
    return find(call, Sizes(axis, size, expert_axis, expert_size), outputs_split)

"""The Megatron plan of a Linen model, found from what it computes (:func:`find_tp_rules`; per
call for ``tp_rules="auto"``: :class:`~fsdp_tp.linen._auto.AutoRules`). For an axis size, the plan is
checked against what each device computes (:mod:`fsdp_tp._check.driver`): a region the check refuses
(attention that regroups a device's features by its own head count) is left whole, with the
check's reason.

>>> import jax.numpy as jnp, flax.linen as nn
>>> class MLP(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(8, name="down")(nn.gelu(nn.Dense(32, name="up")(x)))
>>> print(find_tp_rules(MLP(), jnp.ones((2, 8))))
tp_rules = [
    (r"^up$", ColumnParallel()),
    (r"^down$", RowParallel()),
]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn

from .._axes import TENSOR
from ..errors import RuleError
from ..tp._find.driver import FindCall, Sizes, find
from ..tp._front import EXPERT
from ..tp.auto import TPPlan
from ._auto import attempt_of
from ._check import fields_of
from ._traced import traced
from .rule_transform import shard_by_rules

__all__ = ["find_tp_rules"]


def find_tp_rules(
    module: nn.Module,
    *args: Any,
    axis: str = TENSOR,
    size: int | None = None,
    outputs_split: bool = False,
    expert_size: int | None = None,
    expert_axis: str = EXPERT,
    rngs: Sequence[str] = ("dropout",),
    **kwargs: Any,
) -> TPPlan:
    """The tp rules Megatron's plan gives ``module`` called on ``args`` (arrays or
    ``jax.ShapeDtypeStruct``; ``kwargs`` passed to the call as well): traced once,
    abstractly, its ``nn.Dropout`` off (the library draws each device's block of a dropout
    mask, whatever the plan). ``size``: the ``axis`` size the plan is for (a layer whose sizes
    it does not divide is left whole, or keeps its kv heads whole; the plan is then checked
    against a device's trace on an abstract mesh of that size, and a region the check refuses
    is left whole with its reason); ``outputs_split``: the model's output may leave split on its
    last dim (logits for :func:`fsdp_tp.vocab_parallel_cross_entropy`); ``rngs``: the rng
    streams the model draws from besides ``params``; ``expert_size``: a mixture's expert layers
    go on ``expert_axis`` of that size (:class:`~fsdp_tp.tp.ExpertParallel`, the bank's last
    layer sending the tokens back), as ``"auto"`` puts them where the mesh has an expert axis
    that splits the batch (with ``expert_size`` alone, the plan is the experts').
    Returns a :class:`~fsdp_tp.tp.auto.TPPlan`:
    its ``rules`` go to :func:`fsdp_tp.shard_by_rules` as ``tp_rules=``, and ``print(plan)``
    shows them, and the layers left whole with the reason."""
    if not isinstance(module, nn.Module):
        got = f"the class {module.__name__}" if isinstance(module, type) else f"a {type(module).__name__}"
        fix = (
            "build it: find_tp_rules(Model(...), x)"
            if isinstance(module, type)
            else "an NNX model's plan is fsdp_tp.nnx.find_tp_rules'"
        )
        raise RuleError(
            f"fsdp_tp.linen.find_tp_rules takes a Linen module and its call's inputs; got {got}: {fix}."
        )
    make = lambda rules: shard_by_rules(type(module), tp_rules=rules)
    attempt = attempt_of(make, fields_of(module, type(module)), args, kwargs, rngs)
    trace = lambda: traced(module, args, kwargs, rngs)
    call = FindCall(f"find_tp_rules({type(module).__name__})", trace, attempt)
    return find(call, Sizes(axis, size, expert_axis, expert_size), outputs_split)

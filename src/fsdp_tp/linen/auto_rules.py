"""The Megatron plan of a Linen model, found from what it computes: :func:`find_tp_rules`.

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
import jax

from .._tree import module_path
from ..tp.auto import Graph, TPPlan, find_plan
from ..tp.roles import Layer
from .tp_rules import LINEN, layer_of

__all__ = ["find_tp_rules"]


def find_tp_rules(
    module: nn.Module,
    *args: Any,
    axis: str = "tensor",
    size: int | None = None,
    outputs_split: bool = False,
    rngs: Sequence[str] = ("dropout",),
    **kwargs: Any,
) -> TPPlan:
    """The tp rules Megatron's plan gives ``module`` called on ``args`` (arrays or
    ``jax.ShapeDtypeStruct``; ``kwargs`` passed to the call as well): traced once,
    abstractly, its ``nn.Dropout`` off (the library draws each device's block of a dropout
    mask, whatever the plan). ``size``: the ``axis`` size the plan is for (a layer whose sizes
    it does not divide is left whole, or keeps its kv heads whole); ``outputs_split``: the
    model's output may leave split on its last dim (logits for
    :func:`fsdp_tp.vocab_parallel_cross_entropy`); ``rngs``: the rng streams the model draws
    from besides ``params``. Returns a :class:`~fsdp_tp.tp.auto.TPPlan`: its ``rules`` go to
    :func:`fsdp_tp.shard_by_rules` as ``tp_rules=``, and ``print(plan)`` shows them, and the
    layers left whole with the reason."""
    streams = {name: jax.random.key(0) for name in ("params", *rngs)}
    layers: dict[str, Layer] = {}

    def seen(next_fun, call_args, call_kwargs, context):
        found = context.module
        if isinstance(found, nn.Dropout) and context.method_name == "__call__":
            return call_args[0] if call_args else call_kwargs["inputs"]
        if context.method_name == "__call__" and LINEN.of(type(found)) is not None:
            path = module_path(found.path)
            if path not in layers:
                layers[path] = layer_of(found, call_args, call_kwargs)
        return next_fun(*call_args, **call_kwargs)

    def init(args, kwargs):  # the output and the parameters, from one trace
        out, variables = module.init_with_output(streams, *args, **kwargs)
        return out, variables["params"]

    with nn.intercept_methods(seen):
        graph = Graph.trace_init(init, args, kwargs)
    return find_plan(graph, layers, axis, size, outputs_split)

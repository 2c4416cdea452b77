"""The Megatron plan of a model found from what it computes, as the tp rules a user would
write (``tp_rules="auto"``, ``fsdp_tp.linen.find_tp_rules``, ``fsdp_tp.nnx.find_tp_rules``).

The model's forward is traced once, abstractly (:class:`~fsdp_tp._trace.graph.Graph`). Each
split a matmul's parameter could take (a kernel's output features or heads, an
embedding's rows) grows a region (:func:`~fsdp_tp.tp._find.regions.grow`): every value that
split reaches, until row layers sum it away. A region is taken when every parameter it
splits is one a role splits, on the dim that role splits (:data:`~fsdp_tp.tp.ROLES`);
then its modules get those roles. Nothing is guessed from a name: a layer no region takes
is left whole, with the reason.

>>> import jax, jax.numpy as jnp
>>> from fsdp_tp.tp import Layer
>>> def mlp(p, x):  # up -> gelu -> down, with the down layer's bias after its sum
...     return jax.nn.gelu(x @ p["up"]["kernel"]) @ p["down"]["kernel"] + p["down"]["bias"]
>>> params = {"up": {"kernel": jnp.ones((8, 32))}, "down": {"kernel": jnp.ones((32, 8)), "bias": jnp.ones(8)}}
>>> layers = {"up": Layer("dense", "up", features=(32,), in_size=8),
...           "down": Layer("dense", "down", features=(8,), in_size=32, use_bias=True)}
>>> plan = find_plan(Graph.trace(mlp, params, jnp.ones((2, 8))), layers)
>>> print(plan)
tp_rules = [
    (r"^up$", ColumnParallel()),
    (r"^down$", RowParallel()),
]
"""

from __future__ import annotations

from .._trace.graph import Graph
from ._find.finder import find_plan
from ._find.plan import TPPlan

# What a user calls: the plan of a traced function (the front ends' find_tp_rules trace a model)
__all__ = ["Graph", "TPPlan", "find_plan"]

"""Collectives with the gradients that sharded training needs.

Each op here is a ``jax.custom_vjp`` whose backward pass is chosen for the
strategy, not derived by JAX: the FSDP gather averages its cotangent over the
batch shards instead of summing it.
"""

from __future__ import annotations

import functools

import jax

from ._types import AxisName

__all__ = ["gather_array_with_mean_grads"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_mean_grads(x: jax.Array, axis: int, axis_name: AxisName) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _gather_fwd(x, axis, axis_name):
    return _gather_mean_grads(x, axis, axis_name), None


def _gather_bwd(axis, axis_name, _, cotangent):
    # Every device used the whole gathered array on its own batch shard; the
    # sum of their cotangents is N times the gradient of the mean loss.
    summed = jax.lax.psum_scatter(cotangent, axis_name, scatter_dimension=axis, tiled=True)
    return (summed / jax.lax.axis_size(axis_name),)


_gather_mean_grads.defvjp(_gather_fwd, _gather_bwd)


def gather_array_with_mean_grads(x: jax.Array, axis: int, axis_name: AxisName) -> jax.Array:
    """All-gathers ``x`` along dim ``axis`` over ``axis_name``; the gradient is the mean.

    Forward: ``all_gather(tiled=True)`` of the local shard. Backward:
    ``psum_scatter(tiled=True)`` of the cotangent divided by the axis size,
    so each device gets the batch-mean gradient of its own shard, and the
    wire carries a reduce-scatter, never a full all-reduce.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def loss(shard):
    ...     full = gather_array_with_mean_grads(shard, axis=0, axis_name="fsdp")
    ...     return (full ** 2).sum()
    >>> grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    >>> grad(jnp.arange(8.0)).tolist()  # d/dx of sum(x**2), averaged over 8 identical shards
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    """
    if not 0 <= axis < x.ndim:
        raise ValueError(
            f"gather_array_with_mean_grads: axis {axis} is out of range for an array of shape "
            f"{x.shape}; pass 0 <= axis < {x.ndim}."
        )
    return _gather_mean_grads(x, axis, axis_name)

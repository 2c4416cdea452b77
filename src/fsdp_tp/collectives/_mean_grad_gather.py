"""FSDP's all-gather of a parameter's shards, whose gradient is the mean over the batch shards
reduce-scattered back (:func:`gather_array_with_mean_grads`), in the dtype a mixed-precision
policy moves, or in 8 bits with scales (:func:`gather_scaled_with_mean_grads`). Re-exported by
:mod:`fsdp_tp.collectives`, where users meet them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._renamed import renamed_keywords
from .._types import AxisName
from ..precision import dequantized, quantized

__all__ = ["gather_array_with_mean_grads", "gather_scaled_with_mean_grads"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_mean_grads(x: jax.Array, dim: int, axis: AxisName, wire, reduce) -> jax.Array:
    return _gather_fwd(x, dim, axis, wire, reduce)[0]


def _gather_fwd(x, dim, axis, wire, reduce):
    # On the wire in ``wire``; back in x's dtype, holding the rounded values: the
    # cotangent then stays in x's dtype too, for the reduction to choose its own.
    gathered = jax.lax.all_gather(x.astype(wire or x.dtype), axis, axis=dim, tiled=True)
    return gathered.astype(x.dtype), None


def _gather_bwd(dim, axis, wire, reduce, _, cotangent):
    # Every device used the whole gathered array on its own batch shard; the
    # sum of their cotangents is N times the gradient of the mean loss.
    dtype = cotangent.dtype
    summed = jax.lax.psum_scatter(cotangent.astype(reduce or dtype), axis, scatter_dimension=dim, tiled=True)
    return (summed.astype(dtype) / jax.lax.axis_size(axis),)


_gather_mean_grads.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gather_scaled(x, scale, gathered_scale, dim: int, axis: AxisName, wire, reduce) -> jax.Array:
    return _gather_scaled_fwd(x, scale, gathered_scale, dim, axis, wire, reduce)[0]


def _gather_scaled_fwd(x, scale, gathered_scale, dim, axis, wire, reduce):
    # The bits cross as uint8: XLA:CPU widens an 8-bit float all-gather to f16, an integer
    # one it moves as is, so the wire is one byte an element on every backend.
    bits = jax.lax.bitcast_convert_type(quantized(x, scale, wire), jnp.uint8)
    gathered = jax.lax.all_gather(bits, axis, axis=dim, tiled=True)
    value = dequantized(jax.lax.bitcast_convert_type(gathered, wire), gathered_scale, x.dtype)
    return value, (scale, gathered_scale)


def _gather_scaled_bwd(dim, axis, wire, reduce, scales, cotangent):
    zeros = tuple(jnp.zeros_like(s) for s in scales)
    return (*_gather_bwd(dim, axis, wire, reduce, None, cotangent), *zeros)


_gather_scaled.defvjp(_gather_scaled_fwd, _gather_scaled_bwd)


@renamed_keywords("collectives.gather_scaled_with_mean_grads")
def gather_scaled_with_mean_grads(
    x: jax.Array,
    scale: jax.Array,
    gathered_scale: jax.Array,
    dim: int,
    axis: AxisName,
    gather_dtype,
    reduce_dtype=None,
) -> jax.Array:
    """:func:`gather_array_with_mean_grads` in 8 bits with scales: ``x / scale`` crosses the
    wire as one byte an element of ``gather_dtype`` (``float8_e4m3fn``, ``float8_e5m2``), and
    comes back as ``q * gathered_scale`` in ``x``'s dtype (the scales of the gathered rows:
    ``scale`` itself unless ``axis`` splits the rows); the gradient passes straight through to
    ``x``, reduce-scattered in ``reduce_dtype`` as the mean over ``axis``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def gather(shard):
    ...     half = jnp.float32(0.5)
    ...     return gather_scaled_with_mean_grads(shard, half, half, 0, "fsdp", jnp.float8_e4m3fn)
    >>> jax.shard_map(gather, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False)(
    ...     jnp.arange(8.0)).tolist()  # each value x / 0.5 is a float8 exactly
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    return _gather_scaled(x, scale, gathered_scale, dim, axis, jnp.dtype(gather_dtype), reduce_dtype)


@renamed_keywords("collectives.gather_array_with_mean_grads")
def gather_array_with_mean_grads(
    x: jax.Array, dim: int, axis: AxisName, gather_dtype=None, reduce_dtype=None
) -> jax.Array:
    """All-gathers ``x`` along dim ``dim`` over ``axis``; the gradient is the mean.

    Forward: ``all_gather(tiled=True)`` of the local shard. Backward:
    ``psum_scatter(tiled=True)`` of the cotangent divided by the axis size,
    so each device gets the batch-mean gradient of its own shard, and the
    wire carries a reduce-scatter, never a full all-reduce.

    ``gather_dtype`` / ``reduce_dtype`` (mixed precision,
    :class:`~fsdp_tp.precision.MixedPrecision`): the dtype the all-gather and the
    reduce-scatter move; the result and the gradient stay in ``x``'s dtype.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def loss(shard):
    ...     full = gather_array_with_mean_grads(shard, dim=0, axis="fsdp")
    ...     return (full ** 2).sum()
    >>> grad = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    >>> grad(jnp.arange(8.0)).tolist()  # d/dx of sum(x**2), averaged over 8 identical shards
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    """
    if not 0 <= dim < x.ndim:
        raise ValueError(
            f"gather_array_with_mean_grads: dim {dim} is out of range for an array of shape "
            f"{x.shape}; pass 0 <= dim < {x.ndim}."
        )
    return _gather_mean_grads(x, dim, axis, gather_dtype, reduce_dtype)

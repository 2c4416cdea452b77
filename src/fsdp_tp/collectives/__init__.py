"""Collectives with the gradients that sharded training needs.

Each op here is a ``jax.custom_vjp`` whose backward pass is chosen for the
strategy, not derived by JAX: the FSDP gather averages its cotangent over the
batch shards instead of summing it (:func:`gather_array_with_mean_grads`, defined in
:mod:`fsdp_tp.collectives._mean_grad_gather`), and Megatron's *f* and *g* sum where JAX would not.
"""

from __future__ import annotations

import functools

import jax

from .._axes import checks_vma, local_slice, varying_axes
from .._layout import axis_text, require_divisible
from .._renamed import renamed_keywords
from .._types import AxisName
from ._mean_grad_gather import gather_array_with_mean_grads, gather_scaled_with_mean_grads

__all__ = [
    "copy_to_axis",
    "gather_array_with_mean_grads",
    "gather_from_axis",
    "gather_scaled_with_mean_grads",
    "reduce_from_axis",
    "scatter_to_axis",
]


# Megatron's f and g, and the output gather of a column-parallel layer. Under
# check_vma=True JAX derives the right backward pass from the vma types (an
# invariant value meeting a varying one is pcast, whose transpose is psum), so
# the plain ops are used; with checking off a psum transposes to a psum and an
# all_gather to a psum_scatter, which would multiply gradients by the axis
# size, so each op gets an explicit backward pass.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _identity_psum_grad(x, axis):
    return x


_identity_psum_grad.defvjp(lambda x, a: (x, None), lambda a, _, g: (jax.lax.psum(g, a),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum_identity_grad(x, axis):
    return jax.lax.psum(x, axis)


_psum_identity_grad.defvjp(lambda x, a: (jax.lax.psum(x, a), None), lambda a, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_slice_grad(x, dim, axis):
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def _slice_bwd(dim, axis, _, g):
    return (local_slice(g, dim, axis),)


_gather_slice_grad.defvjp(lambda x, ax, a: (_gather_slice_grad(x, ax, a), None), _slice_bwd)


@renamed_keywords("collectives.copy_to_axis")
def copy_to_axis(x: jax.Array, axis: AxisName) -> jax.Array:
    """Identity forward, psum backward (Megatron's *f*): the input of a column-parallel layer.

    Every device on ``axis`` uses the same ``x`` with its own slice of a
    weight; the gradient of ``x`` is the sum of their contributions.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"tensor": 8})
    >>> grad = lambda x: jax.grad(lambda x: copy_to_axis(x, "tensor").sum())(x)
    >>> float(jax.shard_map(grad, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(1.0))
    8.0
    """
    if checks_vma(axis):
        return x if axis in varying_axes(x) else jax.lax.pcast(x, axis, to="varying")
    return _identity_psum_grad(x, axis)


@renamed_keywords("collectives.reduce_from_axis")
def reduce_from_axis(x: jax.Array, axis: AxisName) -> jax.Array:
    """Psum forward, identity backward (Megatron's *g*): the output of a row-parallel layer.

    ``x`` must hold this device's partial sum (device-varying); the result is
    the full sum, the same on every device of ``axis``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"tensor": 8})
    >>> total = lambda x: reduce_from_axis(x, "tensor")
    >>> jax.shard_map(total, mesh=mesh, in_specs=P("tensor"), out_specs=P())(jnp.arange(8.0))
    Array([28.], dtype=float32)
    """
    if checks_vma(axis):
        if axis not in varying_axes(x):
            raise ValueError(
                f"reduce_from_axis: the value is already the same on every device of {axis!r} "
                f"(invariant), so a psum would return {axis!r}-size times it. Pass the "
                f"per-device partial result."
            )
        return jax.lax.psum(x, axis)
    return _psum_identity_grad(x, axis)


@renamed_keywords("collectives.gather_from_axis")
def gather_from_axis(x: jax.Array, dim: int, axis: AxisName) -> jax.Array:
    """All-gathers ``x`` along dim ``dim`` into a value the same on every device; the
    gradient is this device's slice of the (identical) cotangent, not a sum.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"tensor": 8})
    >>> f = lambda x: jax.grad(lambda x: (gather_from_axis(x, 0, "tensor") * jnp.arange(8.0)).sum())(x)
    >>> jax.shard_map(f, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"))(jnp.ones(8)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    if checks_vma(axis):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True, to="invarying")
    return _gather_slice_grad(x, dim, axis)


def require_sequence_divisible(caller: str, length: int, dim: int, axis: AxisName) -> None:
    """Sequence parallelism splits dim ``dim`` over ``axis``: its length must divide."""
    require_divisible(
        caller,
        f"the sequence (dim {dim}, split in sequence-parallel mode)",
        length,
        axis_text(axis),
        jax.lax.axis_size(axis),
        "turn sequence parallelism off",
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _slice_gather_grad(x, dim, axis):
    return local_slice(x, dim, axis)


def _gather_cotangent(dim, axis, _, g):
    # Invariant in, varying out. Under check_vma=True JAX's own transpose (of the implied
    # pcast) would psum a zero-padded cotangent; an all-gather to an invariant moves 1/N
    # of that. With checking off the plain all-gather is the right transpose.
    to = "invarying" if checks_vma(axis) else "varying"
    return (jax.lax.all_gather(g, axis, axis=dim, tiled=True, to=to),)


_slice_gather_grad.defvjp(lambda x, ax, a: (local_slice(x, ax, a), None), _gather_cotangent)


@renamed_keywords("collectives.scatter_to_axis")
def scatter_to_axis(x: jax.Array, dim: int, axis: AxisName) -> jax.Array:
    """Keeps this device's slice of dim ``dim`` of a value that is the same on every device;
    the gradient is all-gathered (the inverse of :func:`gather_from_axis`). It enters a
    sequence-parallel region the way an embedding's reduce-scatter does.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"tensor": 8})
    >>> f = jax.shard_map(lambda x: scatter_to_axis(x, 0, "tensor"), mesh=mesh, in_specs=P(),
    ...                   out_specs=P("tensor"))
    >>> f(jnp.arange(8.0)).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    require_sequence_divisible("scatter_to_axis", x.shape[dim], dim, axis)
    return _slice_gather_grad(x, dim, axis)

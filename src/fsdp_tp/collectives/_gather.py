"""The gather every front end reads a stored block through: all-gathered for compute, with the
gradient that FSDP's backward pass wants.

:func:`gather_box` all-gathers a block (a flax ``Partitioned``: the block and the axes its
dims are split over) over the given axes, a dim's minor axis first. Over a batch axis the
backward pass reduce-scatters the mean gradient (every device's gradient is a part of the
batch mean); over any other axis it keeps this device's slice (every device there computed
the same one). Framework-free: the Linen front end calls it where a module reads a
parameter (``fsdp_tp.linen._gather``), the NNX front end where a Variable is read
(``fsdp_tp.nnx``).

>>> import jax, jax.numpy as jnp
>>> from flax.core.meta import Partitioned
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> mesh = make_mesh({"fsdp": 8})
>>> gather = lambda block: gather_box(Partitioned(block, ("fsdp",)), frozenset({"fsdp"}), frozenset({"fsdp"}))
>>> gathered = jax.shard_map(gather, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False)(
...     jnp.arange(16.0))
>>> gathered.shape, bool((gathered == jnp.arange(16.0)).all())   # each device held 2 of the 16
((16,), True)
"""

from __future__ import annotations

import jax
from flax.core.meta import Partitioned

from .._axes import entry_axes, entry_of, varying_axes
from .._types import AxisName
from ..precision import MixedPrecision
from . import gather_array_with_mean_grads, gather_from_axis, gather_scaled_with_mean_grads

__all__ = ["gather_box"]


def _gather_one(
    leaf: Partitioned, axis: AxisName, vary: frozenset, mean: bool, precision: MixedPrecision | None, scale
):
    names = tuple(leaf.names)
    dim = next(i for i, entry in enumerate(names) if axis in entry_axes(entry))
    axes = entry_axes(names[dim])
    # A dim split over (a, b) holds a contiguous block per (a, b) pair only when b is
    # gathered first; gathering a first would interleave blocks.
    if axes[-1] != axis:
        raise ValueError(
            f"gather: dim {dim} is split over {axes}; axis {axis!r} can only be gathered after "
            f"{axes[axes.index(axis) + 1 :]} (the minor axes first)."
        )
    rest = axes[:-1]
    shard = leaf.value
    if extra := tuple(sorted(vary - varying_axes(shard) - {axis}, key=str)):
        # Meet the inputs' vma on the shard, before the gather: JAX's transpose of this
        # pcast then psums the shard-sized gradient after the reduce-scatter, instead of
        # the full gradient before it.
        shard = jax.lax.pcast(shard, extra, to="varying")
    gathered_scale = scale
    if scale is not None and dim < shard.ndim - 1:  # a dim of rows: their own scales come along
        gathered_scale = jax.lax.all_gather(scale, axis, axis=dim, tiled=True)
    dtypes = precision.dtypes_for(shard.dtype) if precision is not None else (None, None)
    if mean and scale is not None:  # (8 bits: each row's scale, from before any gather)
        value = gather_scaled_with_mean_grads(shard, scale, gathered_scale, dim, axis, *dtypes)
    elif mean:
        value = gather_array_with_mean_grads(shard, dim, axis, *dtypes)
    else:  # the backward pass slices: nothing is reduced, so nothing to save in precision
        value = gather_from_axis(shard, dim, axis)
    new_names = (*names[:dim], entry_of(rest), *names[dim + 1 :])
    return (
        value if all(n is None for n in new_names) else leaf.replace(value=value, names=new_names)
    ), gathered_scale


def gather_box(
    leaf,
    axes: frozenset,
    batch_axes: frozenset,
    vary: frozenset = frozenset(),
    precision: MixedPrecision | None = None,
):
    """``leaf`` gathered over every axis of ``axes`` it is split over (minor first): the value
    when nothing stays split, else the box of what stays. A leaf that is no box is returned
    (rounded by ``precision``, a :class:`~fsdp_tp.precision.MixedPrecision`, if given).
    ``vary``: the axes the gathered value will meet device-varying data on (under
    ``check_vma=True``): the block is cast to vary over them before the gather, so the
    transpose psums a block-sized gradient, not a full one."""
    if not isinstance(leaf, Partitioned):
        return leaf if precision is None else precision.round(leaf)
    order = [a for entry in leaf.names for a in reversed(entry_axes(entry)) if a in axes]
    # An 8-bit policy scales each row (along the last dim) by its largest magnitude, as its
    # round does: the max over every axis that splits the last dim, gathered here or not.
    inner = tuple(a for entry in leaf.names[-1:] for a in entry_axes(entry))
    scale = precision.scale_of(leaf.value, inner) if precision is not None else None
    if precision is not None and not batch_axes & set(order):
        # Not gathered over a batch axis, so no gather rounds it: the model reads every
        # parameter rounded, on every mesh (whether a dim divides or not).
        leaf = leaf.replace(value=precision.round_block(leaf.value, scale))
    for axis in order:
        leaf, scale = _gather_one(leaf, axis, vary, axis in batch_axes, precision, scale)
    return leaf

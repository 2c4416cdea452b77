"""Fully sharded data parallelism as a Flax module transform.

At init every device computes the full parameter from the same rng and keeps
its slice (so the gathered init equals the unsharded init, bit for bit); for
compute, each slice is all-gathered, and the gradient comes back
reduce-scattered as the mean over the batch shards. The layout is automatic: the
largest dim the axis divides. The mechanism is the transform core's
(:mod:`fsdp_tp.linen._transform`); this module is its FSDP front door.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._axes import axes_named, require_axes
from .._layout import fsdp_dim, fsdp_entry
from .._renamed import renamed_keywords
from .._types import AxisName, AxisNames, PyTree
from ..errors import ReplicatedParameterWarning
from ..precision import MixedPrecision, checked_policy
from ._gather import gather
from ._transform import check_module_class, input_varying, map_params, store, warn_once

__all__ = ["gather_params", "shard_module_params", "shard_params"]


def _largest_dim(axis: AxisName, size: int, min_weight_size: int):
    """FSDP's layout choice: split the largest divisible dim of every leaf over ``min_weight_size``."""

    def choose(path: str, shape: tuple, names: tuple, _logical) -> PartitionSpec | None:
        if axis in axes_named(names) or int(np.prod(shape)) <= min_weight_size:
            return None
        dim = fsdp_dim(shape, names, size)
        if dim is None:
            warning = _replicated(path, shape, axis, size)
            warn_once((path, shape, axis, size), warning)
            return None
        return PartitionSpec(*(fsdp_entry(names, dim, axis) if i == dim else None for i in range(len(shape))))

    return choose


def _replicated(path: str, shape: tuple, axis: AxisName, size: int) -> Warning:
    """Why ``path`` stays replicated over ``axis``: no dim of its layer's block ``shape``
    is divisible by ``size`` (pad one)."""
    return ReplicatedParameterWarning(
        f"shard_params: parameter {path} of shape {shape} stays replicated over mesh axis {axis!r} "
        f"(size {size}) on every device: it has no dim divisible by {size}. Pad a dim to a multiple of "
        f"{size}, or raise min_weight_size above {int(np.prod(shape))} to keep it replicated without "
        f"this warning."
    )


@renamed_keywords("linen.fsdp.shard_params")
def shard_params(params: PyTree, axis: AxisName, min_weight_size: int = 2**18) -> PyTree:
    """Keeps this device's slice of every parameter larger than ``min_weight_size``.

    Call inside ``jax.shard_map``, on full parameters identical across ``axis``.
    Each large leaf becomes an ``nn.Partitioned`` local shard split along its
    largest unsplit dim that the axis size divides (where none does, a dim a layer
    splits whose block it divides: the dim then over the layer's axes, then this
    one); splits over other axes are kept. A leaf with no such dim stays replicated, and a
    :class:`~fsdp_tp.errors.ReplicatedParameterWarning` names it once.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def local_view(params):
    ...     shard = shard_params(params, "fsdp", min_weight_size=0)["w"]
    ...     return shard.value
    >>> f = jax.shard_map(local_view, mesh=mesh, in_specs=P(), out_specs=P("fsdp"))
    >>> w = jnp.arange(32.0).reshape(16, 2)   # dim 0 (16) is the largest divisible dim
    >>> f({"w": w})[2:4].tolist()             # device 1 holds rows 2 and 3
    [[4.0, 5.0], [6.0, 7.0]]
    """
    (axis,) = require_axes(axis, "shard_params")
    choice = _largest_dim(axis, jax.lax.axis_size(axis), min_weight_size)
    return store(params, choice, further=True)


@renamed_keywords("linen.fsdp.gather_params")
def gather_params(
    params: PyTree,
    axis: AxisName,
    vary_over: AxisNames = (),
    mixed_precision: MixedPrecision | None = None,
) -> PyTree:
    """All-gathers every leaf split over ``axis``; the inverse of :func:`shard_params`.

    Splits over other axes stay boxed, a leaf left with no split is unboxed.
    The backward pass reduce-scatters the mean gradient
    (:func:`~fsdp_tp.collectives.gather_array_with_mean_grads`).

    ``vary_over`` (used with ``check_vma=True``): the axes the gathered values
    will meet device-varying data on, e.g. ``"data"``. Naming them moves JAX's
    implicit gradient psum over those axes from the full gradient to the
    shard; :func:`shard_module_params` fills it from its inputs' types.
    ``mixed_precision``: the dtypes the gather and the gradient's reduce-scatter move
    (:class:`~fsdp_tp.precision.MixedPrecision`; default: as stored).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def roundtrip(params):
    ...     return gather_params(shard_params(params, "fsdp", min_weight_size=0), "fsdp")
    >>> w = jnp.arange(16.0).reshape(8, 2)
    >>> f = jax.shard_map(roundtrip, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    >>> bool((f({"w": w})["w"] == w).all())
    True
    """
    (axis,) = require_axes(axis, "gather_params")
    vary = frozenset(require_axes(vary_over, "gather_params") if vary_over else ())
    return gather(params, {axis}, {axis}, vary, checked_policy(mixed_precision, "gather_params"))


@renamed_keywords("shard_module_params")
def shard_module_params(
    target,
    axis: AxisName = "fsdp",
    min_weight_size: int = 2**18,
    mixed_precision: MixedPrecision | None = None,
):
    """Wraps a Flax module class so its parameters live sharded over ``axis``.

    The result is a module class with ``target``'s arguments and name, so the
    parameter tree (paths, global shapes, dtypes) and the init are those of
    ``target`` on every mesh.

    Init keeps each device's slice (:func:`shard_params`); every call gathers
    them for compute (:func:`gather_params`), in ``mixed_precision``'s dtypes if given.
    Composes with ``nn.remat`` and ``nn.scan``, and with itself for several axes.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> Dense = shard_module_params(nn.Dense, axis="fsdp", min_weight_size=0)
    >>> init = jax.shard_map(lambda x: Dense(16).init(jax.random.key(0), x), mesh=mesh,
    ...                      in_specs=P("fsdp"), out_specs=P(), check_vma=False)
    >>> local = jax.eval_shape(init, jnp.ones((8, 4)))["params"]
    >>> local["kernel"].value.shape, local["kernel"].names   # per device: 16 / 8 columns
    ((4, 2), (None, 'fsdp'))
    """
    check_module_class(target, "shard_module_params")
    policy = checked_policy(mixed_precision, "shard_module_params")
    return map_params(
        target,
        trans_in=lambda params: gather(params, {axis}, {axis}, input_varying(), policy, at_read=True),
        trans_out=lambda params: shard_params(params, axis, min_weight_size),
    )

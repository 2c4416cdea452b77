"""Averaging gradients over the batch axes, correct with and without vma checking."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from ._axes import axes_named, axis_size, checks_vma, require_axes, varying_axes
from ._types import AxisNames, PyTree

__all__ = ["sync_gradients"]


def _sync_leaf(leaf, axis_names: tuple, checking: bool):
    boxed = isinstance(leaf, nn.Partitioned)
    value, split = (leaf.value, axes_named(leaf.names)) if boxed else (leaf, set())
    # A leaf split over an axis got its mean from the gather's backward pass.
    axes = [name for name in axis_names if name not in split]
    if checking:
        # JAX already psummed the cotangent over every axis the value is
        # invariant on (transpose of the implicit pcast): divide, don't pmean.
        varying = varying_axes(value)
        summed = tuple(a for a in axes if a not in varying)
        axes = [a for a in axes if a in varying]
        if summed:
            value = value / axis_size(summed)
    if axes:
        value = jax.lax.pmean(value, tuple(axes))
    return leaf.replace(value=value) if boxed else value


def sync_gradients(grads: PyTree, axis_names: AxisNames) -> PyTree:
    """Makes every gradient the mean over the batch axes ``axis_names``.

    Call inside ``jax.shard_map`` on the gradients of the *per-device* loss
    (the mean over this device's batch shard), boxed as the parameters are.
    A leaf split over an axis (``nn.Partitioned`` names it) is left alone on
    that axis: the FSDP gather already reduce-scattered its mean. Otherwise:

    - ``check_vma=False``: the leaf holds this device's gradient; it is pmeaned.
    - ``check_vma=True``: JAX has already *summed* the gradient of a replicated
      parameter over the axes the parameter is invariant on, so those leaves
      are divided by the axis size; a blind pmean would leave them N times
      too large, silently. Leaves still varying over an axis are pmeaned.

    If your loss is already averaged across devices *inside* the
    differentiated function (a ``pmean`` before ``jax.grad``), its gradients
    are already synced: do not call this.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 8})
    >>> def grad_of_mean_loss(w, x):
    ...     g = jax.grad(lambda w: (w * x).mean())(w)   # per-device loss
    ...     return sync_gradients(g, "data")
    >>> for check in (True, False):
    ...     f = jax.shard_map(grad_of_mean_loss, mesh=mesh, in_specs=(P(), P("data")),
    ...                       out_specs=P(), check_vma=check)
    ...     print(f(jnp.float32(1.0), jnp.arange(8.0)))  # d/dw mean(w * x) = mean(x)
    3.5
    3.5
    """
    names = require_axes(axis_names, "sync_gradients")
    checking = checks_vma(names[0]) if names else False
    return jax.tree.map(
        functools.partial(_sync_leaf, axis_names=names, checking=checking),
        grads,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )

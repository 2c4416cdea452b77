"""Averaging gradients over the batch axes, correct with and without vma checking, and the
per-device losses that make a loss normalised by a global count (or summed) fit that mean."""

from __future__ import annotations

import functools

import jax
from flax.core.meta import Partitioned

from ._axes import axes_named, axis_size, checks_vma, require_axes, varying_axes
from ._batch import require_step_batch
from ._renamed import renamed_keywords
from ._types import AxisNames, PyTree

__all__ = ["batch_mean", "batch_total", "global_mean_loss", "global_sum_loss", "sync_gradients"]


def _varying_and_invariant(x: jax.Array, names: tuple, checking: bool) -> tuple[tuple, tuple]:
    """``names`` split into the axes ``x`` varies over and those it is invariant on, where a
    collective over an axis of the second kind is refused. With checking off nothing is
    known to be invariant: every axis counts as varying."""
    if not checking:
        return names, ()
    varying = varying_axes(x)
    return tuple(a for a in names if a in varying), tuple(a for a in names if a not in varying)


def _sync_leaf(leaf, axes: tuple, checking: bool):
    boxed = isinstance(leaf, Partitioned)
    value, split = (leaf.value, axes_named(leaf.names)) if boxed else (leaf, set())
    # A leaf split over an axis got its mean from the gather's backward pass.
    varying, summed = _varying_and_invariant(value, tuple(a for a in axes if a not in split), checking)
    if summed:
        # JAX already psummed the cotangent over every axis the value is
        # invariant on (transpose of the implicit pcast): divide, don't pmean.
        value = value / axis_size(summed)
    if varying:
        value = jax.lax.pmean(value, varying)
    return leaf.replace(value=value) if boxed else value


@renamed_keywords("sync_gradients")
def sync_gradients(grads: PyTree, axes: AxisNames) -> PyTree:
    """Makes every gradient the mean over the batch axes ``axes``.

    Call inside ``jax.shard_map`` on the gradients of the *per-device* loss
    (the mean over this device's batch shard), boxed as the parameters are.
    A leaf split over an axis (``Partitioned`` names it) is left alone on
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
    names = require_axes(axes, "sync_gradients")
    if not names:
        raise ValueError(
            "sync_gradients: axes is empty, so nothing would be averaged; pass the mesh axes "
            "the batch is split over, e.g. ('data', 'fsdp'), or skip the call when the batch is not split."
        )
    require_step_batch(names, "sync_gradients", "axes")
    checking = checks_vma(names[0])
    return jax.tree.map(
        functools.partial(_sync_leaf, axes=names, checking=checking),
        grads,
        is_leaf=lambda x: isinstance(x, Partitioned),
    )


@renamed_keywords("gradients.batch_total")
def batch_total(x: jax.Array, axes: AxisNames) -> jax.Array:
    """The sum over the devices of ``axes`` of each one's ``x`` (a count, say), the same
    on every device, in both ``check_vma`` modes: over an axis where ``x`` is already
    invariant (each device holds the same value) it is ``size * x``, where a ``psum`` would
    be refused under ``check_vma=True``."""
    names = require_axes(axes, "batch_total")
    over, same = _varying_and_invariant(x, names, bool(names) and checks_vma(names[0]))
    x = jax.lax.psum(x, over) if over else x
    return x * axis_size(same) if same else x


@renamed_keywords("gradients.batch_mean")
def batch_mean(tree: PyTree, axes: AxisNames) -> PyTree:
    """Every leaf of ``tree`` averaged over the devices of ``axes``, the same on every
    device, in both ``check_vma`` modes: state a model updates from its own shard of the
    batch (BatchNorm's ``batch_stats`` without an ``axis_name``, a running count), before
    it leaves the step replicated. Over an axis where a leaf is already invariant it is left
    as it is, where a ``pmean`` would be refused under ``check_vma=True``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 4, "fsdp": 2})
    >>> def stats(x):  # each device's mean of its rows, and a value invariant over fsdp
    ...     return batch_mean({"mean": x.mean(), "seen": jnp.float32(3.0)}, ("data", "fsdp"))
    >>> out = jax.shard_map(stats, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P())(jnp.arange(16.0))
    >>> float(out["mean"]), float(out["seen"])
    (7.5, 3.0)
    """
    names = require_axes(axes, "batch_mean")
    checking = bool(names) and checks_vma(names[0])

    def leaf_mean(x):
        over, _ = _varying_and_invariant(x, names, checking)
        return jax.lax.pmean(x, over) if over else x

    return jax.tree.map(leaf_mean, tree)


@renamed_keywords("gradients.global_mean_loss")
def global_mean_loss(local_sum: jax.Array, local_count: jax.Array, axes: AxisNames) -> jax.Array:
    """The per-device loss for a loss normalised by a count over the whole batch (the tokens
    that are not padding, say): ``local_sum`` sums this device's per-token losses,
    ``local_count`` counts them (it is not differentiated).

    Returns ``local_sum * D / total count`` (``D`` devices over ``axes``): its mean over
    the devices is the global loss, and :func:`sync_gradients` (and the FSDP gather's mean)
    of its gradient is the gradient of the global loss, however unevenly the devices count.
    A per-device mean ``local_sum / local_count`` would weight each device's tokens by
    ``1 / local_count`` instead.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 8})
    >>> def grad(w, x, mask):  # 1 + 2 + ... + 8 tokens on the 8 devices
    ...     loss = lambda w: global_mean_loss((w * x * mask).sum(), mask.sum(), "data")
    ...     return sync_gradients(jax.grad(loss)(w), "data")
    >>> x = jnp.repeat(jnp.arange(8.0), 8).reshape(8, 8)   # device d sees the value d
    >>> mask = (jnp.arange(8)[None, :] <= jnp.arange(8)[:, None]).astype(jnp.float32)
    >>> f = jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    >>> float(f(jnp.float32(1.0), x, mask)), float((x * mask).sum() / mask.sum())
    (4.666666507720947, 4.666666507720947)
    """
    names = require_axes(axes, "global_mean_loss")
    total = batch_total(jax.lax.stop_gradient(local_count).astype(local_sum.dtype), names)
    return local_sum * (axis_size(names) / total)


@renamed_keywords("gradients.global_sum_loss")
def global_sum_loss(local_sum: jax.Array, axes: AxisNames) -> jax.Array:
    """The per-device loss for a loss summed over the whole batch: ``local_sum * D``, whose
    mean over the ``D`` devices of ``axes`` is the global sum and whose synced gradient
    (:func:`sync_gradients`) is the global sum's gradient.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 8})
    >>> def grad(w, x):
    ...     return sync_gradients(jax.grad(lambda w: global_sum_loss((w * x).sum(), "data"))(w), "data")
    >>> f = jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    >>> float(f(jnp.float32(1.0), jnp.arange(8.0)))  # d/dw sum(w * x) = sum(x)
    28.0
    """
    return local_sum * axis_size(require_axes(axes, "global_sum_loss"))

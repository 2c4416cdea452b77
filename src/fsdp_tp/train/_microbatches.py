"""Gradient accumulation: ``jax.value_and_grad`` over a batch cut into microbatches, one
microbatch's activations alive at a time (:func:`accumulate_gradients`). Re-exported by
:mod:`fsdp_tp.train`, where users meet it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._layout import require_divisible
from .._types import PyTree

__all__ = ["accumulate_gradients"]


def _split_microbatches(batch: PyTree, num_microbatches: int) -> PyTree:
    """Reshapes every leaf ``(B, ...)`` to ``(num_microbatches, B // num_microbatches, ...)``."""

    def split(path, leaf):
        where = f"accumulate_gradients: batch leaf {jax.tree_util.keystr(path) or '<root>'}"
        if not leaf.ndim:
            raise ValueError(f"{where} is a scalar; every batch leaf needs a leading (batch) dim to split.")
        require_divisible(
            where,
            "dim 0 (the per-device batch)",
            leaf.shape[0],
            "num_microbatches",
            num_microbatches,
            f"make the global batch a multiple of {num_microbatches} x the number of batch shards",
            leaf.shape,
        )
        return leaf.reshape(num_microbatches, leaf.shape[0] // num_microbatches, *leaf.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)


def accumulate_gradients(
    loss_fn: Callable[[PyTree, PyTree, jax.Array | None], tuple[jax.Array, Any]],
    params: PyTree,
    batch: PyTree,
    num_microbatches: int,
    rng: jax.Array | None = None,
) -> tuple[tuple[jax.Array, Any], PyTree]:
    """``jax.value_and_grad(loss_fn, has_aux=True)`` over a batch cut into microbatches.

    ``loss_fn(params, microbatch, rng) -> (loss, aux)`` must return the *mean*
    loss over its microbatch; then the mean of the microbatch gradients is the
    full-batch gradient, while only one microbatch's activations are alive at
    a time (a ``jax.lax.scan``). Microbatch ``i`` gets ``fold_in(rng, i)``.
    Returns ``((loss, aux), grads)``: loss, aux leaves and grads averaged over
    the microbatches.

    >>> import jax.numpy as jnp
    >>> loss = lambda w, x, rng: ((w * x).mean(), None)
    >>> (l, _), g = accumulate_gradients(loss, jnp.float32(2.0), jnp.arange(8.0), 4)
    >>> float(l), float(g)   # the full-batch mean and its gradient, mean(x)
    (7.0, 3.5)
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"accumulate_gradients: num_microbatches must be a positive int, got {num_microbatches!r}."
        )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_microbatches == 1:
        return grad_fn(params, batch, rng)
    micro = _split_microbatches(batch, num_microbatches)

    def step(acc, xs):
        index, microbatch = xs
        key = None if rng is None else jax.random.fold_in(rng, index)
        (loss, aux), grads = grad_fn(params, microbatch, key)
        return jax.tree.map(jnp.add, acc, grads), (loss, aux)

    # Gradients have their parameters' types (vma included), so zeros_like of
    # the params is a carry that check_vma accepts.
    zeros = jax.tree.map(jnp.zeros_like, params)
    total, (losses, aux) = jax.lax.scan(step, zeros, (jnp.arange(num_microbatches), micro))
    mean = lambda x: x.mean(axis=0)
    grads = jax.tree.map(lambda g: g / num_microbatches, total)
    return (mean(losses), jax.tree.map(mean, aux)), grads

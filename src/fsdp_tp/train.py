"""Pieces of a per-device train step: rngs per shard, microbatching, the state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state

from ._axes import require_axes
from ._types import AxisNames, PyTree

__all__ = ["TrainState", "accumulate_gradients", "fold_rng_over_axis"]


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus an rng, replicated like the step counter.

    >>> import jax, jax.numpy as jnp, optax
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.5),
    ...                           rng=jax.random.key(0))
    >>> state = state.apply_gradients(grads={"w": jnp.ones(3)})
    >>> int(state.step), state.params["w"].tolist()
    (1, [0.5, 0.5, 0.5])
    """

    rng: jax.Array


def fold_rng_over_axis(rng: jax.Array, axis_name: AxisNames) -> jax.Array:
    """A different key on each device along ``axis_name`` (or several), the same along the others.

    Use it for dropout over the batch axes: shards of the batch get different
    masks, while devices that hold the same examples (``tensor``) agree.

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 4, "tensor": 2})
    >>> keys = jax.shard_map(lambda k: jax.random.key_data(fold_rng_over_axis(k, "data"))[None],
    ...                      mesh=mesh, in_specs=P(), out_specs=P(("data", "tensor")),
    ...                      check_vma=False)(jax.random.key(0))
    >>> len({tuple(k) for k in keys.tolist()})  # 4 data shards, each key shared by 2 tensor devices
    4
    """
    for name in require_axes(axis_name, "fold_rng_over_axis"):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(name))
    return rng


def _split_microbatches(batch: PyTree, num_microbatches: int) -> PyTree:
    """Reshapes every leaf ``(B, ...)`` to ``(num_microbatches, B // num_microbatches, ...)``."""

    def split(path, leaf):
        n = leaf.shape[0] if leaf.ndim else None
        if n is None or n % num_microbatches:
            raise ValueError(
                f"accumulate_gradients: batch leaf {jax.tree_util.keystr(path) or '<root>'} has "
                f"leading (per-device batch) dim {n} in shape {leaf.shape}, which "
                f"num_microbatches={num_microbatches} does not divide. Choose a microbatch count "
                f"that divides {n}, or a global batch that is a multiple of "
                f"{num_microbatches} x the number of batch shards."
            )
        return leaf.reshape(num_microbatches, n // num_microbatches, *leaf.shape[1:])

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

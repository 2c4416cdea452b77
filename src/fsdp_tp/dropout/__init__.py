"""Dropout with the unsharded model's mask, bit for bit, on every device's block.

An activation inside a sharded step is a block of the unsharded one: dim 0 split over the
batch axes, and inside a tensor-parallel region a feature or head dim split over ``tensor``.
``jax.random.bernoulli(key, p, local_shape)`` on that block draws a mask that is no block of
the unsharded mask: with the key folded over the batch axes every tensor rank draws the same
mask for its own hidden units (units ``j`` and ``j + H/4`` always drop together), and without
the fold every batch shard repeats one mask.

JAX's threefry is counter based (``jax_threefry_partitionable``, on by default): element
``i`` of ``random_bits(key, shape)`` is ``threefry_2x32(key, i)`` for its flat index ``i`` in
``shape``. So a device draws exactly its block of the unsharded mask (:func:`keep_mask`) by
hashing the global flat indices of its block: ``jax.random.bernoulli`` on a key of the
library's that does so (:mod:`fsdp_tp.dropout._block_key`), which flax's attention dropout draws from
too (:func:`exact_attention`). Which dims are split over which axes
(:func:`activation_split`): dim 0 over the step's batch axes, and the dims the tensor-parallel
roles say their outputs split (:func:`split_after`, :func:`splitting`); under
``check_vma=True`` an activation that varies over an axis no dim accounts for is refused.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> mesh = make_mesh({"data": 2, "tensor": 4})
>>> key = jax.random.key(0)
>>> blocks = jax.shard_map(lambda: keep_mask(key, 0.5, (4, 2), ("data", "tensor")), mesh=mesh,
...                        in_specs=(), out_specs=P("data", "tensor"))()
>>> bool((blocks == jax.random.bernoulli(key, 0.5, (8, 8))).all())   # the unsharded mask
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from .._axes import bound_axis_names, checks_vma, entry_axes, require_axes, varying_axes
from .._context import STEP
from .._renamed import renamed_keywords
from .._types import AxisName, AxisNames
from ..errors import FoldedDropoutWarning, warn
from ._activation_split import (
    Split,
    activation_split,
    split_after,
    splitting,
    unplaceable_after,
    unplaceable_within,
)
from ._block_key import Window, block_key, is_block_key, keep_mask, split_axes, wide_index

__all__ = [
    "Window",
    "activation_split",
    "attention_key",
    "block_key",
    "dropout",
    "exact_attention",
    "fold_over_block",
    "fold_rng_over_axis",
    "folded_attention",
    "is_block_key",
    "keep_mask",
    "split_after",
    "splitting",
    "unplaceable_after",
    "unplaceable_within",
    "warn_folded",
    "weights_split",
    "wide_index",
]


def dropout(
    inputs: jax.Array,
    rate: float,
    key: jax.Array,
    broadcast_dims: Sequence[int],
    split: Split,
    where: str = "dropout",
) -> jax.Array:
    """Flax's dropout (``nn.Dropout``, ``nnx.Dropout``: keep with probability ``1 - rate``,
    scale by ``1 / (1 - rate)``, one mask along ``broadcast_dims``) on this device's block of
    the activation, with this device's block of the unsharded mask."""
    keep_prob = 1.0 - rate
    shape = list(inputs.shape)
    names = list(tuple(split) + (None,) * (inputs.ndim - len(split)))
    for dim in broadcast_dims:
        shape[dim], names[dim] = 1, None  # one mask entry for the whole dim: not split
    mask = jnp.broadcast_to(keep_mask(key, keep_prob, tuple(shape), tuple(names), where), inputs.shape)
    return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


@renamed_keywords("dropout.fold_rng_over_axis")
def fold_rng_over_axis(rng: jax.Array, axis: AxisNames) -> jax.Array:
    """A different key on each device along ``axis`` (or several), the same along the others.

    Use it for a model's own random draws per example (noise, sampling) over the batch axes:
    shards of the batch draw differently, while devices that hold the same examples
    (``tensor``) agree. Not needed for dropout inside a transformed model: there each device
    draws its block of the unsharded mask from the unsharded key (:mod:`fsdp_tp.dropout`);
    a key folded here still gives every block an independent mask, but not the unsharded one.

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
    for name in require_axes(axis, "fold_rng_over_axis"):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(name))
    return rng


def fold_over_block(rng: jax.Array, x: jax.Array, batch_axes: Sequence[AxisName], where: str) -> jax.Array:
    """``rng`` folded over every axis ``x``'s block is split over (:func:`activation_split`):
    a different key on each block, the same where the blocks are the same."""
    split = activation_split(x, tuple(batch_axes), where)
    return fold_rng_over_axis(rng, tuple(dict.fromkeys(a for entry in split for a in split_axes(entry))))


def folded_attention(attention_fn: Callable, batch_axes: Sequence[AxisName], where: str) -> Callable:
    """``attention_fn`` (an ``attention_fn=`` the library does not own) whose ``dropout_rng`` is
    folded over every axis the attention's block is split over (the batch axes, and the heads'
    axis inside a head-parallel attention, :func:`fold_over_block`): each block draws its own
    mask, the unsharded model's distribution but not its mask (flax's own attention function
    draws the unsharded mask: :func:`exact_attention`)."""

    @functools.wraps(attention_fn)
    def attention(query, key, value, *args, dropout_rng=None, **kwargs):
        if dropout_rng is not None:
            dropout_rng = fold_over_block(dropout_rng, query, batch_axes, where)
        return attention_fn(query, key, value, *args, dropout_rng=dropout_rng, **kwargs)

    return attention


_FOLDED: set[str] = set()


def warn_folded(where: str, attention_fn: Callable) -> None:
    """Says once per attention module that its own attention function draws a mask per block."""
    if where not in _FOLDED:
        _FOLDED.add(where)
        name = getattr(attention_fn, "__qualname__", type(attention_fn).__name__)
        warn(
            FoldedDropoutWarning(
                f"{where}: attention_fn={name} is not flax's dot_product_attention, so its dropout "
                f"mask is drawn inside it: each block draws an independent one (the unsharded "
                f"model's distribution, not its mask). With flax's own function each device draws "
                f"its block of the unsharded mask."
            )
        )


def attention_key(
    rng: jax.Array, weights: tuple[int, ...], like: jax.Array, broadcast: bool, batch_axes, where: str
) -> jax.Array:
    """A key from which flax's attention draws, on this device's attention weights of shape
    ``weights`` (``(batch..., heads, queries, keys)``; ``like``: an activation of the call, whose
    batch axes the weights vary over), the block of the mask the unsharded model draws from
    ``rng`` (:func:`~fsdp_tp.dropout._block_key.block_key`): split on the batch and, inside a
    head-parallel attention, the heads; or, ``broadcast`` (flax's ``broadcast_dropout``), the
    one mask over batch and heads, the same on every device."""
    if broadcast:
        return block_key(rng, (None,) * len(weights), where)
    probe = jnp.zeros(weights, bool)
    bound = bound_axis_names()
    if bound and checks_vma(bound[0]) and (axes := tuple(varying_axes(like))):
        probe = jax.lax.pcast(probe, axes, to="varying")
    return block_key(rng, activation_split(probe, batch_axes, where), where)


def weights_split(query: jax.Array, batch_axes: Sequence[AxisName], where: str) -> tuple:
    """In a step that splits the sequence: how the attention weights ``(B, H, ...)`` of
    ``query`` ``(B, L, H, D)``, a device's tokens, are split on their rows and heads (box-name
    entries): the rows over the batch axes but the sequence's, the heads as a head-parallel
    role left them. The queries' and keys' dims are the attention's to place
    (:class:`~fsdp_tp.context._dropout.AttentionDropout`)."""
    axis = STEP.get().sequence.axis
    probe = jnp.zeros((query.shape[0], query.shape[2], 1, 1), bool)
    bound = bound_axis_names()
    if bound and checks_vma(bound[0]) and (axes := tuple(varying_axes(query))):
        probe = jax.lax.pcast(probe, axes, to="varying")
    with STEP.scoped(tokens=None):  # (dim 1 of the weights is the heads, not the tokens)
        split = activation_split(probe, tuple(dict.fromkeys((*batch_axes, axis))), where)
    rows = tuple(a for a in entry_axes(split[0]) if a != axis)
    return (rows[0] if len(rows) == 1 else rows or None), split[1]


def exact_attention(attention_fn: Callable, batch_axes: Sequence[AxisName], where: str) -> Callable:
    """flax's ``dot_product_attention`` (Linen's or NNX's) drawing, for each call, this device's
    block of the unsharded model's attention-dropout mask: its ``dropout_rng`` made a block key
    for the weights' shape (:func:`attention_key`), so flax's own ``jax.random.bernoulli`` on its
    block draws the block of the unsharded draw, in flax's own order of operations."""

    @functools.wraps(attention_fn)
    def attention(query, key, value, *args, dropout_rng=None, broadcast_dropout=True, **kwargs):
        if dropout_rng is not None:
            weights = (*query.shape[:-3], query.shape[-2], query.shape[-3], key.shape[-3])
            dropout_rng = attention_key(dropout_rng, weights, query, broadcast_dropout, batch_axes, where)
        return attention_fn(
            query, key, value, *args, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout, **kwargs
        )

    return attention

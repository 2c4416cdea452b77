"""All-to-all attention over the ``context`` axis (DeepSpeed's Ulysses):
:func:`all_to_all_attention`, and the choice between it and the ring (:func:`attention`).

Where the axis's size ``n`` divides the kv heads a device holds, one ``all_to_all`` turns
each device's slice of the sequence with every head into the whole sequence with ``1/n`` of
the heads; attention runs there as on one device; one more turns the output back. Per layer
and device, forward: ``2(n-1)/n² · B·S·D·(H+G)·b`` (q and the output, k and v), against the
ring's ``2(n-1)/n · B·S·G·D·b``: all-to-all sends ``(H+G)/(n·G)`` of the ring's bytes, fewer
where ``n·G > H+G``. A device holds the whole sequence's scores for its heads (``H/n · S²``);
the ring holds one block at a time.

>>> ring_or_all_to_all(heads=32, kv_heads=8, size=8)   # 40 / 64 of the ring's bytes
'all_to_all'
>>> ring_or_all_to_all(heads=32, kv_heads=2, size=8)   # 8 does not divide 2 kv heads
'ring'
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._axes import CONTEXT, entry_axes, require_axes
from .._layout import axis_text, require_divisible
from .._sequence_split import STRATEGIES, SequenceSplit
from . import _blocks
from ._dropout import AttentionDropout
from ._ring import dropout_key, require_shapes, ring_attention

__all__ = ["all_to_all_attention", "all_to_all_bytes", "attention", "ring_or_all_to_all"]


def ring_or_all_to_all(heads: int, kv_heads: int, size: int) -> str:
    """The strategy that sends fewer bytes for ``heads`` query and ``kv_heads`` kv heads a device
    over ``size`` devices: all-to-all where ``size`` divides the kv heads and
    ``size · kv_heads > heads + kv_heads``, else the ring."""
    if kv_heads % size or size * kv_heads <= heads + kv_heads:
        return "ring"
    return "all_to_all"


def all_to_all_bytes(
    rows: int, length: int, heads: int, kv_heads: int, head_dim: int, size: int, dtype
) -> tuple[int, int]:
    """The bytes :func:`all_to_all_attention` sends a device per call, ``(forward, backward)``,
    for ``rows`` sequences of ``length`` tokens over ``size`` devices, ``heads`` and ``kv_heads``
    on this device, of ``dtype``: the formula above, the backward the same all-to-alls reversed.

    >>> all_to_all_bytes(8, 256, 2, 2, 16, 2, "float32")   # q, k, v, out: 4 x 8·128·2·16·4 B, half sent
    (262144, 262144)
    """
    each = 2 * (size - 1) * rows * length * head_dim * (heads + kv_heads) * jnp.dtype(dtype).itemsize
    return each // size**2, each // size**2


def all_to_all_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis: str = CONTEXT,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
    dropout: AttentionDropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """:func:`~fsdp_tp.context.ring_attention`'s result, by two all-to-alls each way: the axis's
    size must divide the kv heads (``k.shape[2]``). Differentiated by JAX (the transpose of an
    all-to-all is the reverse all-to-all). Attention dropout: this device's heads' block of the
    unsharded mask, drawn in the sequence's order and taken in the devices'."""
    require_axes(axis, "all_to_all_attention")
    split, size = SequenceSplit(axis, balanced), jax.lax.axis_size(axis)
    require_shapes(q, k, v, segment_ids, split)
    fix = "pass strategy='ring' (or 'auto', which takes the ring here)"
    require_divisible(
        "all_to_all_attention", "the kv heads a device holds", k.shape[2], axis_text(axis), size, fix
    )
    b, length, _, dim = q.shape
    # this device's heads over the whole sequence, its tokens in device order
    whole = lambda t: jax.lax.all_to_all(t, axis, 2, 1, tiled=True)
    qs, ks, vs = whole(q), whole(k), whole(v)
    groups = ks.shape[2]
    index = jnp.concatenate([split.token_index(d, size, length) for d in range(size)])
    segments = None if segment_ids is None else jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
    mask = _blocks.causal_mask(index, index, segments, segments, causal, window)
    qs = qs.reshape(b, size * length, groups, -1, dim)
    keep = None
    if dropout is not None:  # (this device's heads now: the axis splits them, minor to theirs)
        heads = dataclasses.replace(dropout, heads=(*entry_axes(dropout.heads), axis))
        total, zero = size * length, jnp.zeros((), jnp.int32)
        shape = (b, qs.shape[2] * qs.shape[3], total, total)
        drawn = heads.keep(dropout_key(dropout, key), shape, groups, (zero, zero), total, qs.dtype)
        keep = jnp.take(jnp.take(drawn, index, axis=-2), index, axis=-1)
    scores_dtype = _blocks.compute_dtype(q.dtype)
    keep = None if keep is None else keep.astype(scores_dtype)
    out = _blocks.whole(qs, ks, vs, mask, scale, keep).reshape(b, size * length, -1, dim).astype(q.dtype)
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)  # (back: this device's tokens, every head)


def attention(q, k, v, segment_ids=None, *, strategy: str = "ring", **options) -> jax.Array:
    """Attention across the ``context`` axis by ``strategy`` (one of :data:`STRATEGIES`;
    ``auto``: :func:`ring_or_all_to_all`); ``options``: :func:`~fsdp_tp.context.ring_attention`'s
    keywords (``axis``, ``causal``, ``balanced``, ``scale``, ``window``), which both strategies take."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context attention: strategy {strategy!r} is not one of {STRATEGIES}.")
    if strategy == "auto":
        axis = options.get("axis", CONTEXT)
        require_axes(axis, "context attention")
        strategy = ring_or_all_to_all(q.shape[2], k.shape[2], jax.lax.axis_size(axis))
    chosen = ring_attention if strategy == "ring" else all_to_all_attention
    return chosen(q, k, v, segment_ids, **options)

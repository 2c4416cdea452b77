"""Attention inside a step that splits the sequence, computed across the ``context`` axis:
:func:`across` (the library's ring or all-to-all, by the split's strategy), :func:`on_device`
(what the plan check traces in its place), and ``jax.nn.dot_product_attention`` as a model
calls it by that name, intercepted while a step's per-device trace runs
(:func:`jax_attention_across`: the one attribute of another library the package patches, listed
on ``docs/architecture.md``'s page of state no import shows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from .._sequence_split import SequenceSplit, checked_here, split_here
from . import _blocks
from ._all_to_all import attention

__all__ = ["across", "jax_attention_across", "on_device"]


def on_device(q, k, v, segment_ids=None, *, causal: bool = True, scale=None):
    """Attention of ``q`` ``(..., S, H, D)`` over ``k``, ``v`` ``(..., S, G, D)``, all of it on
    this device, by the ring's own block (:mod:`._blocks`): what the check traces in its place."""
    lead, (length, heads, dim), groups = q.shape[:-3], q.shape[-3:], k.shape[-2]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    qs, ks, vs = fold(q), fold(k), fold(v)
    qs = qs.reshape(*qs.shape[:2], groups, heads // groups, dim)
    segments = None if segment_ids is None else segment_ids.reshape(-1, length)
    index = jnp.arange(length)
    mask = _blocks.causal_mask(index, index, segments, segments, causal)
    return _blocks.whole(qs, ks, vs, mask, scale).reshape(*lead, length, heads, dim).astype(q.dtype)


def across(
    split: SequenceSplit,
    q,
    k,
    v,
    segment_ids=None,
    *,
    causal: bool = True,
    scale=None,
    dropout=None,
    key=None,
):
    """Attention of ``q`` ``(..., L, H, D)`` over ``k``, ``v`` ``(..., L, G, D)`` (a device's
    tokens) across ``split``'s axis, by its strategy; leading dims folded into the batch
    (``dropout``, ``key``: :func:`~fsdp_tp.context.ring_attention`'s)."""
    lead = q.shape[:-3]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    segments = None if segment_ids is None else segment_ids.reshape(-1, segment_ids.shape[-1])
    out = attention(
        fold(q),
        fold(k),
        fold(v),
        segments,
        strategy=split.strategy,
        axis=split.axis,
        causal=causal,
        balanced=split.balanced,
        scale=scale,
        dropout=dropout,
        key=key,
    )
    return out.reshape(*lead, *out.shape[-3:])


_JAX_ATTENTION = jax.nn.dot_product_attention


def _jax_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **rest):
    """``jax.nn.dot_product_attention`` within a step that splits the sequence: computed across
    the axis where it can be (no ``bias`` or ``mask``: both are built from a device's local
    shapes), refused otherwise."""
    split = split_here()
    if split is None and checked_here() and bias is None and mask is None:
        return on_device(query, key, value, causal=is_causal, scale=scale)
    if split is None:
        return _JAX_ATTENTION(query, key, value, bias, mask, scale=scale, is_causal=is_causal, **rest)
    given = {"bias": bias, "mask": mask, **{k: v for k, v in rest.items() if k != "implementation"}}
    if named := [name for name, value in given.items() if value is not None and value is not False]:
        raise ValueError(
            f"jax.nn.dot_product_attention({', '.join(f'{n}=...' for n in named)}) inside a step that "
            f"splits the sequence over {split.axis!r}: a mask or bias the model builds holds a device's "
            f"tokens only, and the attention across devices cannot read it. Pass is_causal=True for a "
            f"causal mask, and packed documents' segment ids through "
            f"fsdp_tp.attention.attend(q, k, v, segment_ids=...)."
        )
    if query.ndim == 3:  # (T, N, H): one sequence
        return across(split, query[None], key[None], value[None], causal=is_causal, scale=scale)[0]
    return across(split, query, key, value, causal=is_causal, scale=scale)


@contextlib.contextmanager
def jax_attention_across(split: SequenceSplit | None) -> Iterator[None]:
    """Within (a step's per-device trace, where ``split`` is not ``None``):
    ``jax.nn.dot_product_attention`` computes across the split's axis (:func:`_jax_attention`),
    as a model calls it by that name. Reset when the trace ends."""
    if split is None:
        yield
        return
    jax.nn.dot_product_attention = _jax_attention
    try:
        yield
    finally:
        jax.nn.dot_product_attention = _JAX_ATTENTION

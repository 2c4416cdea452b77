"""Attention inside a step that splits the sequence, computed across the ``context`` axis:
:func:`across` (the library's ring or all-to-all, by the split's strategy), :func:`on_device`
(what the plan check traces in its place), and ``jax.nn.dot_product_attention`` however a model
bound it, intercepted while a step's per-device trace runs (:func:`jax_attention_across`).

A model reaches JAX's attention by its attribute at the call, by a name it imported, through
a ``functools.partial`` made at import or a module's ``attention_fn=``: each holds the same
function object, which runs its XLA implementation by the name its module looks up at the
call. So both names are patched within the trace: the attribute (every implementation, cuDNN's
too) and ``jax._src.nn.functions._dot_product_attention_xla`` (every binding; a private name
of JAX's, the same signature on jax 0.10-0.12). These are the attributes of other libraries
the package patches, listed on ``docs/architecture.md``'s page of state no import shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax._src.nn import functions as _jax_nn

from .._sequence_split import SequenceSplit, checked_here, split_here
from .._trace.sites import calling_site
from ..errors import RuleError
from . import _blocks
from ._all_to_all import attention

__all__ = ["across", "jax_attention_across", "on_device"]


def on_device(q, k, v, segment_ids=None, *, causal: bool = True, scale=None, window=None):
    """Attention of ``q`` ``(..., S, H, D)`` over ``k``, ``v`` ``(..., S, G, D)``, all of it on
    this device, by the ring's own block (:mod:`._blocks`): what the check traces in its place."""
    lead, (length, heads, dim), groups = q.shape[:-3], q.shape[-3:], k.shape[-2]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    qs, ks, vs = fold(q), fold(k), fold(v)
    qs = qs.reshape(*qs.shape[:2], groups, heads // groups, dim)
    segments = None if segment_ids is None else segment_ids.reshape(-1, length)
    index = jnp.arange(length)
    mask = _blocks.causal_mask(index, index, segments, segments, causal, window)
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
    window=None,
):
    """Attention of ``q`` ``(..., L, H, D)`` over ``k``, ``v`` ``(..., L, G, D)`` (a device's
    tokens) across ``split``'s axis, by its strategy; leading dims folded into the batch
    (``dropout``, ``key``, ``window``: :func:`~fsdp_tp.context.ring_attention`'s)."""
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
        window=window,
    )
    return out.reshape(*lead, *out.shape[-3:])


_JAX_ATTENTION = jax.nn.dot_product_attention
_JAX_XLA = _jax_nn._dot_product_attention_xla


def _named(given: dict) -> list[str]:
    """The arguments of ``given`` the model set (neither ``None`` nor ``False``)."""
    return [name for name, value in given.items() if value is not None and value is not False]


def _refuse_unread(split: SequenceSplit, given: dict) -> None:
    """A mask, bias or lengths given to JAX's attention in a split step: a ``RuleError`` at the
    model's line (they hold a device's tokens only; the ring cannot read them)."""
    if named := _named(given):
        site = calling_site()
        raise RuleError(
            f"{f'{site}: ' if site is not None else ''}jax.nn.dot_product_attention("
            f"{', '.join(f'{n}=...' for n in named)}) inside a step that splits the sequence over "
            f"{split.axis!r}: a mask or bias the model builds holds a device's tokens only, and the "
            f"attention across devices cannot read it. Fix: pass is_causal=True for a causal mask, and "
            f"packed documents' segment ids through fsdp_tp.attention.attend(q, k, v, segment_ids=...)."
        )


def _jax_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **rest):
    """``jax.nn.dot_product_attention`` called by its attribute within a step that splits the
    sequence: computed across the axis where it can be (no ``bias`` or ``mask``: both are built
    from a device's local shapes), refused otherwise."""
    split = split_here()
    if split is None and checked_here() and bias is None and mask is None:
        return on_device(query, key, value, causal=is_causal, scale=scale)
    if split is None:
        return _JAX_ATTENTION(query, key, value, bias, mask, scale=scale, is_causal=is_causal, **rest)
    _refuse_unread(
        split, {"bias": bias, "mask": mask, **{k: v for k, v in rest.items() if k != "implementation"}}
    )
    if query.ndim == 3:  # (T, N, H): one sequence
        return across(split, query[None], key[None], value[None], causal=is_causal, scale=scale)[0]
    return across(split, query, key, value, causal=is_causal, scale=scale)


def _jax_attention_xla(query, key, value, bias, mask, **given):
    """What every binding of ``jax.nn.dot_product_attention`` runs (its XLA implementation, once
    it has checked the shapes and made them ``(B, T, N, H)``; ``given``: ``is_causal``, the
    ``scale``, the sequence lengths, the local window and ``return_residual``, by keyword as JAX
    passes them): within a split step, :func:`_jax_attention`'s attention across the axis."""
    split, causal, scale = split_here(), given["is_causal"], given["scale"]
    unread = {"bias": bias, "mask": mask} | {
        name: given.get(key)
        for name, key in (
            ("query_seq_lengths", "q_seqlen"),
            ("key_value_seq_lengths", "kv_seqlen"),
            ("local_window_size", "local_window_size"),
            ("return_residual", "return_residual"),
        )
    }
    if split is None and checked_here() and not _named(unread):
        return on_device(query, key, value, causal=causal, scale=scale)
    if split is None:
        return _JAX_XLA(query, key, value, bias, mask, **given)
    _refuse_unread(split, unread)
    return across(split, query, key, value, causal=causal, scale=scale)


# (the module, the name, what it runs within a split step's trace)
_PATCHED = (
    (jax.nn, "dot_product_attention", _jax_attention),
    (_jax_nn, "_dot_product_attention_xla", _jax_attention_xla),
)


@contextlib.contextmanager
def jax_attention_across(split: SequenceSplit | None) -> Iterator[None]:
    """Within (a step's per-device trace, where ``split`` is not ``None``): JAX's
    ``dot_product_attention`` computes across the split's axis however the model bound it
    (:data:`_PATCHED`). Reset when the trace ends."""
    if split is None:
        yield
        return
    saved = [(module, name, getattr(module, name)) for module, name, _ in _PATCHED]
    for module, name, patched in _PATCHED:
        setattr(module, name, patched)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)

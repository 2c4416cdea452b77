"""Softmax attention, framework-free: what the Linen attention layer, the NNX GPT and the CLI's
``--attention`` compute with. Grouped-query attention reads each kv head once (but in the
reference einsums, which repeat k and v per group). Packed documents: segment ids mask
attention to a token's own document. Inside a train step that splits the sequence over
``context`` (:func:`~fsdp_tp.shard_step`), :func:`attend` computes across the axis
(:mod:`fsdp_tp.context`).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from ._sequence_split import checked_here, split_here
from .context._across import across, on_device
from .context._blocks import causal_mask

__all__ = ["ATTENTION_IMPLEMENTATIONS", "attend", "resolved_implementation"]

ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn", "auto")
"""How attention is computed: ``reference`` (the library's einsums, k/v repeated per group),
``xla`` / ``cudnn`` (``jax.nn.dot_product_attention``'s implementations; cuDNN is flash
attention on NVIDIA GPUs, 16-bit inputs only), ``auto`` (cuDNN where it can run, else XLA)."""


def _reference_attention(q, k, v, causal: bool, segment_ids=None, window=None):
    """q: (..., S, H, D); k, v: (..., S, G, D) with H a multiple of G; softmax in f32 (float64
    inputs: float64, so a float64 twin stays float64 through it). ``segment_ids`` (..., S): a
    query sees its own document's keys; padding (0) sees none and gives 0, as the ring's.
    ``window``: each query sees itself and the ``window - 1`` keys before it."""
    heads, groups = q.shape[-2], k.shape[-2]
    k = jnp.repeat(k, heads // groups, axis=-2)
    v = jnp.repeat(v, heads // groups, axis=-2)
    wide = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(wide) / jnp.sqrt(q.shape[-1])
    if window is not None and segment_ids is None:
        segment_ids = jnp.ones(q.shape[:-2], jnp.int32)  # (one document: the window's mask alone)
    if segment_ids is not None:
        index = jnp.arange(q.shape[-3])
        segments = segment_ids.reshape(-1, index.shape[0])
        mask = causal_mask(index, index, segments, segments, causal, window).reshape(*segment_ids.shape, -1)
        mask = mask[..., None, :, :]  # (..., 1, q, k): every head alike
        logits = jnp.where(mask, logits, jnp.finfo(wide).min)
        weights = jax.nn.softmax(logits, axis=-1) * mask.any(-1, keepdims=True)  # (padding: 0)
        return jnp.einsum("...hqk,...khd->...qhd", weights.astype(v.dtype), v)
    if causal:
        seq = q.shape[-3]
        logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, jnp.finfo(wide).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def resolved_implementation(implementation: str, dtype) -> Literal["reference", "xla", "cudnn"]:
    """What ``implementation`` computes with for inputs of ``dtype`` on this backend (``auto``
    resolved: ``cudnn`` on NVIDIA GPUs for 16-bit inputs, ``xla`` otherwise)."""
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}."
        )
    if implementation != "auto":
        return implementation  # type: ignore[return-value]  # checked against the tuple above
    # cuDNN's fused kernel takes only f16/bf16 and exists only on NVIDIA GPUs (checked at trace time).
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and sixteen_bit else "xla"


def _require_fitting(q, k, v, segment_ids) -> None:
    """q, k, v and the segment ids that fit, or one line naming the argument and the fix (they
    ended in an einsum's label error or a broadcast deep in the attention, sharded or not)."""
    if q.ndim < 3 or k.shape != v.shape or k.ndim != q.ndim:
        raise ValueError(
            f"attend: q {q.shape}, k {k.shape}, v {v.shape}; pass q (..., tokens, heads, dim) and k, v "
            f"(..., tokens, kv_heads, dim) of one shape."
        )
    heads, groups = q.shape[-2], k.shape[-2]
    if heads % groups or q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attend: q {q.shape} and k, v {k.shape} do not fit: the same leading dims and head dim, and "
            f"kv heads that divide the {heads} query heads (grouped-query attention: {heads} // kv_heads "
            f"queries a kv head); {groups} does not" + (" divide them." if heads % groups else " differ.")
        )
    if segment_ids is None:
        return
    want = q.shape[:-2]
    if tuple(segment_ids.shape) != tuple(want) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"attend: segment_ids {segment_ids.dtype} {tuple(segment_ids.shape)}; pass one integer "
            f"document id per token, {tuple(want)} (q's dims but its heads and head dim; 0 is padding), e.g. "
            f"segments.astype(jnp.int32) of shape (batch, tokens)."
        )


def attend(
    q,
    k,
    v,
    causal: bool = True,
    implementation: str = "reference",
    *,
    segment_ids=None,
    window: int | None = None,
) -> jax.Array:
    """Softmax attention of q ``(..., S, H, D)`` over k, v ``(..., S, G, D)`` (H a multiple of
    G: grouped-query attention); the softmax is in f32 at least whichever ``implementation``
    (one of :data:`ATTENTION_IMPLEMENTATIONS`) computes it. Only ``reference`` repeats k and v
    per group; the others read each kv head once. ``segment_ids`` ``(..., S)``: packed
    documents (a query sees keys of its own document only; 0 is padding, whose output is 0).
    ``window`` (causal only): sliding-window attention, each query seeing itself and the
    ``window - 1`` tokens before it (Mistral's, Phi-3's ``sliding_window``); under a sequence
    split the ring skips the blocks wholly outside it.

    Inside a step that splits the sequence (:func:`~fsdp_tp.shard_step` with a batch spec
    naming ``context``), q, k, v and ``segment_ids`` are a device's tokens and attention is
    computed over every device's keys by the split's strategy (ring or all-to-all), the
    result the unsharded attention's rows for those tokens; ``implementation`` is then unused.

    >>> import jax
    >>> q = jax.random.normal(jax.random.key(0), (2, 6, 4, 8))
    >>> kv = jax.random.normal(jax.random.key(1), (2, 6, 2, 8))
    >>> a, b = attend(q, kv, kv), attend(q, kv, kv, implementation="xla")
    >>> a.shape, bool(jnp.allclose(a, b, atol=1e-6))
    ((2, 6, 4, 8), True)
    >>> near = attend(q, kv, kv, window=2)   # each query: itself and the token before it
    >>> bool(jnp.allclose(near[:, 1], attend(q[:, :2], kv[:, :2], kv[:, :2])[:, 1], atol=1e-6))
    True
    """
    _require_fitting(q, k, v, segment_ids)
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"attend: window={window!r} with causal={causal}; a sliding window is a positive int of "
            f"tokens and causal (each query sees itself and the window - 1 tokens before it)."
        )
    chosen = resolved_implementation(implementation, q.dtype)
    if (split := split_here()) is not None:
        return across(split, q, k, v, segment_ids, causal=causal, window=window)
    if checked_here():  # (the plan check's trace in such a step: the library's, as the ring is)
        return on_device(q, k, v, segment_ids, causal=causal, window=window)
    if chosen == "reference" or segment_ids is not None:  # (a document mask: the einsums')
        return _reference_attention(q, k, v, causal, segment_ids, window)
    assert chosen in ("xla", "cudnn")
    # jax.nn.dot_product_attention takes (batch, seq, heads, dim): fold any leading dims.
    lead = q.shape[:-3]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    local = None if window is None else (window - 1, 0)
    out = jax.nn.dot_product_attention(
        fold(q), fold(k), fold(v), is_causal=causal, implementation=chosen, local_window_size=local
    )
    return out.reshape(*lead, *out.shape[-3:])

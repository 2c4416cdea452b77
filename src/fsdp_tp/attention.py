"""Softmax attention, framework-free: what the Linen attention layer, the NNX GPT and the CLI's
``--attention`` compute with. Grouped-query attention reads each kv head once (but in the
reference einsums, which repeat k and v per group).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["ATTENTION_IMPLEMENTATIONS", "attend", "resolved_implementation"]

ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn", "auto")
"""How attention is computed: ``reference`` (the library's einsums, k/v repeated per group),
``xla`` / ``cudnn`` (``jax.nn.dot_product_attention``'s implementations; cuDNN is flash
attention on NVIDIA GPUs, 16-bit inputs only), ``auto`` (cuDNN where it can run, else XLA)."""


def _reference_attention(q, k, v, causal: bool):
    """q: (..., S, H, D); k, v: (..., S, G, D) with H a multiple of G; softmax in f32 (float64
    inputs: float64, so a float64 twin stays float64 through it)."""
    heads, groups = q.shape[-2], k.shape[-2]
    k = jnp.repeat(k, heads // groups, axis=-2)
    v = jnp.repeat(v, heads // groups, axis=-2)
    wide = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(wide) / jnp.sqrt(q.shape[-1])
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


def attend(q, k, v, causal: bool = True, implementation: str = "reference") -> jax.Array:
    """Softmax attention of q ``(..., S, H, D)`` over k, v ``(..., S, G, D)`` (H a multiple of
    G: grouped-query attention); the softmax is in f32 at least whichever ``implementation``
    (one of :data:`ATTENTION_IMPLEMENTATIONS`) computes it. Only ``reference`` repeats k and v
    per group; the others read each kv head once.

    >>> import jax
    >>> q = jax.random.normal(jax.random.key(0), (2, 6, 4, 8))
    >>> kv = jax.random.normal(jax.random.key(1), (2, 6, 2, 8))
    >>> a, b = attend(q, kv, kv), attend(q, kv, kv, implementation="xla")
    >>> a.shape, bool(jnp.allclose(a, b, atol=1e-6))
    ((2, 6, 4, 8), True)
    """
    chosen = resolved_implementation(implementation, q.dtype)
    if chosen == "reference":
        return _reference_attention(q, k, v, causal)
    assert chosen in ("xla", "cudnn")
    # jax.nn.dot_product_attention takes (batch, seq, heads, dim): fold any leading dims.
    lead = q.shape[:-3]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    out = jax.nn.dot_product_attention(fold(q), fold(k), fold(v), is_causal=causal, implementation=chosen)
    return out.reshape(*lead, *out.shape[-3:])

"""What the Hub's decoders compute, written once for both front ends of
:mod:`fsdp_tp.hub.decoder` (whose modules only hold the parameters): RMSNorm as transformers
computes it (Gemma's ``1 + w``), RoPE by ``rotate_half``, the attention with each layer's RoPE
and window, the MLP's gate, Gemma's embedding scale and soft-cap, and a Dense projection's heads.

>>> import jax.numpy as jnp
>>> from fsdp_tp.hub.config import DecoderConfig
>>> c = DecoderConfig(vocab=64, d=4, heads=1, kv_heads=1, head_dim=4, hidden=8, layers=1)
>>> [round(v, 3) for v in rms_norm(c, jnp.array([3.0, 4.0, 0.0, 0.0]), jnp.ones(4)).tolist()]
[1.2, 1.6, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import attend
from .config import DecoderConfig, rope_frequencies

__all__ = [
    "attention",
    "capped",
    "embedded",
    "flat",
    "gate",
    "heads",
    "inputs",
    "norm_init",
    "rms_norm",
    "rope",
]


def rope(x: jax.Array, positions: jax.Array, inv: np.ndarray) -> jax.Array:
    """RoPE on ``x`` (B, T, N, H): the two halves of each head rotated, as transformers' ``rotate_half``."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # (B or 1, T, H/2)
    cos, sin = (
        jnp.concatenate([f, f], -1)[..., None, :].astype(x.dtype) for f in (jnp.cos(angle), jnp.sin(angle))
    )
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(c: DecoderConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """transformers' RMSNorm, normalized in float32 at least: Llama's scales the result cast back
    by ``weight``; Gemma's scales in float32 by ``1 + weight``, then casts."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + c.norm_eps)
    if c.norm_offset:
        return (normed * (c.norm_offset + weight.astype(wide.dtype))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def norm_init(c: DecoderConfig):
    """A norm's weight at init: ones (scale 1), or Gemma's zeros (scale 1 + 0); float32 as the
    projections' are (flax's default: under ``jax.enable_x64`` an initializer's is float64)."""
    return jax.nn.initializers.zeros if c.norm_offset else jax.nn.initializers.ones


def attention(c: DecoderConfig, layer: int, q, k, v, positions, segments) -> jax.Array:
    """RoPE (the layer's frequencies) then the library's attention (the layer's window); Gemma's
    scores scaled by ``query_scale ** -0.5`` in place of ``head_dim ** -0.5``, on the queries."""
    inv = rope_frequencies(c, layer)
    q, k = rope(q, positions, inv), rope(k, positions, inv)
    if c.query_scale is not None:
        q = q * jnp.asarray((c.head_dim / c.query_scale) ** 0.5, q.dtype)
    return attend(q, k, v, segment_ids=segments, window=c.window(layer))


def gate(c: DecoderConfig, gate: jax.Array) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True) if c.activation == "gelu_tanh" else jax.nn.silu(gate)


def embedded(c: DecoderConfig, x: jax.Array) -> jax.Array:
    """Gemma's embeddings times ``sqrt(d)`` (in the embedding's dtype, as transformers rounds it)."""
    return x * jnp.asarray(c.d**0.5, jnp.float32).astype(x.dtype) if c.embed_scale else x


def capped(c: DecoderConfig, logits: jax.Array) -> jax.Array:
    """Gemma's final soft-cap, ``cap * tanh(logits / cap)``."""
    return logits if c.logit_cap is None else jnp.tanh(logits / c.logit_cap) * c.logit_cap


def inputs(tokens, positions, segment_ids) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(tokens, positions, segment_ids)`` from the arguments or from a batch mapping given as
    ``tokens`` (``{"tokens", "positions", "segment_ids"}``, as the library's packed batches):
    positions ``0 .. T-1`` where none are given."""
    if isinstance(tokens, Mapping):
        tokens, positions, segment_ids = (tokens.get(k) for k in ("tokens", "positions", "segment_ids"))
    positions = jnp.arange(tokens.shape[-1])[None] if positions is None else positions
    return tokens, positions, segment_ids


def heads(c: DecoderConfig, x: jax.Array) -> jax.Array:
    """A Dense projection's ``(B, T, N * H)`` as ``(B, T, N, H)``."""
    return x.reshape(*x.shape[:-1], -1, c.head_dim)


def flat(x: jax.Array) -> jax.Array:
    """``(B, T, N, H)`` as a Dense projection's input ``(B, T, N * H)``."""
    return x.reshape(*x.shape[:-2], -1)

"""A packed-document LM of the user's, Linen and NNX (GQA, RoPE at each token's position in its
document, :func:`fsdp_tp.attention.attend` with the batch's segment ids), and its packed batch:
the model the sequence-split tests (``test_context_step``, ``test_whole_step``) train.

Nothing in the model knows the sequence is split; ``local_positions`` and ``jax_attention`` are
the negative controls' variants (positions from the local length, JAX's attention with a mask
of its own).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.nn import dot_product_attention

from fsdp_tp.attention import attend
from fsdp_tp.context import document_positions

VOCAB, D, HEADS, KV, HEAD_DIM, HIDDEN = 32, 16, 4, 2, 4, 32
ROWS, LENGTH = 2, 16
# JAX's attention as models bind it: by its attribute at the call, imported by name, or a
# partial made at import (before any step runs)
JAX_ATTENTION = {
    "causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "imported": lambda q, k, v: dot_product_attention(q, k, v, is_causal=True),
    "partial": functools.partial(jax.nn.dot_product_attention, is_causal=True),
}


def rope(x, positions):
    """Rotary embedding of ``x`` (B, L, heads, dim) at each token's ``positions`` (B, L)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000 ** (jnp.arange(half, dtype=x.dtype) / half))
    angle = positions[..., None, None].astype(x.dtype) * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def heads_of(x):
    return x.reshape(*x.shape[:-1], -1, HEAD_DIM)  # (the head count from the shape: TP splits heads)


def attention(q, k, v, batch, local_positions: bool = False, jax_attention: str = ""):
    b, length = q.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(length), (b, length)) if local_positions else batch["positions"]
    q, k = rope(q, positions), rope(k, positions)
    if jax_attention == "mask":  # (a causal mask of the model's own, from the length it sees)
        return jax.nn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((length, length), bool)))
    if jax_attention:  # (as a model calls JAX's: causal, one document a row)
        return JAX_ATTENTION[jax_attention](q, k, v)
    return attend(q, k, v, segment_ids=batch["segments"])


class LinenBlock(nn.Module):
    local_positions: bool = False
    jax_attention: str = ""
    kv_heads: int = KV

    @nn.compact
    def __call__(self, x, batch):
        h = rms(x)
        shapes = (("q", HEADS), ("k", self.kv_heads), ("v", self.kv_heads))
        q, k, v = (heads_of(nn.Dense(n * HEAD_DIM, name=name)(h)) for name, n in shapes)
        out = attention(q, k, v, batch, self.local_positions, self.jax_attention)
        x = x + nn.Dense(D, name="out")(out.reshape(*out.shape[:2], -1))
        return x + nn.Dense(D, name="down")(nn.gelu(nn.Dense(HIDDEN, name="up")(rms(x))))


class LinenLM(nn.Module):
    local_positions: bool = False
    jax_attention: str = ""
    kv_heads: int = KV  # (query heads a kv head serves: HEADS / kv_heads)

    @nn.compact
    def __call__(self, batch):
        x = nn.Embed(VOCAB, D, name="embed")(batch["tokens"])
        for i in range(2):
            x = LinenBlock(self.local_positions, self.jax_attention, self.kv_heads, name=f"block_{i}")(
                x, batch
            )
        return nn.Dense(VOCAB, name="head")(rms(x))


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.q, self.k, self.v = (nnx.Linear(D, n * HEAD_DIM, rngs=rngs) for n in (HEADS, KV, KV))
        self.out = nnx.Linear(HEADS * HEAD_DIM, D, rngs=rngs)
        self.up, self.down = nnx.Linear(D, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, D, rngs=rngs)

    def __call__(self, x, batch):
        h = rms(x)
        out = attention(heads_of(self.q(h)), heads_of(self.k(h)), heads_of(self.v(h)), batch, False)
        x = x + self.out(out.reshape(*out.shape[:2], -1))
        return x + self.down(nnx.gelu(self.up(rms(x))))


class NNXLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, batch):
        x = self.embed(batch["tokens"])
        for block in self.blocks:
            x = block(x, batch)
        return self.head(rms(x))


def packed_batch(seed: int = 0):
    """Two rows of packed documents (boundaries drawn, the second row ending in padding), their
    positions in their documents, and next tokens as targets."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((ROWS, LENGTH), np.int32)
    for row, used in enumerate((LENGTH, LENGTH - 3)):
        cuts = np.sort(rng.choice(np.arange(1, used), 2, replace=False))
        segments[row, :used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
    tokens = rng.integers(0, VOCAB, (ROWS, LENGTH), dtype=np.int32)
    batch = {"tokens": tokens, "positions": np.asarray(document_positions(segments)), "segments": segments}
    return {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(np.roll(tokens, -1, axis=1))


BATCH = packed_batch()

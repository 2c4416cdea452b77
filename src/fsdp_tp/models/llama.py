"""A language model written the way Gemma and Llama are, in Linen and in NNX, and its
Megatron plan as tp rules: the proof model of einsum tensor parallelism and the benchmark's.

Einsum projections (``nn.Einsum`` / ``nnx.Einsum``): a query einsum and a separate key/value
einsum with fewer kv heads (grouped-query attention, Gemma's stacked ``CDKH`` kernel), RoPE,
an output einsum; a gated MLP ``down(silu(gate(x)) * up(x))`` of einsums; RMSNorm; logits
tied to the embedding. The attention computes from its inputs' shapes (never from a head
count attribute), as a model must for its projections to run on slices of the heads.
Both front ends' models have the same parameter paths, so :data:`RULES` names both.

>>> import jax, jax.numpy as jnp
>>> model = LlamaLM()
>>> params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
>>> params["block_0"]["attn"]["kv"]["kernel"].shape  # (C: k and v, D, K: kv heads, H)
(2, 16, 2, 4)
>>> model.apply({"params": params}, jnp.zeros((1, 8), jnp.int32)).shape  # tied logits
(1, 8, 32)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fsdp_tp.attention import attend
from fsdp_tp.tp import ColumnParallel, RowParallel, VocabParallel

__all__ = ["FSDP_RULES", "RULES", "SIZES", "LlamaLM", "NNXLlamaLM", "attention"]

SIZES = dict(vocab=32, d=16, heads=4, kv_heads=2, head_dim=4, hidden=32, layers=2)

# The Megatron plan, one rule per projection (identical paths in both front ends):
# heads split over `tensor` (the kv einsum on its kv heads 'K', not its stacked 'C'), the
# output and down einsums row-parallel, the embedding (and so the tied logits) by vocabulary.
RULES = [
    (r"embed$", VocabParallel()),
    (r"attn/q$", ColumnParallel()),
    (r"attn/kv$", ColumnParallel(letter="K")),
    (r"attn/out$", RowParallel()),
    (r"mlp/(gate|up)$", ColumnParallel()),
    (r"mlp/down$", RowParallel()),
]
# FSDP on the dim each kernel's tp split leaves whole (its model dim 'D'), the embedding's
# on its model dim too: the tied embedding is split on its vocabulary over `tensor`.
FSDP_RULES = [
    (r"attn/q/kernel$", P("fsdp")),
    (r"attn/kv/kernel$", P(None, "fsdp")),
    (r"attn/out/kernel$", P(None, None, "fsdp")),
    (r"mlp/(gate|up)/kernel$", P("fsdp")),
    (r"mlp/down/kernel$", P(None, "fsdp")),
    (r"embedding$", P(None, "fsdp")),
]


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding on ``x`` (..., seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10_000 ** (jnp.arange(half, dtype=x.dtype) / half))
    angle = positions[..., None, None] * freq  # (positions (seq,) or (batch, seq))
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention: ``q`` (B, T, N, H), ``k``/``v`` (B, S, K, H), N a
    multiple of K (query head n reads kv head n // (N / K)); every size from the shapes.
    ``positions`` (B, T): each token's, given with the batch, and the library's attention
    (:func:`~fsdp_tp.attention.attend`, computed across devices under a sequence split); else
    ``0 .. T-1``, and the einsums here."""
    if positions is not None:
        return attend(rope(q, positions), rope(k, positions), v)
    b, t, n, h = q.shape
    kv = k.shape[-2]
    positions = jnp.arange(t, dtype=q.dtype)
    q, k = rope(q, positions), rope(k, positions)
    q = q.reshape(b, t, kv, n // kv, h) / jnp.sqrt(h).astype(q.dtype)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("BKGTS,BSKH->BTKGH", weights, v).reshape(b, t, n, h)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + scale)


class LinenAttention(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None  # the computation's (None: the parameters')

    @nn.compact
    def __call__(self, x, positions=None):
        d, kw = x.shape[-1], dict(param_dtype=self.param_dtype, dtype=self.dtype)
        q = nn.Einsum((d, self.heads, self.head_dim), "BTD,DNH->BTNH", False, name="q", **kw)(x)
        kv = nn.Einsum((2, d, self.kv_heads, self.head_dim), "BSD,CDKH->CBSKH", name="kv", **kw)(x)
        out = attention(q, kv[0], kv[1], positions)
        return nn.Einsum((self.heads, self.head_dim, d), "BTNH,NHD->BTD", name="out", **kw)(out)


class LinenMLP(nn.Module):
    hidden: int
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None  # the computation's (None: the parameters')

    @nn.compact
    def __call__(self, x):
        d, kw = x.shape[-1], dict(param_dtype=self.param_dtype, dtype=self.dtype)
        gate = nn.Einsum((d, self.hidden), "BTD,DF->BTF", False, name="gate", **kw)(x)
        up = nn.Einsum((d, self.hidden), "BTD,DF->BTF", False, name="up", **kw)(x)
        return nn.Einsum((self.hidden, d), "BTF,FD->BTD", False, name="down", **kw)(nn.silu(gate) * up)


class LinenBlock(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d, dtype = x.shape[-1], self.param_dtype
        attn = LinenAttention(self.heads, self.kv_heads, self.head_dim, dtype, name="attn")
        x = x + attn(rms_norm(x, self.param("attn_norm", nn.initializers.zeros, (d,), dtype)))
        mlp = LinenMLP(self.hidden, dtype, name="mlp")
        return x + mlp(rms_norm(x, self.param("mlp_norm", nn.initializers.zeros, (d,), dtype)))


class LlamaLM(nn.Module):
    """The Linen model: pre-RMSNorm blocks of GQA einsum attention and a gated einsum MLP."""

    vocab: int = SIZES["vocab"]
    d: int = SIZES["d"]
    heads: int = SIZES["heads"]
    kv_heads: int = SIZES["kv_heads"]
    head_dim: int = SIZES["head_dim"]
    hidden: int = SIZES["hidden"]
    layers: int = SIZES["layers"]
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        sizes, dtype = (self.heads, self.kv_heads, self.head_dim, self.hidden), self.param_dtype
        embed = nn.Embed(self.vocab, self.d, param_dtype=dtype, name="embed")
        x = embed(tokens)
        for i in range(self.layers):
            x = LinenBlock(*sizes, dtype, name=f"block_{i}")(x)
        final = self.param("final_norm", nn.initializers.zeros, (self.d,), self.param_dtype)
        return embed.attend(rms_norm(x, final))


class NNXAttention(nnx.Module):
    def __init__(self, d, heads, kv_heads, head_dim, *, rngs, param_dtype=jnp.float32, dtype=None):
        kv_shape, kw = (2, d, kv_heads, head_dim), dict(param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.q = nnx.Einsum("BTD,DNH->BTNH", (d, heads, head_dim), **kw)
        self.kv = nnx.Einsum("BSD,CDKH->CBSKH", kv_shape, kv_shape[:1] + kv_shape[2:], **kw)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, d), (d,), **kw)

    def __call__(self, x, positions=None):
        kv = self.kv(x)
        return self.out(attention(self.q(x), kv[0], kv[1], positions))


class NNXMLP(nnx.Module):
    def __init__(self, d, hidden, *, rngs, param_dtype=jnp.float32, dtype=None):
        kw = dict(param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.gate = nnx.Einsum("BTD,DF->BTF", (d, hidden), **kw)
        self.up = nnx.Einsum("BTD,DF->BTF", (d, hidden), **kw)
        self.down = nnx.Einsum("BTF,FD->BTD", (hidden, d), **kw)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class NNXBlock(nnx.Module):
    def __init__(self, d, heads, kv_heads, head_dim, hidden, *, rngs, param_dtype=jnp.float32):
        self.attn_norm = nnx.Param(jnp.zeros((d,), param_dtype))
        self.attn = NNXAttention(d, heads, kv_heads, head_dim, rngs=rngs, param_dtype=param_dtype)
        self.mlp_norm = nnx.Param(jnp.zeros((d,), param_dtype))
        self.mlp = NNXMLP(d, hidden, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        x = x + self.attn(rms_norm(x, self.attn_norm[...]))
        return x + self.mlp(rms_norm(x, self.mlp_norm[...]))


class NNXLlamaLM(nnx.Module):
    """The NNX model (its bias placement differs from the Linen one's: each front end's
    Einsum takes a bias its own way)."""

    def __init__(self, rngs: nnx.Rngs, param_dtype=jnp.float32, **sizes):
        s = {**SIZES, **sizes}
        self.embed = nnx.Embed(s["vocab"], s["d"], param_dtype=param_dtype, rngs=rngs)
        block = (s["d"], s["heads"], s["kv_heads"], s["head_dim"], s["hidden"])
        blocks = [NNXBlock(*block, rngs=rngs, param_dtype=param_dtype) for _ in range(s["layers"])]
        self.blocks = nnx.List(blocks)
        self.final_norm = nnx.Param(jnp.zeros((s["d"],), param_dtype))

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(rms_norm(x, self.final_norm[...]))

"""The decoder LM a Hugging Face ``config.json`` describes, in Linen and in NNX, computing what
the Hub's own implementation computes.

What it computes is :class:`~fsdp_tp.hub.config.DecoderConfig`'s (read from ``config.json``):
Llama's blocks, and Qwen's, Mistral's, Phi-3's and Gemma 3's differences, each a field. The
numerics both front ends share are written once here (norm, RoPE and attention, gate,
embedding scale, soft-cap); the modules only hold the parameters.

A mixture of experts (Qwen 3 MoE's) is the library's block (:class:`~fsdp_tp.models.moe.LinenMoE`,
``block_1/moe/router`` and the bank ``block_1/moe/experts/gate`` of ``(E, d, h)``): dropless,
softmax then top-k, as transformers routes.

Einsum projections, one per Hub weight (``q``, ``k``, ``v``, ``out``; ``gate``, ``up``,
``down``), so the Megatron plan is one rule a projection (:mod:`fsdp_tp.hub.layout`); the attention is
the library's (:func:`~fsdp_tp.attention.attend`: under a sequence split, computed across
devices). Both front ends' parameters have the same paths, ``block_0/attn/q/kernel``, so one
mapping from the checkpoint's names serves both (:mod:`fsdp_tp.hub.families`).

>>> import jax, jax.numpy as jnp
>>> config = DecoderConfig(vocab=64, d=32, heads=4, kv_heads=2, head_dim=8, hidden=48, layers=2)
>>> model = Decoder(config)
>>> params = model.init(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))["params"]
>>> logits = model.apply({"params": params}, jnp.zeros((1, 6), jnp.int32))
>>> params["block_0"]["attn"]["q"]["kernel"].shape, logits.shape
((32, 4, 8), (1, 6, 64))
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..attention import attend
from ..models.moe import LinenMoE, NNXMoE
from .config import DecoderConfig, rope_frequencies

__all__ = ["Decoder", "NNXDecoder"]


def _rope(x: jax.Array, positions: jax.Array, inv: np.ndarray) -> jax.Array:
    """RoPE on ``x`` (B, T, N, H): the two halves of each head rotated, as transformers' ``rotate_half``."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # (B or 1, T, H/2)
    cos, sin = (
        jnp.concatenate([f, f], -1)[..., None, :].astype(x.dtype) for f in (jnp.cos(angle), jnp.sin(angle))
    )
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _norm(c: DecoderConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """transformers' RMSNorm, normalized in float32 at least: Llama's scales the result cast back
    by ``weight``; Gemma's scales in float32 by ``1 + weight``, then casts."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + c.norm_eps)
    if c.norm_offset:
        return (normed * (c.norm_offset + weight.astype(wide.dtype))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def _norm_init(c: DecoderConfig):
    """A norm's weight at init: ones (scale 1), or Gemma's zeros (scale 1 + 0); float32 as the
    projections' are (flax's default: under ``jax.enable_x64`` an initializer's is float64)."""
    return nn.initializers.zeros if c.norm_offset else nn.initializers.ones


def _attention(c: DecoderConfig, layer: int, q, k, v, positions, segments) -> jax.Array:
    """RoPE (the layer's frequencies) then the library's attention (the layer's window); Gemma's
    scores scaled by ``query_scale ** -0.5`` in place of ``head_dim ** -0.5``, on the queries."""
    inv = rope_frequencies(c, layer)
    q, k = _rope(q, positions, inv), _rope(k, positions, inv)
    if c.query_scale is not None:
        q = q * jnp.asarray((c.head_dim / c.query_scale) ** 0.5, q.dtype)
    return attend(q, k, v, segment_ids=segments, window=c.window(layer))


def _gate(c: DecoderConfig, gate: jax.Array) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True) if c.activation == "gelu_tanh" else jax.nn.silu(gate)


def _embedded(c: DecoderConfig, x: jax.Array) -> jax.Array:
    """Gemma's embeddings times ``sqrt(d)`` (in the embedding's dtype, as transformers rounds it)."""
    return x * jnp.asarray(c.d**0.5, jnp.float32).astype(x.dtype) if c.embed_scale else x


def _capped(c: DecoderConfig, logits: jax.Array) -> jax.Array:
    """Gemma's final soft-cap, ``cap * tanh(logits / cap)``."""
    return logits if c.logit_cap is None else jnp.tanh(logits / c.logit_cap) * c.logit_cap


def _inputs(tokens, positions, segment_ids) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(tokens, positions, segment_ids)`` from the arguments or from a batch mapping given as
    ``tokens`` (``{"tokens", "positions", "segment_ids"}``, as the library's packed batches):
    positions ``0 .. T-1`` where none are given."""
    if isinstance(tokens, Mapping):
        tokens, positions, segment_ids = (tokens.get(k) for k in ("tokens", "positions", "segment_ids"))
    positions = jnp.arange(tokens.shape[-1])[None] if positions is None else positions
    return tokens, positions, segment_ids


class _LinenAttention(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segments):
        c = self.config
        q = nn.Einsum((c.d, c.heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="q")(x)
        k = nn.Einsum((c.d, c.kv_heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="k")(x)
        v = nn.Einsum((c.d, c.kv_heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="v")(x)
        if c.qk_norm:
            q = _norm(c, q, self.param("q_norm", _norm_init(c), (c.head_dim,), jnp.float32))
            k = _norm(c, k, self.param("k_norm", _norm_init(c), (c.head_dim,), jnp.float32))
        attended = _attention(c, self.layer, q, k, v, positions, segments)
        return nn.Einsum((c.heads, c.head_dim, c.d), "BTNH,NHD->BTD", False, name="out")(attended)


class _LinenMLP(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        gate = nn.Einsum((c.d, c.hidden), "BTD,DF->BTF", False, name="gate")(x)
        up = nn.Einsum((c.d, c.hidden), "BTD,DF->BTF", False, name="up")(x)
        return nn.Einsum((c.hidden, c.d), "BTF,FD->BTD", False, name="down")(_gate(c, gate) * up)


class _LinenBlock(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segments):
        c = self.config
        norm = lambda name, h: _norm(c, h, self.param(name, _norm_init(c), (c.d,), jnp.float32))
        h = _LinenAttention(c, self.layer, name="attn")(norm("attn_norm", x), positions, segments)
        x = x + (norm("attn_post_norm", h) if c.sandwich_norms else h)
        h = norm("mlp_norm", x)
        if c.mixture(self.layer):  # (its load-balancing and z-losses left out, as transformers' logits)
            moe = LinenMoE(c.experts, c.top_k, c.expert_hidden, normalize=c.normalize_top_k, name="moe")
            h = moe(h)[0]
        else:
            h = _LinenMLP(c, name="mlp")(h)
        return x + (norm("mlp_post_norm", h) if c.sandwich_norms else h)


class _LinenLayer(_LinenBlock):
    """A block as ``nn.scan`` runs it: ``(carry, output)``."""

    def __call__(self, x, positions, segments):
        return super().__call__(x, positions, segments), None


class Decoder(nn.Module):
    """The Linen decoder: ``tokens`` (B, T) to logits (B, T, V); ``positions`` (B, T), each
    token's, and ``segment_ids`` (B, T) of packed documents (0: padding), or all three in a
    mapping given as ``tokens``. Under a sequence split the positions must come with the batch."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None):
        c = self.config
        tokens, positions, segments = _inputs(tokens, positions, segment_ids)
        embed = nn.Embed(c.vocab, c.d, name="embed")
        x = _embedded(c, embed(tokens))
        if c.scan:  # (one traced layer; its parameters stacked on a leading layer dim, "blocks")
            c.require_uniform()
            stack = nn.scan(
                _LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers,
                in_axes=(nn.broadcast, nn.broadcast), metadata_params={nn.PARTITION_NAME: None},
            )  # fmt: skip
            x, _ = stack(c, 0, name="blocks")(x, positions, segments)
        for i in range(0 if c.scan else c.layers):
            x = _LinenBlock(c, i, name=f"block_{i}")(x, positions, segments)
        x = _norm(c, x, self.param("final_norm", _norm_init(c), (c.d,), jnp.float32))
        if c.tied:
            return _capped(c, embed.attend(x))
        return _capped(c, nn.Einsum((c.d, c.vocab), "BTD,DV->BTV", False, name="head")(x))


def _weight(c: DecoderConfig, size: int) -> nnx.Param:
    """An NNX norm's weight at init (:func:`_norm_init`'s)."""
    return nnx.Param((jnp.zeros if c.norm_offset else jnp.ones)((size,), jnp.float32))


class _NNXAttention(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs, layer: int = 0):
        self.config, self.layer = c, layer
        bias = lambda n: (n, c.head_dim) if c.qkv_bias else None
        self.q = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.heads, c.head_dim), bias(c.heads), rngs=rngs)
        self.k = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.kv_heads, c.head_dim), bias(c.kv_heads), rngs=rngs)
        self.v = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.kv_heads, c.head_dim), bias(c.kv_heads), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (c.heads, c.head_dim, c.d), None, rngs=rngs)
        if c.qk_norm:
            self.q_norm, self.k_norm = _weight(c, c.head_dim), _weight(c, c.head_dim)

    def __call__(self, x, positions, segments):
        c = self.config
        q, k = self.q(x), self.k(x)
        if c.qk_norm:
            q, k = _norm(c, q, self.q_norm[...]), _norm(c, k, self.k_norm[...])
        return self.out(_attention(c, self.layer, q, k, self.v(x), positions, segments))


class _NNXMLP(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        self.config = c
        self.gate = nnx.Einsum("BTD,DF->BTF", (c.d, c.hidden), None, rngs=rngs)
        self.up = nnx.Einsum("BTD,DF->BTF", (c.d, c.hidden), None, rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (c.hidden, c.d), None, rngs=rngs)

    def __call__(self, x):
        return self.down(_gate(self.config, self.gate(x)) * self.up(x))


class _NNXBlock(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs, layer: int = 0):
        self.config = c
        self.attn_norm = _weight(c, c.d)
        self.attn = _NNXAttention(c, rngs, layer)
        self.mlp_norm = _weight(c, c.d)
        if c.mixture(layer):
            normalize = c.normalize_top_k
            self.moe = NNXMoE(c.d, c.experts, c.top_k, c.expert_hidden, rngs=rngs, normalize=normalize)
        else:
            self.mlp = _NNXMLP(c, rngs)
        self.layer = layer
        if c.sandwich_norms:
            self.attn_post_norm, self.mlp_post_norm = _weight(c, c.d), _weight(c, c.d)

    def __call__(self, x, positions, segments):
        c = self.config
        h = self.attn(_norm(c, x, self.attn_norm[...]), positions, segments)
        x = x + (_norm(c, h, self.attn_post_norm[...]) if c.sandwich_norms else h)
        h = _norm(c, x, self.mlp_norm[...])
        h = self.moe(h)[0] if c.mixture(self.layer) else self.mlp(h)
        return x + (_norm(c, h, self.mlp_post_norm[...]) if c.sandwich_norms else h)


class NNXDecoder(nnx.Module):
    """The NNX decoder, the Linen one's parameter paths (``block_0/attn/q/kernel``)."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab, c.d, rngs=rngs)
        # (NNX's Embed fixes its compute dtype to the init's, float32: it would round what a
        # load puts there, float64 say; None computes in the parameters' dtype, as Linen's does)
        self.embed.dtype = None
        if c.scan:  # (stacked on a leading layer dim, as nn.scan stacks Linen's: "blocks")
            c.require_uniform()

            @nnx.split_rngs(splits=c.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return _NNXBlock(c, rngs, 0)

            self.blocks = stack(rngs)
        for i in range(0 if c.scan else c.layers):  # (named as Linen names them: one mapping serves both)
            setattr(self, f"block_{i}", _NNXBlock(c, rngs, i))
        self.final_norm = _weight(c, c.d)
        if not c.tied:
            self.head = nnx.Einsum("BTD,DV->BTV", (c.d, c.vocab), None, rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        c = self.config
        tokens, positions, segments = _inputs(tokens, positions, segment_ids)
        x = _embedded(c, self.embed(tokens))
        if c.scan:
            run = lambda block, x, positions, segments: block(x, positions, segments)
            x = nnx.scan(run, in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)(
                self.blocks, x, positions, segments
            )
        for i in range(0 if c.scan else c.layers):
            x = getattr(self, f"block_{i}")(x, positions, segments)
        x = _norm(c, x, self.final_norm[...])
        return _capped(c, self.embed.attend(x) if c.tied else self.head(x))

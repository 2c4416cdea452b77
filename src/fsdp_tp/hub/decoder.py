"""The decoder LM a Hugging Face ``config.json`` describes, in Linen and in NNX, computing what
the Hub's own implementation computes.

What it computes is :class:`~fsdp_tp.hub.config.DecoderConfig`'s (read from ``config.json``):
Llama's blocks, and Qwen's, Mistral's, Phi-3's and Gemma 3's differences, each a field. The
numerics both front ends share are written once (:mod:`fsdp_tp.hub.numerics`); the modules
here only hold the parameters.

A mixture of experts (Qwen 3 MoE's) is the library's block (:class:`~fsdp_tp.models.moe.LinenMoE`,
``block_1/moe/router`` and the bank ``block_1/moe/experts/gate`` of ``(E, d, h)``): dropless,
softmax then top-k, as transformers routes.

Einsum projections (or ``nn.Dense`` / ``nnx.Linear`` ones: ``DecoderConfig(dense=True)``),
one per Hub weight (``q``, ``k``, ``v``, ``out``; ``gate``, ``up``, ``down``), so the Megatron
plan is one rule a projection (:mod:`fsdp_tp.hub.layout`); the attention is the library's
(:func:`~fsdp_tp.attention.attend`: under a sequence split, computed across devices). Both
front ends' parameters have the same paths, ``block_0/attn/q/kernel``, so one mapping from the
checkpoint's names serves both (:mod:`fsdp_tp.hub.families`).

>>> import jax, jax.numpy as jnp
>>> config = DecoderConfig(vocab=64, d=32, heads=4, kv_heads=2, head_dim=8, hidden=48, layers=2)
>>> model = Decoder(config)
>>> params = model.init(jax.random.key(0), jnp.zeros((1, 6), jnp.int32))["params"]
>>> logits = model.apply({"params": params}, jnp.zeros((1, 6), jnp.int32))
>>> params["block_0"]["attn"]["q"]["kernel"].shape, logits.shape
((32, 4, 8), (1, 6, 64))
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from ..models.moe import LinenMoE, NNXMoE
from . import numerics
from .config import DecoderConfig

__all__ = ["Decoder", "NNXDecoder"]


def _linen_linear(c: DecoderConfig, features_in: int, features: int, name: str) -> nn.Module:
    """A bias-free ``(in, out)`` projection: ``nn.Dense``, or the einsum of the same kernel."""
    if c.dense:
        return nn.Dense(features, use_bias=False, name=name)
    return nn.Einsum((features_in, features), "BTD,DF->BTF", False, name=name)


def _nnx_linear(c: DecoderConfig, features_in: int, features: int, rngs: nnx.Rngs) -> nnx.Module:
    """:func:`_linen_linear` in NNX: ``nnx.Linear`` or ``nnx.Einsum``."""
    if c.dense:
        return nnx.Linear(features_in, features, use_bias=False, rngs=rngs)
    return nnx.Einsum("BTD,DF->BTF", (features_in, features), None, rngs=rngs)


class _LinenAttention(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segments):
        c = self.config
        if c.dense:  # (N * H output features, read as N heads: a device's N / T under the split)
            dense = lambda n, name: nn.Dense(n * c.head_dim, use_bias=c.qkv_bias, name=name)(x)
            project = lambda n, name: numerics.heads(c, dense(n, name))
        else:
            kernel = lambda n: (c.d, n, c.head_dim)
            project = lambda n, name: nn.Einsum(kernel(n), "BTD,DNH->BTNH", c.qkv_bias, name=name)(x)
        q, k, v = project(c.heads, "q"), project(c.kv_heads, "k"), project(c.kv_heads, "v")
        if c.qk_norm:
            q = numerics.rms_norm(
                c, q, self.param("q_norm", numerics.norm_init(c), (c.head_dim,), jnp.float32)
            )
            k = numerics.rms_norm(
                c, k, self.param("k_norm", numerics.norm_init(c), (c.head_dim,), jnp.float32)
            )
        attended = numerics.attention(c, self.layer, q, k, v, positions, segments)
        if c.dense:
            return nn.Dense(c.d, use_bias=False, name="out")(numerics.flat(attended))
        return nn.Einsum((c.heads, c.head_dim, c.d), "BTNH,NHD->BTD", False, name="out")(attended)


class _LinenMLP(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        gate, up = _linen_linear(c, c.d, c.hidden, "gate")(x), _linen_linear(c, c.d, c.hidden, "up")(x)
        return _linen_linear(c, c.hidden, c.d, "down")(numerics.gate(c, gate) * up)


class _LinenBlock(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segments):
        c = self.config
        norm = lambda name, h: numerics.rms_norm(
            c, h, self.param(name, numerics.norm_init(c), (c.d,), jnp.float32)
        )
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
        tokens, positions, segments = numerics.inputs(tokens, positions, segment_ids)
        embed = nn.Embed(c.vocab, c.d, name="embed")
        x = numerics.embedded(c, embed(tokens))
        if c.scan:  # (one traced layer; its parameters stacked on a leading layer dim, "blocks")
            c.require_uniform()
            stack = nn.scan(
                _LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers,
                in_axes=(nn.broadcast, nn.broadcast), metadata_params={nn.PARTITION_NAME: None},
            )  # fmt: skip
            x, _ = stack(c, 0, name="blocks")(x, positions, segments)
        for i in range(0 if c.scan else c.layers):
            x = _LinenBlock(c, i, name=f"block_{i}")(x, positions, segments)
        x = numerics.rms_norm(c, x, self.param("final_norm", numerics.norm_init(c), (c.d,), jnp.float32))
        if c.tied:
            return numerics.capped(c, embed.attend(x))
        return numerics.capped(c, _linen_linear(c, c.d, c.vocab, "head")(x))


def _weight(c: DecoderConfig, size: int) -> nnx.Param:
    """An NNX norm's weight at init (:func:`norm_init`'s)."""
    return nnx.Param((jnp.zeros if c.norm_offset else jnp.ones)((size,), jnp.float32))


class _NNXAttention(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs, layer: int = 0):
        self.config, self.layer = c, layer
        project: Callable[[int], nnx.Module]
        if c.dense:
            project = lambda n: nnx.Linear(c.d, n * c.head_dim, use_bias=c.qkv_bias, rngs=rngs)
            self.out: nnx.Module = nnx.Linear(c.heads * c.head_dim, c.d, use_bias=False, rngs=rngs)
        else:
            bias = lambda n: (n, c.head_dim) if c.qkv_bias else None
            project = lambda n: nnx.Einsum("BTD,DNH->BTNH", (c.d, n, c.head_dim), bias(n), rngs=rngs)
            self.out = nnx.Einsum("BTNH,NHD->BTD", (c.heads, c.head_dim, c.d), None, rngs=rngs)
        self.q, self.k, self.v = project(c.heads), project(c.kv_heads), project(c.kv_heads)
        if c.qk_norm:
            self.q_norm, self.k_norm = _weight(c, c.head_dim), _weight(c, c.head_dim)

    def __call__(self, x, positions, segments):
        c = self.config
        shaped = (lambda h: numerics.heads(c, h)) if c.dense else (lambda h: h)
        q, k, v = shaped(self.q(x)), shaped(self.k(x)), shaped(self.v(x))
        if c.qk_norm:
            q, k = numerics.rms_norm(c, q, self.q_norm[...]), numerics.rms_norm(c, k, self.k_norm[...])
        attended = numerics.attention(c, self.layer, q, k, v, positions, segments)
        return self.out(numerics.flat(attended) if c.dense else attended)


class _NNXMLP(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        self.config = c
        self.gate, self.up = _nnx_linear(c, c.d, c.hidden, rngs), _nnx_linear(c, c.d, c.hidden, rngs)
        self.down = _nnx_linear(c, c.hidden, c.d, rngs)

    def __call__(self, x):
        return self.down(numerics.gate(self.config, self.gate(x)) * self.up(x))


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
        h = self.attn(numerics.rms_norm(c, x, self.attn_norm[...]), positions, segments)
        x = x + (numerics.rms_norm(c, h, self.attn_post_norm[...]) if c.sandwich_norms else h)
        h = numerics.rms_norm(c, x, self.mlp_norm[...])
        h = self.moe(h)[0] if c.mixture(self.layer) else self.mlp(h)
        return x + (numerics.rms_norm(c, h, self.mlp_post_norm[...]) if c.sandwich_norms else h)


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
            self.head = _nnx_linear(c, c.d, c.vocab, rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        c = self.config
        tokens, positions, segments = numerics.inputs(tokens, positions, segment_ids)
        x = numerics.embedded(c, self.embed(tokens))
        if c.scan:
            run = lambda block, x, positions, segments: block(x, positions, segments)
            x = nnx.scan(run, in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)(
                self.blocks, x, positions, segments
            )
        for i in range(0 if c.scan else c.layers):
            x = getattr(self, f"block_{i}")(x, positions, segments)
        x = numerics.rms_norm(c, x, self.final_norm[...])
        return numerics.capped(c, self.embed.attend(x) if c.tied else self.head(x))

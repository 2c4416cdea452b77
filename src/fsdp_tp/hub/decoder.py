"""The decoder LM a Hugging Face ``config.json`` describes, in Linen and in NNX, computing what
the Hub's own implementation computes.

:class:`DecoderConfig` reads the sizes, the RMSNorm's epsilon, the RoPE (its ``theta`` and its
``llama3`` scaling, under ``rope_scaling`` or transformers 5's ``rope_parameters``), whether
the head is tied, Qwen 2's q/k/v biases, Qwen 3's per-head q/k norms and each layer's sliding
window (Mistral, Phi-3, Qwen's windowed layers); a config this decoder does not compute
(another ``model_type``, another RoPE scaling, an output bias) is refused, naming the key and
what it supports — never run approximately.

Einsum projections, one per Hub weight (``q``, ``k``, ``v``, ``out``; ``gate``, ``up``,
``down``), so the Megatron plan is one rule a projection (:func:`tp_rules`); the attention is
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

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..attention import attend
from ..errors import CheckpointMismatchError
from ..tp import ColumnParallel, RowParallel, VocabParallel

__all__ = ["Decoder", "DecoderConfig", "NNXDecoder", "fsdp_rules", "rope_frequencies", "tp_rules"]

_FAMILIES = ("llama", "mistral", "phi3", "qwen2", "qwen3")


def tp_rules(config: DecoderConfig, gather_logits: bool = False) -> list:
    """The Megatron plan: heads over ``tensor`` (q, k, v column-parallel on their heads, the
    output einsum row-parallel), the MLP's gate and up column-, down row-parallel, the
    embedding (so a tied head) by vocabulary, an untied head column-parallel: its logits split
    on the vocabulary for :func:`~fsdp_tp.vocab_parallel_cross_entropy`, or whole where
    ``gather_logits`` (for a loss that reads them whole, as ``check_sharded``'s twin does)."""
    rules = [
        (r"embed$", VocabParallel()),
        (r"attn/(q|k|v)$", ColumnParallel()),
        (r"attn/out$", RowParallel()),
        (r"mlp/(gate|up)$", ColumnParallel()),
        (r"mlp/down$", RowParallel()),
    ]
    return rules if config.tied else [*rules, (r"head$", ColumnParallel(gather_output=gather_logits))]


def fsdp_rules(config: DecoderConfig, axes: str | tuple[str, ...] = "fsdp") -> list:
    """Storage rules for FSDP over ``axes`` (``("fsdp", "context")`` where the sequence is split
    too): each kernel on its model dim ``D``, the dim :func:`tp_rules` leave whole, the
    embedding on its model dim (its vocabulary goes over ``tensor``); norms and biases stay
    replicated.

    >>> fsdp_rules(DecoderConfig(64, 32, 4, 2, 8, 48, 2))[0]
    ('attn/(q|k|v)/kernel$', P('fsdp',))
    """
    rules = [
        (r"attn/(q|k|v)/kernel$", P(axes)),
        (r"attn/out/kernel$", P(None, None, axes)),
        (r"mlp/(gate|up)/kernel$", P(axes)),
        (r"mlp/down/kernel$", P(None, axes)),
        (r"embedding$", P(None, axes)),
    ]
    return rules if config.tied else [*rules, (r"head/kernel$", P(axes))]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The sizes and numerics of a decoder; :meth:`from_hub` reads them from ``config.json``."""

    vocab: int
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3's factors, sorted (hashable)
    tied: bool = False
    qkv_bias: bool = False  # (Qwen 2's q, k and v projections)
    qk_norm: bool = False  # (Qwen 3's RMSNorm of each query and key head, before RoPE)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (none: every layer whole)
    family: str = "llama"  # (config.json's model_type: the names its checkpoints store)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window: each query sees itself and ``window - 1`` before it."""
        return self.windows[layer] if self.windows else None

    @classmethod
    def from_hub(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """The decoder of a Hugging Face ``config.json`` (its parsed object)."""
        family = config.get("model_type")
        if family not in _FAMILIES:
            raise CheckpointMismatchError(
                f"config.json: model_type {family!r} is not one the decoder computes ({list(_FAMILIES)}); "
                f"write a DecoderConfig and a mapping for it (fsdp_tp.hub.mapping.Rule)."
            )
        # Qwen 2 always has q/k/v biases; Llama's and Qwen 3's attention_bias puts one on the
        # output projection too, which the decoder does not hold (nor an MLP's biases).
        unsupported = [key for key in ("attention_bias", "mlp_bias") if config.get(key, False)]
        if unsupported:
            raise CheckpointMismatchError(
                f"config.json: {', '.join(unsupported)} is not computed by the decoder yet; a {family} "
                f"checkpoint with it would load into a model that computes otherwise."
            )
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", config.get("rope_theta", 10_000.0))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        partial = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise CheckpointMismatchError(
                f"config.json: partial_rotary_factor={partial} (RoPE on part of each head) is not computed "
                f"by the decoder; it rotates whole heads."
            )
        if kind not in ("default", "llama3"):
            raise CheckpointMismatchError(
                f"config.json: RoPE type {kind!r} is not computed by the decoder (it computes 'default' and "
                f"'llama3'); its frequencies would differ from the Hub's."
            )
        heads = config["num_attention_heads"]
        return cls(
            vocab=config["vocab_size"],
            d=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            hidden=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted((k, float(v)) for k, v in rope.items())) if kind == "llama3" else (),
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            windows=_windows(config),
            family=family,
        )


def _windows(config: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window from ``config.json``: its ``layer_types`` where it names them
    (``sliding_attention`` layers windowed), else Qwen 2's ``use_sliding_window`` (layers from
    ``max_window_layers`` on), else Mistral's and Phi-3's ``sliding_window`` (every layer)."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    if window is None:
        return ()
    if "layer_types" in config:
        kinds = config["layer_types"]
    elif "use_sliding_window" in config:  # (Qwen 2 and 3 without layer_types)
        first = config.get("max_window_layers", layers) if config["use_sliding_window"] else layers
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    else:
        kinds = ["sliding_attention"] * layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else ()


def rope_frequencies(config: DecoderConfig) -> np.ndarray:
    """The RoPE's inverse frequencies, ``(head_dim // 2,)`` float32, as transformers computes
    them (in float32), llama3's scaling applied: low frequencies divided by ``factor``, the
    band between smoothly interpolated.

    >>> rope_frequencies(DecoderConfig(1, 8, 1, 1, 8, 8, 1)).tolist()
    [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513]
    """
    half = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    inv = (np.float32(1.0) / np.float32(config.rope_theta) ** half).astype(np.float32)
    if not config.rope_scaling:
        return inv
    s = dict(config.rope_scaling)
    factor, low, high = (np.float32(s[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = np.float32(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope(x: jax.Array, positions: jax.Array, inv: np.ndarray) -> jax.Array:
    """RoPE on ``x`` (B, T, N, H): the two halves of each head rotated, as transformers' ``rotate_half``."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # (B or 1, T, H/2)
    cos, sin = (
        jnp.concatenate([f, f], -1)[..., None, :].astype(x.dtype) for f in (jnp.cos(angle), jnp.sin(angle))
    )
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' ``LlamaRMSNorm``: normalized in float32 at least, then scaled by ``weight``."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


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
    window: int | None = None

    @nn.compact
    def __call__(self, x, positions, segments):
        c, inv = self.config, rope_frequencies(self.config)
        q = nn.Einsum((c.d, c.heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="q")(x)
        k = nn.Einsum((c.d, c.kv_heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="k")(x)
        v = nn.Einsum((c.d, c.kv_heads, c.head_dim), "BTD,DNH->BTNH", c.qkv_bias, name="v")(x)
        if c.qk_norm:
            ones = nn.initializers.ones
            q = _rms_norm(q, self.param("q_norm", ones, (c.head_dim,)), c.norm_eps)
            k = _rms_norm(k, self.param("k_norm", ones, (c.head_dim,)), c.norm_eps)
        attended = attend(
            _rope(q, positions, inv), _rope(k, positions, inv), v, segment_ids=segments, window=self.window
        )
        return nn.Einsum((c.heads, c.head_dim, c.d), "BTNH,NHD->BTD", False, name="out")(attended)


class _LinenMLP(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        gate = nn.Einsum((c.d, c.hidden), "BTD,DF->BTF", False, name="gate")(x)
        up = nn.Einsum((c.d, c.hidden), "BTD,DF->BTF", False, name="up")(x)
        return nn.Einsum((c.hidden, c.d), "BTF,FD->BTD", False, name="down")(nn.silu(gate) * up)


class _LinenBlock(nn.Module):
    config: DecoderConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, segments):
        c, ones = self.config, nn.initializers.ones
        h = _rms_norm(x, self.param("attn_norm", ones, (c.d,)), c.norm_eps)
        x = x + _LinenAttention(c, c.window(self.layer), name="attn")(h, positions, segments)
        return x + _LinenMLP(c, name="mlp")(_rms_norm(x, self.param("mlp_norm", ones, (c.d,)), c.norm_eps))


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
        x = embed(tokens)
        for i in range(c.layers):
            x = _LinenBlock(c, i, name=f"block_{i}")(x, positions, segments)
        x = _rms_norm(x, self.param("final_norm", nn.initializers.ones, (c.d,)), c.norm_eps)
        if c.tied:
            return embed.attend(x)
        return nn.Einsum((c.d, c.vocab), "BTD,DV->BTV", False, name="head")(x)


class _NNXAttention(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs, window: int | None = None):
        self.config, self.window = c, window
        bias = lambda n: (n, c.head_dim) if c.qkv_bias else None
        self.q = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.heads, c.head_dim), bias(c.heads), rngs=rngs)
        self.k = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.kv_heads, c.head_dim), bias(c.kv_heads), rngs=rngs)
        self.v = nnx.Einsum("BTD,DNH->BTNH", (c.d, c.kv_heads, c.head_dim), bias(c.kv_heads), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (c.heads, c.head_dim, c.d), None, rngs=rngs)
        if c.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((c.head_dim,)))
            self.k_norm = nnx.Param(jnp.ones((c.head_dim,)))

    def __call__(self, x, positions, segments):
        c, inv = self.config, rope_frequencies(self.config)
        q, k = self.q(x), self.k(x)
        if c.qk_norm:
            q, k = _rms_norm(q, self.q_norm[...], c.norm_eps), _rms_norm(k, self.k_norm[...], c.norm_eps)
        q, k = _rope(q, positions, inv), _rope(k, positions, inv)
        return self.out(attend(q, k, self.v(x), segment_ids=segments, window=self.window))


class _NNXMLP(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        self.gate = nnx.Einsum("BTD,DF->BTF", (c.d, c.hidden), None, rngs=rngs)
        self.up = nnx.Einsum("BTD,DF->BTF", (c.d, c.hidden), None, rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (c.hidden, c.d), None, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class _NNXBlock(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs, layer: int = 0):
        self.eps = c.norm_eps
        self.attn_norm = nnx.Param(jnp.ones((c.d,)))
        self.attn = _NNXAttention(c, rngs, c.window(layer))
        self.mlp_norm = nnx.Param(jnp.ones((c.d,)))
        self.mlp = _NNXMLP(c, rngs)

    def __call__(self, x, positions, segments):
        x = x + self.attn(_rms_norm(x, self.attn_norm[...], self.eps), positions, segments)
        return x + self.mlp(_rms_norm(x, self.mlp_norm[...], self.eps))


class NNXDecoder(nnx.Module):
    """The NNX decoder, the Linen one's parameter paths (``block_0/attn/q/kernel``)."""

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab, c.d, rngs=rngs)
        for i in range(c.layers):  # (named as Linen names them: one mapping serves both)
            setattr(self, f"block_{i}", _NNXBlock(c, rngs, i))
        self.final_norm = nnx.Param(jnp.ones((c.d,)))
        if not c.tied:
            self.head = nnx.Einsum("BTD,DV->BTV", (c.d, c.vocab), None, rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        c = self.config
        tokens, positions, segments = _inputs(tokens, positions, segment_ids)
        x = self.embed(tokens)
        for i in range(c.layers):
            x = getattr(self, f"block_{i}")(x, positions, segments)
        x = _rms_norm(x, self.final_norm[...], c.norm_eps)
        return self.embed.attend(x) if c.tied else self.head(x)

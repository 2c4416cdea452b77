"""What a Hugging Face ``config.json`` asks a decoder to compute: :class:`DecoderConfig`.

:meth:`DecoderConfig.from_hub` reads the sizes, the RMSNorm (its epsilon; Gemma's ``1 + w``), the
RoPE (``theta``; llama3's or linear scaling; Gemma's own theta for its local layers), the head
(tied or not; Gemma's logit soft-cap), Qwen 2's q/k/v biases, per-head q/k norms (Qwen 3, Gemma
3), Gemma's embedding scale, sandwich norms, tanh-GELU and query scalar, each layer's sliding
window, and Qwen 3 MoE's mixture (its layers, experts, top-k). A config the decoder does not
compute (another ``model_type``, another RoPE, an output bias, a partial rotary factor, attention
soft-capping) is refused, naming the key — never run approximately.

>>> c = DecoderConfig.from_hub({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
...     "num_attention_heads": 4, "intermediate_size": 48, "num_hidden_layers": 2})
>>> c.head_dim, c.kv_heads, c.windows
(8, 4, ())
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointMismatchError

__all__ = ["FAMILIES", "DecoderConfig", "rope_frequencies"]

FAMILIES = ("gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe")
_ROPES = ("default", "llama3", "linear")


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
    rope_type: str = "default"  # (or llama3's, or linear: every frequency over its factor)
    rope_scaling: tuple[tuple[str, float], ...] = ()  # the scaling's factors, sorted (hashable)
    local_rope_theta: float | None = None  # (Gemma's windowed layers' own theta, unscaled)
    tied: bool = False
    qkv_bias: bool = False  # (Qwen 2's q, k and v projections)
    qk_norm: bool = False  # (Qwen 3's and Gemma 3's RMSNorm of each query and key head)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (none: every layer whole)
    norm_offset: float = 0.0  # (Gemma's norms scale by 1 + w)
    embed_scale: bool = False  # (Gemma's embeddings times sqrt(d))
    sandwich_norms: bool = False  # (Gemma's norms after the attention and after the MLP too)
    activation: str = "silu"  # (the MLP's gate: silu, or gelu_tanh)
    query_scale: float | None = None  # (Gemma's query_pre_attn_scalar: scores over its root)
    logit_cap: float | None = None  # (Gemma's final logits: cap * tanh(logits / cap))
    family: str = "llama"  # (config.json's model_type: the names its checkpoints store)
    experts: int = 0  # (Qwen 3 MoE's: the experts of each mixture layer; 0: every MLP dense)
    top_k: int = 0  # (the experts each token takes)
    expert_hidden: int = 0  # (each expert's MLP width)
    normalize_top_k: bool = False  # (a token's k weights renormalized to sum to 1)
    moe_layers: tuple[int, ...] = ()  # (the layers whose MLP is the mixture)
    scan: bool = False  # (the blocks in one nn.scan / nnx.scan, stacked on a leading layer dim)
    dense: bool = False  # (nn.Dense / nnx.Linear projections, (in, out) kernels: heads flattened)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window: each query sees itself and ``window - 1`` before it."""
        return self.windows[layer] if self.windows else None

    def require_uniform(self) -> None:
        """Refuses a scan over layers that compute differently (one traced layer for all):
        windows, RoPE or MLPs that differ by layer, naming them."""
        differ = []
        if len(set(self.windows)) > 1:
            differ.append(f"sliding windows {list(self.windows)}")
        if 0 < len(self.moe_layers) < self.layers:
            differ.append(f"mixture layers {list(self.moe_layers)} of {self.layers}")
        if differ:
            raise CheckpointMismatchError(
                f"DecoderConfig(scan=True): its layers differ ({'; '.join(differ)}), and a scan traces "
                f"one layer for all; unroll them (scan=False), as {self.family} is unrolled by default."
            )

    def mixture(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (else the dense MLP)."""
        return layer in self.moe_layers

    @classmethod
    def from_hub(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """The decoder of a Hugging Face ``config.json`` (its parsed object)."""
        family = config.get("model_type")
        if family not in FAMILIES:
            raise CheckpointMismatchError(
                f"config.json: model_type {family!r} is not one the decoder computes ({list(FAMILIES)}); "
                f"write a DecoderConfig and a mapping for it (fsdp_tp.hub.mapping.Rule)."
            )
        _refuse_unsupported(family, config)
        gemma = family == "gemma3_text"
        rope, local = _ropes(config, gemma)
        theta, kind = rope.pop("rope_theta"), rope.pop("rope_type")
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
            rope_type=kind,
            rope_scaling=tuple(sorted((k, float(v)) for k, v in rope.items())) if kind != "default" else (),
            local_rope_theta=local,
            tied=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            windows=_windows(config),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=gemma,
            sandwich_norms=gemma,
            activation="gelu_tanh" if config.get("hidden_activation") == "gelu_pytorch_tanh" else "silu",
            query_scale=float(config["query_pre_attn_scalar"]) if gemma else None,
            logit_cap=config.get("final_logit_softcapping") if gemma else None,
            family=family,
            **_experts(config),
        )


def _refuse_unsupported(family: str, config: Mapping[str, Any]) -> None:
    # Qwen 2 always has q/k/v biases; Llama's and Qwen 3's attention_bias puts one on the output
    # projection too, which the decoder does not hold (nor an MLP's biases).
    unsupported = [key for key in ("attention_bias", "mlp_bias") if config.get(key, False)]
    unsupported += [k for k in ("attn_logit_softcapping", "use_bidirectional_attention") if config.get(k)]
    activation = config.get("hidden_activation", config.get("hidden_act", "silu"))
    if activation not in ("silu", "gelu_pytorch_tanh"):
        unsupported.append(f"hidden activation {activation!r}")
    if unsupported:
        raise CheckpointMismatchError(
            f"config.json: {', '.join(unsupported)} is not computed by the decoder yet; a {family} "
            f"checkpoint with it would load into a model that computes otherwise."
        )


def _experts(config: Mapping[str, Any]) -> dict:
    """Qwen 3 MoE's mixture: every ``decoder_sparse_step``-th layer's MLP, but those of
    ``mlp_only_layers`` (transformers' own rule), softmax then top-k routing, dropless."""
    count = config.get("num_experts", config.get("num_local_experts", 0))
    if config.get("model_type") != "qwen3_moe" or not count:
        return {}
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    layers = range(config["num_hidden_layers"])
    return dict(
        experts=count,
        top_k=config["num_experts_per_tok"],
        expert_hidden=config["moe_intermediate_size"],
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
    )


def _ropes(config: Mapping[str, Any], gemma: bool) -> tuple[dict, float | None]:
    """The global layers' RoPE parameters (``rope_theta``, ``rope_type`` and the scaling's), and
    Gemma's local layers' theta; each refused where the decoder would rotate otherwise."""
    given = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    local = None
    if gemma:  # (a pair: the windowed layers' and the global ones')
        local_rope = dict(given.get("sliding_attention") or {})
        if local_rope.get("rope_type", "default") != "default":
            raise CheckpointMismatchError(
                f"config.json: the sliding layers' RoPE is {local_rope['rope_type']!r}; the decoder scales "
                f"only the global layers' (Gemma 3's own)."
            )
        local = float(local_rope.get("rope_theta", config.get("rope_local_base_freq", 10_000.0)))
        given = dict(given.get("full_attention") or {})
    rope = {
        "rope_theta": given.pop("rope_theta", config.get("rope_theta", 1_000_000.0 if gemma else 10_000.0))
    }
    rope["rope_type"] = given.pop("rope_type", given.pop("type", "default"))
    partial = given.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointMismatchError(
            f"config.json: partial_rotary_factor={partial} (RoPE on part of each head) is not computed "
            f"by the decoder; it rotates whole heads."
        )
    if rope["rope_type"] not in _ROPES:
        raise CheckpointMismatchError(
            f"config.json: RoPE type {rope['rope_type']!r} is not computed by the decoder (it computes "
            f"{list(_ROPES)}); its frequencies would differ from the Hub's."
        )
    return rope | given, local


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


def rope_frequencies(config: DecoderConfig, layer: int | None = None) -> np.ndarray:
    """The RoPE's inverse frequencies, ``(head_dim // 2,)`` float32, as transformers computes
    them (in float32): llama3's scaling (low frequencies over ``factor``, the band between
    smoothly interpolated) or linear (all over ``factor``). A windowed ``layer`` of a config with
    a local theta (Gemma 3's) rotates by that theta, unscaled.

    >>> rope_frequencies(DecoderConfig(1, 8, 1, 1, 8, 8, 1)).tolist()
    [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513]
    """
    local = layer is not None and config.local_rope_theta is not None and config.window(layer) is not None
    theta = config.local_rope_theta if local else config.rope_theta
    half = np.arange(0, config.head_dim, 2, dtype=np.float32) / np.float32(config.head_dim)
    inv = (np.float32(1.0) / np.float32(theta) ** half).astype(np.float32)
    if local or config.rope_type == "default":
        return inv
    s = dict(config.rope_scaling)
    factor = np.float32(s["factor"])
    if config.rope_type == "linear":
        return (inv / factor).astype(np.float32)
    low, high = np.float32(s["low_freq_factor"]), np.float32(s["high_freq_factor"])
    old = np.float32(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)

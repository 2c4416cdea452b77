"""The mappings from the Hub's checkpoint names to the decoder's parameters
(:mod:`fsdp_tp.hub.decoder`), a family each, written in :mod:`fsdp_tp.hub.mapping`'s rules.

transformers stores a Linear's weight ``(out, in)``; the decoder's einsum kernels are ``(in,
heads, head_dim)`` for q/k/v, ``(heads, head_dim, out)`` for the attention's output, ``(in,
out)`` for the MLP and the head. So each projection is a transpose, and the attention's a split
of ``heads * head_dim`` into its two dims. A mixture's experts, one tensor each in the checkpoint,
are stacked into the bank's leading expert dim (each at its index); a scanned decoder's layers
into the leading layer dim of ``blocks/...`` the same way.

>>> from fsdp_tp.hub.config import DecoderConfig
>>> rules, ignore = mapping(DecoderConfig(64, 32, 4, 2, 8, 48, 2))
>>> [rule.path for rule in rules][:3]
['embed/embedding', 'final_norm', 'head/kernel']
"""

from __future__ import annotations

import dataclasses

from .config import DecoderConfig
from .mapping import Rule, SplitDim, Take, Transpose, View

__all__ = ["mapping"]

_LAYER = r"model\.layers\.(\d+)\."
_BLOCK = "block_\\1/"  # (the layer's parameters, unrolled: the pattern's first group)


def mapping(config: DecoderConfig) -> tuple[list[Rule], list[str]]:
    """The rules that load a Llama-layout checkpoint into the decoder of ``config``, and the
    stored tensors to leave unread (older exports' rotary tables, which the decoder computes)."""
    linear: tuple[View, ...] = (Transpose(),)
    # (N*H, D) -> (D, N, H); the output's (D, N*H) -> (N*H, D) -> (N, H, D); a bias (N*H,) -> (N, H).
    # Dense kernels keep N * H flat: a transpose each, the biases as stored.
    split = lambda dim, n: () if config.dense else (SplitDim(dim, (n, -1)),)
    heads, kv_heads = (*linear, *split(1, config.heads)), (*linear, *split(1, config.kv_heads))
    out, per_head = (*linear, *split(0, config.heads)), lambda n: split(0, n)
    rules = _fused(config, heads, kv_heads, linear) if config.family == "phi3" else []
    rules += [
        Rule(r"model\.embed_tokens\.weight", "embed/embedding"),
        Rule(r"model\.norm\.weight", "final_norm"),
        Rule(r"lm_head\.weight", "head/kernel", linear),
        Rule(_LAYER + r"input_layernorm\.weight", r"block_\1/attn_norm"),
        # (Gemma's post_attention_layernorm follows the attention; Llama's comes before the MLP)
        Rule(
            _LAYER + r"post_attention_layernorm\.weight",
            r"block_\1/attn_post_norm" if config.sandwich_norms else r"block_\1/mlp_norm",
        ),
        Rule(_LAYER + r"pre_feedforward_layernorm\.weight", r"block_\1/mlp_norm"),
        Rule(_LAYER + r"post_feedforward_layernorm\.weight", r"block_\1/mlp_post_norm"),
        Rule(_LAYER + r"self_attn\.q_proj\.weight", r"block_\1/attn/q/kernel", heads),
        Rule(_LAYER + r"self_attn\.k_proj\.weight", r"block_\1/attn/k/kernel", kv_heads),
        Rule(_LAYER + r"self_attn\.v_proj\.weight", r"block_\1/attn/v/kernel", kv_heads),
        Rule(_LAYER + r"self_attn\.o_proj\.weight", r"block_\1/attn/out/kernel", out),
        Rule(_LAYER + r"mlp\.(gate|up|down)_proj\.weight", r"block_\1/mlp/\2/kernel", linear),
        # Qwen 2's biases, Qwen 3's norms of each head
        Rule(_LAYER + r"self_attn\.q_proj\.bias", r"block_\1/attn/q/bias", per_head(config.heads)),
        Rule(_LAYER + r"self_attn\.(k|v)_proj\.bias", r"block_\1/attn/\2/bias", per_head(config.kv_heads)),
        Rule(_LAYER + r"self_attn\.(q|k)_norm\.weight", r"block_\1/attn/\2_norm"),
        # Qwen 3 MoE's router, and its experts, each stored on its own, stacked into the bank
        Rule(_LAYER + r"mlp\.gate\.weight", r"block_\1/moe/router/kernel", linear),
        Rule(
            _LAYER + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight",
            r"block_\1/moe/experts/\3/kernel",
            linear,
            at=(r"\2",),
        ),
    ]
    if config.scan:  # (a scanned decoder's blocks: one parameter a weight, each layer at its index)
        rules = [_stacked(rule) for rule in rules]
    ignore = [_LAYER + r"self_attn\.rotary_emb\.inv_freq"]
    if config.tied:  # (the head is the embedding: a stored copy of it is not read)
        rules = [rule for rule in rules if rule.path != "head/kernel"]
        ignore.append(r"lm_head\.weight")
    return rules, ignore


def _stacked(rule: Rule) -> Rule:
    """``rule`` for the scanned decoder: ``block_N/...`` is ``blocks/...`` at layer ``N``."""
    if not rule.path.startswith(_BLOCK):
        return rule
    scanned = lambda path: "blocks/" + path.removeprefix(_BLOCK)
    also = tuple((scanned(path), views) for path, views in rule.also)
    return dataclasses.replace(rule, path=scanned(rule.path), at=(r"\1", *rule.at), also=also)


def _fused(config: DecoderConfig, heads: tuple, kv_heads: tuple, linear: tuple) -> list[Rule]:
    """Phi-3's fused weights taken apart: ``qkv_proj`` (q's rows, then k's, then v's) and
    ``gate_up_proj`` (gate's rows, then up's)."""
    q, kv, f = config.heads * config.head_dim, config.kv_heads * config.head_dim, config.hidden
    attn, mlp = r"block_\1/attn", r"block_\1/mlp"
    return [
        Rule(
            _LAYER + r"self_attn\.qkv_proj\.weight",
            f"{attn}/q/kernel",
            (Take(0, 0, q), *heads),
            also=(
                (f"{attn}/k/kernel", (Take(0, q, q + kv), *kv_heads)),
                (f"{attn}/v/kernel", (Take(0, q + kv, q + 2 * kv), *kv_heads)),
            ),
        ),
        Rule(
            _LAYER + r"mlp\.gate_up_proj\.weight",
            f"{mlp}/gate/kernel",
            (Take(0, 0, f), *linear),
            also=((f"{mlp}/up/kernel", (Take(0, f, 2 * f), *linear)),),
        ),
    ]

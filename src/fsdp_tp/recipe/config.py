"""Model presets for the ``fsdp-tp`` command: one frozen config builds both the sharded
model and its unsharded twin, so the two never drift apart. With ``experts`` the model is the
mixture-of-experts LM of :mod:`fsdp_tp.models.moe` (its twin :meth:`ModelConfig.model` too)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from ..models import Layout, Transformer
from ..models.moe import MoELM

__all__ = ["PRESETS", "ModelConfig", "preset"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer LM over byte tokens (vocab 256) or a token
    file's ids, and how it computes (``dtype``, ``attention``, ``remat``: see ``Transformer``)."""

    d_model: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    mlp_hidden: int
    seq_len: int
    vocab_size: int = 256
    dtype: str = "float32"  # the computation's; parameters and optimizer state stay f32
    scan_layers: bool = True  # False: blocks_0, blocks_1, ... unrolled (another parameter tree)
    attention: str = "reference"  # fsdp_tp.attention.ATTENTION_IMPLEMENTATIONS
    remat: str = "full"  # fsdp_tp.models.remat.REMAT_POLICIES
    # A mixture of experts in place of the MLP (experts > 0): every moe_every-th layer routes each
    # token to its top_k of `experts` gated MLPs of width mlp_hidden, at most capacity_factor x the
    # even share a sequence (None: dropless). The MoE LM computes in `dtype` (its routers in f32),
    # unrolled, each block under `remat` as the GPT's.
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    moe_every: int = 1

    MOE_FIELDS = ("experts", "top_k", "capacity_factor", "moe_every")

    def flops_per_token(self) -> int:
        """Model FLOPs of one trained token (forward and backward, recomputation not counted):
        6 per weight multiply-add (the input embedding is a lookup, not one) plus the
        attention scores and their values, 12 · layers · heads · head_dim · seq_len (every
        query against the whole sequence, the causal half included, as PaLM's MFU counts).

        >>> config = dataclasses.replace(PRESETS["125m"], vocab_size=32768)
        >>> f"{config.flops_per_token() / 1e9:.3f} GFLOP"   # 6 x 110M weights + attention
        '0.774 GFLOP'
        """
        d, heads, kv, dim = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        mlp = 2 * d * self.mlp_hidden
        if self.experts:  # the MoE LM's layers: gated MLPs (3 matrices), top_k of them where routed
            routed = self.num_layers // self.moe_every
            matrices = 3 * d * self.mlp_hidden * (self.top_k * routed + self.num_layers - routed)
            mlp = (matrices + d * self.experts * routed) // self.num_layers  # (and the routers)
        per_layer = d * (heads + 2 * kv) * dim + heads * dim * d + mlp
        weights = self.num_layers * per_layer + d * self.vocab_size  # blocks + output head
        return 6 * weights + 12 * self.num_layers * heads * dim * self.seq_len

    def model(self, layout: Layout | None = None) -> Transformer | MoELM:
        """The model split as ``layout`` says; without one, the plain flax twin, the reference
        the sharded one must equal (with ``experts``, the MoE LM, which rules lay out)."""
        if self.experts:
            return MoELM(self.moe_sizes(), dtype=jnp.dtype(self.dtype), remat=self.remat)
        return Transformer(**self.model_sizes(), layout=layout or Layout())

    def model_sizes(self) -> dict:
        """The GPT's fields (every one but ``seq_len`` and the MoE's), as both APIs' GPTs take them."""
        fields = dataclasses.asdict(self)
        for name in ("seq_len", *self.MOE_FIELDS):
            del fields[name]
        fields["dtype"] = jnp.dtype(self.dtype)
        return fields

    def moe_sizes(self) -> dict:
        """The MoE LM's sizes (:data:`fsdp_tp.models.moe.MOE_SIZES`' keys): a group is one sequence.

        >>> sizes = preset("tiny", experts=4).moe_sizes()
        >>> sizes["experts"], sizes["hidden"], sizes["capacity_factor"]
        (4, 256, None)
        """
        return dict(
            vocab=self.vocab_size, d=self.d_model, heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, hidden=self.mlp_hidden, layers=self.num_layers, experts=self.experts,
            top_k=self.top_k, capacity_factor=self.capacity_factor, group_rows=1, shared_hidden=0,
            moe_every=self.moe_every,
        )  # fmt: skip


PRESETS = {
    "tiny": ModelConfig(
        d_model=64, num_layers=2, num_heads=4, head_dim=16, num_kv_heads=2, mlp_hidden=256, seq_len=64
    ),
    "small": ModelConfig(
        d_model=256, num_layers=4, num_heads=8, head_dim=32, num_kv_heads=4, mlp_hidden=1024, seq_len=128
    ),
    "base": ModelConfig(
        # 16 heads (not GPT-2's 12), so that tensor axes up to 16 divide them
        d_model=768,
        num_layers=12,
        num_heads=16,
        head_dim=48,
        num_kv_heads=8,
        mlp_hidden=3072,
        seq_len=512,
    ),
    # Realistic sizes (the GPU measurements of the benchmark page): GPT-2-like widths, a
    # vocabulary from the token file (or --vocab-size), sequences of 1024.
    "125m": ModelConfig(
        d_model=768, num_layers=12, num_heads=12, head_dim=64, num_kv_heads=12, mlp_hidden=3072, seq_len=1024
    ),
    "350m": ModelConfig(
        d_model=1024,
        num_layers=24,
        num_heads=16,
        head_dim=64,
        num_kv_heads=16,
        mlp_hidden=4096,
        seq_len=1024,
    ),
    "1b": ModelConfig(
        d_model=2048,
        num_layers=16,
        num_heads=16,
        head_dim=128,
        num_kv_heads=16,
        mlp_hidden=8192,
        seq_len=1024,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset with some fields replaced (``None`` values keep the preset's)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})

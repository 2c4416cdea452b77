"""Model presets for the ``fsdp-tp`` command: one frozen config builds both the sharded
model and its unsharded twin, so the two never drift apart."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from ..models import Layout, Transformer

__all__ = ["PRESETS", "ModelConfig", "preset"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer LM over byte tokens (vocab 256)."""

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

    def model(self, layout: Layout | None = None) -> Transformer:
        """The model split as ``layout`` says; without one, the plain flax twin, the reference
        the sharded one must equal."""
        return Transformer(**self._sizes(), layout=layout or Layout())

    def _sizes(self) -> dict:
        fields = dataclasses.asdict(self)
        del fields["seq_len"]
        fields["dtype"] = jnp.dtype(self.dtype)
        return fields


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
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset with some fields replaced (``None`` values keep the preset's)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})

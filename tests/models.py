"""Small models shared by the tests: each built from a Dense class, so the sharded
and the unsharded twin differ only in that class."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

import fsdp_tp
from fsdp_tp.tp import ColumnParallel, RowParallel, VocabParallel


class MLP(nn.Module):
    """Dense layers with tanh between them (smooth, so gradients have no kinks)."""

    features: Sequence[int]
    use_bias: bool = True
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.features):
            # Auto-named on purpose: the sharded tree must keep flax's own names.
            x = self.dense(width, use_bias=self.use_bias)(x)
            if i < len(self.features) - 1:
                x = nn.tanh(x)
        return x


class Block(nn.Module):
    """A residual block for nn.scan: carry in, carry out."""

    width: int
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x, _):
        return x + nn.tanh(self.dense(self.width, name="dense")(x)), None


class ScanMLP(nn.Module):
    """``depth`` residual blocks under nn.scan over nn.remat, then a head."""

    width: int
    depth: int
    out_dim: int
    dense: type = nn.Dense
    block: type = Block

    @nn.compact
    def __call__(self, x):
        x = self.dense(self.width, name="embed")(x)
        stack = nn.scan(
            nn.remat(self.block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
            metadata_params={nn.PARTITION_NAME: None},
        )
        x, _ = stack(self.width, self.dense, name="blocks")(x, None)
        return self.dense(self.out_dim, name="head")(x)


class SetupLayer(nn.Module):
    """A layer that declares its parameters in ``setup`` (as nn.Embed does), not in a compact call."""

    features: int

    def setup(self):
        self.scale = self.param("scale", nn.initializers.normal(1.0), (self.features,))
        self.proj = nn.Dense(self.features)

    def __call__(self, x):
        return self.proj(x) * self.scale


class TiedLM(nn.Module):
    """Tied embeddings (``nn.Embed.attend``) and a ``nn.DenseGeneral`` MLP over two groups."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 16)
        x = embed(tokens)
        h = nn.gelu(nn.DenseGeneral((4, 8), name="up")(x))
        x = x + nn.DenseGeneral(16, axis=(-2, -1), name="down")(h)
        return embed.attend(nn.LayerNorm()(x))


class DenseThen(nn.Module):
    """A dense layer before the block, so the block's input gradient reaches a parameter."""

    block: nn.Module
    width: int

    @nn.compact
    def __call__(self, x):
        return self.block(nn.Dense(self.width, name="pre")(x))


class SequenceParallelAround(nn.Module):
    """Dense -> enter the SP region (split the sequence) -> block in SP mode -> gather the sequence.

    The unsharded twin (axis=None) is Dense -> block. The loss then sees the whole
    sequence on every tensor device, as after Megatron's final gather."""

    block: nn.Module
    width: int
    axis: str | None = "tensor"

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, name="pre")(x)
        if self.axis is None:
            return self.block(x)
        y = self.block(fsdp_tp.collectives.scatter_to_axis(x, 1, self.axis))
        return fsdp_tp.collectives.gather_from_axis(y, 1, self.axis)


class GatedLM(nn.Module):
    """Llama's MLP, ``down(silu(gate(h)) * up(h))``, in two pre-norm blocks, with tied logits."""

    layers: int = 2
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        dtype = dict(param_dtype=self.param_dtype)
        embed = nn.Embed(32, 16, **dtype)
        x = embed(tokens)
        for i in range(self.layers):
            h = nn.LayerNorm(name=f"norm_{i}", **dtype)(x)
            gated = nn.silu(nn.Dense(32, name=f"gate_{i}", **dtype)(h)) * nn.Dense(
                32, name=f"up_{i}", **dtype
            )(h)
            x = x + nn.Dense(16, name=f"down_{i}", **dtype)(gated)
        return embed.attend(nn.LayerNorm(name="final", **dtype)(x))


GATED_RULES = {
    "linen": [
        (r"Embed_0$", VocabParallel()),
        (r"(gate|up)_\d$", ColumnParallel()),
        (r"down_\d$", RowParallel()),
    ],
    "nnx": [
        (r"embed$", VocabParallel()),
        (r"(gates|ups)/\d$", ColumnParallel()),
        (r"downs/\d$", RowParallel()),
    ],
}

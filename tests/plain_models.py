"""Models in the plain Flax style of published examples (flax/examples lm1b, imagenet):
attention from ``nn.MultiHeadDotProductAttention``, MLPs of ``nn.Dense``, ``nn.Embed``,
``nn.LayerNorm``; no layer-class fields, so the library can only reach them from outside.

``wrap`` (identity by default) exists only for the comparison the tests make: the same
model with every layer wrapped by hand, the edit a user of the per-layer API would make.
The train step the tests measure such a model by is the benchmark's,
:func:`fsdp_tp.bench.lm_step.lowered_lm_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fsdp_tp.linen.tp_rules import attention_rules, mlp_rules
from fsdp_tp.tp import ColumnParallel, VocabParallel


def _same(cls):
    return cls


class DecoderBlock(nn.Module):
    d_model: int
    heads: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        at = dict(param_dtype=self.param_dtype)
        h = nn.LayerNorm(**at)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, **at)(h, mask=mask)
        h = nn.Dense(4 * self.d_model, **at)(nn.LayerNorm(**at)(x))
        return x + nn.Dense(self.d_model, **at)(nn.gelu(h))


class ScannedBlock(nn.Module):
    """``DecoderBlock`` as ``nn.scan`` wants it: (carry, input) -> (carry, output)."""

    d_model: int
    heads: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, _):
        return DecoderBlock(self.d_model, self.heads, self.param_dtype)(x), None


class PlainLM(nn.Module):
    """A decoder-only LM: embed, ``layers`` blocks (a Python loop, or ``nn.scan`` over
    ``nn.remat`` as memory-minded examples write it), a final norm and the logits.
    ``param_dtype``: every layer's (float64 computes the same model with rounding far below
    the tests' tolerances, under ``jax.enable_x64``)."""

    vocab: int
    d_model: int
    heads: int
    layers: int
    scan: bool = False
    remat: bool = False
    wrap: Callable = _same
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        at = dict(param_dtype=self.param_dtype)
        x = self.wrap(nn.Embed)(self.vocab, self.d_model, **at)(tokens)
        if self.scan:
            block = nn.remat(self.wrap(ScannedBlock)) if self.remat else self.wrap(ScannedBlock)
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
                metadata_params={nn.PARTITION_NAME: None},
            )
            x, _ = stack(self.d_model, self.heads, self.param_dtype, name="layers")(x, None)
        else:
            block = nn.remat(self.wrap(DecoderBlock)) if self.remat else self.wrap(DecoderBlock)
            for i in range(self.layers):
                x = block(self.d_model, self.heads, self.param_dtype, name=f"layer_{i}")(x)
        x = self.wrap(nn.LayerNorm)(name="norm", **at)(x)
        return self.wrap(nn.Dense)(self.vocab, name="logits", **at)(x)


class ResidualUnit(nn.Module):
    channels: int
    train: bool
    axis_name: str | tuple | None

    @nn.compact
    def __call__(self, x):
        norm = dict(use_running_average=not self.train, momentum=0.9, epsilon=1e-5, axis_name=self.axis_name)
        h = nn.relu(nn.BatchNorm(**norm)(nn.Conv(self.channels, (3, 3), use_bias=False)(x)))
        h = nn.BatchNorm(**norm, scale_init=nn.initializers.ones)(
            nn.Conv(self.channels, (3, 3), use_bias=False)(h)
        )
        return nn.relu(x + h)


class PlainResNet(nn.Module):
    """A small ResNet as flax/examples/imagenet writes it: ``nn.Conv`` and ``nn.BatchNorm``
    with ``axis_name='batch'`` hard-coded by default (the example's choice), global average
    pooling and a ``nn.Dense`` head. ``axis_name=None`` is its unsharded twin."""

    channels: int = 16
    units: int = 2
    classes: int = 8
    train: bool = True
    axis_name: str | tuple | None = "batch"

    @nn.compact
    def __call__(self, x):
        norm = dict(use_running_average=not self.train, momentum=0.9, epsilon=1e-5, axis_name=self.axis_name)
        x = nn.relu(nn.BatchNorm(**norm)(nn.Conv(self.channels, (3, 3), use_bias=False)(x)))
        for _ in range(self.units):
            x = ResidualUnit(self.channels, self.train, self.axis_name)(x)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


# The MLP's two layers in the blocks (a loop: layer_0/..., layer_1/...; scanned:
# layers/DecoderBlock_0/...).
MLP = mlp_rules(r"(layer_\d+|DecoderBlock_0)/Dense_0$", r"(layer_\d+|DecoderBlock_0)/Dense_1$")
MEGATRON = [
    *attention_rules(),
    *MLP,
    (r"^Embed_0$", VocabParallel()),
    (r"^logits$", ColumnParallel(gather_output=True)),
]

"""The three workloads of the benchmarks, each buildable as the plain flax twin or sharded.

A workload builds a module for a *layout* (which axes split what) and says how its
batch looks and what its loss is. The same layout drives every implementation, so the
library, GSPMD and the tutorial style are measured on the same model and batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..collectives import gather_from_axis, scatter_to_axis
from ..linen.layers import MLPBlock
from ..models import Layout, Transformer
from ..models.transformer import DecoderBlock
from ..tp.pieces import vocab_parallel_cross_entropy

__all__ = ["WORKLOADS", "Workload", "bench_layout"]


def bench_layout(**fields) -> Layout:
    """The benchmarks' layouts shard every parameter over 1024 elements under FSDP."""
    return Layout(**{"min_weight_size": 2**10, **fields})


class Classifier(nn.Module):
    """(a) An MLP classifier: two MLP blocks (column -> gelu -> row) and a 10-way head."""

    layout: Layout
    hidden: int = 1024
    width: int = 256

    @nn.compact
    def __call__(self, x):
        lay = self.layout
        for i in range(2):
            x = lay.shard(MLPBlock)(
                self.hidden,
                self.width,
                axis=lay.tensor,
                collective_matmul=lay.ring,
                name=f"mlp_{i}",
            )(x)
        return lay.shard(nn.Dense)(10, name="head")(x)


class Block(nn.Module):
    """(b) One pre-norm decoder block (attention + MLP); with SP the sequence is split inside."""

    layout: Layout
    num_heads: int = 8
    head_dim: int = 32
    mlp_hidden: int = 1024

    @nn.compact
    def __call__(self, x):
        lay = self.layout
        sp = lay.sequence_split
        if sp:
            x = scatter_to_axis(x, 1, lay.tensor)
        block = lay.shard(DecoderBlock)(
            self.num_heads, self.head_dim, self.num_heads, self.mlp_hidden, lay, name="block"
        )
        y, _ = block(x, None)
        return gather_from_axis(y, 1, lay.tensor) if sp else y


@dataclass(frozen=True)
class Workload:
    """A model family, its example batch and its per-device mean loss."""

    name: str
    title: str
    build: Callable[[Layout], nn.Module]
    batch: Callable[[int], tuple]  # global batch size -> (inputs, targets) as numpy
    loss: Callable[[jax.Array, jax.Array, str | None], jax.Array]  # (outputs, targets, tensor axis)
    supports_sequence_parallel: bool = True


def _classifier_batch(size: int) -> tuple:
    rng = np.random.default_rng(0)
    return rng.normal(size=(size, 256)).astype(np.float32), rng.integers(0, 10, size).astype(np.int32)


def _block_batch(size: int) -> tuple:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size, 64, 256)).astype(np.float32)
    return x, np.zeros((size,), np.int32)


def _tokens_batch(size: int) -> tuple:
    tokens = np.random.default_rng(0).integers(0, 256, (size, 65)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _vocab_loss(logits, targets, tensor):
    if tensor is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return vocab_parallel_cross_entropy(logits, targets, tensor).mean()


def gpt(layers: int = 4, scan_layers: bool = True) -> Callable[[Layout], nn.Module]:
    """(c) The GPT-style model of ``fsdp-tp train`` (``nn.scan`` over ``nn.remat`` blocks)."""

    def build(lay: Layout) -> nn.Module:
        return Transformer(
            vocab_size=256,
            d_model=256,
            num_layers=layers,
            num_heads=8,
            head_dim=32,
            num_kv_heads=8,
            mlp_hidden=1024,
            layout=lay,
            scan_layers=scan_layers,
        )

    return build


WORKLOADS = {
    "mlp": Workload(
        "mlp",
        "MLP classifier 256 → (1024 → 256) x 2 → 10",
        lambda lay: Classifier(lay),
        _classifier_batch,
        lambda out, y, _: optax.softmax_cross_entropy_with_integer_labels(out, y).mean(),
        supports_sequence_parallel=False,
    ),
    "block": Workload(
        "block",
        "decoder block (attention 8 heads + MLP), d 256, seq 64",
        lambda lay: Block(lay),
        _block_batch,
        lambda out, _y, __: jnp.mean(out**2),
    ),
    "gpt": Workload(
        "gpt",
        "GPT-style LM, 4 layers, d 256, 8 heads, vocab 256, seq 64 (nn.scan + nn.remat)",
        gpt(),
        _tokens_batch,
        _vocab_loss,
    ),
}

"""A decoder-only transformer LM: FSDP x TP x sequence parallel by a ``Layout``, or plain flax."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._aliases import aliases_of
from ..collectives import copy_to_axis
from ..linen._transform import keep_module_name
from ..linen.layers import AttentionBlock, ColumnParallelDense, MLPBlock, VocabParallelEmbed
from .layout import Layout
from .remat import remat_policy

__all__ = ["Transformer"]

__getattr__ = aliases_of(__name__)  # REMAT_POLICIES lives in fsdp_tp.models.remat (fsdp_tp._aliases)


def _rematted(block, name: str):
    policy = remat_policy(name, "Transformer")
    return block if name == "none" else nn.remat(block, policy=policy)


def _norm(axis: str | None, sequence_parallel: bool):
    """LayerNorm; inside a sequence-parallel region its params get f (``copy_to_axis``):
    applied to this device's slice of the sequence, their gradient is a partial sum."""
    if axis is None or not sequence_parallel:
        return nn.LayerNorm
    shared = nn.map_variables(
        nn.LayerNorm,
        trans_in_fn=lambda v: jax.tree.map(functools.partial(copy_to_axis, axis=axis), v),
        mapped_collections="params",
        mutable=True,
    )
    return keep_module_name(shared, nn.LayerNorm)


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Carry in, carry out.
    Its own layers are split as ``layout`` says (tensor, sequence, rings); FSDP wraps it from outside."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    mlp_hidden: int
    layout: Layout = Layout()
    dtype: Any = None
    attention: str = "reference"

    @nn.compact
    def __call__(self, x, segment_ids):
        lay = self.layout
        norm = functools.partial(_norm(lay.tensor, lay.sequence_split), dtype=self.dtype)
        h = norm(name="norm_attn")(x)
        x = x + AttentionBlock(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            name="attn",
            axis=lay.tensor,
            sequence_dim=1 if lay.sequence_split else None,
            collective_matmul=lay.ring,
            dtype=self.dtype,
            attention=self.attention,
        )(h, segment_ids)
        h = norm(name="norm_mlp")(x)
        return x + MLPBlock(
            self.mlp_hidden,
            name="mlp",
            axis=lay.tensor,
            sequence_dim=1 if lay.sequence_split else None,
            collective_matmul=lay.ring,
            dtype=self.dtype,
        )(h), None


class Transformer(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``, split on the vocab over the
    tensor axis.

    Embedding, ``num_layers`` decoder blocks under ``nn.scan`` over ``nn.remat`` (what each
    block keeps for the backward pass: ``remat``, a key of
    :data:`~fsdp_tp.models.remat.REMAT_POLICIES`), final norm, vocab-parallel head: train it with
    :func:`~fsdp_tp.vocab_parallel_cross_entropy` on the local logits. ``layout``
    (:class:`~fsdp_tp.models.Layout`) says what is split: tensor parallelism over
    ``layout.tensor``, every layer's large parameters sharded over ``layout.fsdp``,
    sequence parallelism, collective-matmul rings; ``Layout()`` is the plain flax model
    with the same parameter tree (the twin).
    ``dtype=jnp.bfloat16`` computes in bf16 on f32 parameters; the logits come
    back in f32 either way, for the loss. ``scan_layers=False`` unrolls the
    layers (parameters ``blocks_0``, ``blocks_1``, ...; compile time grows with depth).
    ``attention`` picks how attention is computed (:func:`~fsdp_tp.attention.attend`); every
    choice of ``attention`` and ``remat`` computes the same function.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    mlp_hidden: int
    layout: Layout = Layout()
    dtype: Any = None
    scan_layers: bool = True
    attention: str = "reference"
    remat: str = "full"

    @nn.compact
    def __call__(self, ids: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits of ``ids`` ``(batch, seq)``; ``segment_ids`` ``(batch, seq)``: packed documents
        (a token attends within its own; 0 is padding), or ``None``: one document a row."""
        lay = self.layout
        sp = lay.sequence_split
        if lay.tensor is None:
            x = lay.shard(nn.Embed)(self.vocab_size, self.d_model, dtype=self.dtype, name="embed")(ids)
        else:
            x = lay.shard(VocabParallelEmbed)(
                self.vocab_size,
                self.d_model,
                axis=lay.tensor,
                sequence_dim=1 if sp else None,
                dtype=self.dtype,
                name="embed",
            )(ids)
        block_args = (
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.mlp_hidden,
            lay,
            self.dtype,
            self.attention,
        )
        block = _rematted(lay.shard(DecoderBlock), self.remat)
        if self.scan_layers:  # one traced and compiled block, its params stacked on a leading dim
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,  # (every layer reads the same segment ids)
                length=self.num_layers,
                metadata_params={nn.PARTITION_NAME: None},
            )
            x, _ = stack(*block_args, name="blocks")(x, segment_ids)
        else:  # blocks_0, blocks_1, ...: what compile time costs without scan
            for i in range(self.num_layers):
                x, _ = block(*block_args, name=f"blocks_{i}")(x, segment_ids)
        # Wrapped like every other layer: each parameter of the model is FSDP's to shard
        # (if large) and to read in the gather dtype under mixed precision.
        x = lay.shard(_norm(lay.tensor, sp))(dtype=self.dtype, name="norm_final")(x)
        if lay.tensor is None:
            head = lay.shard(nn.Dense)(self.vocab_size, use_bias=False, dtype=self.dtype, name="head")
            return head(x).astype(jnp.float32)
        head = lay.shard(ColumnParallelDense)(
            self.vocab_size,
            use_bias=False,
            axis=lay.tensor,
            sequence_dim=1 if sp else None,
            collective_matmul=lay.ring if sp else None,
            dtype=self.dtype,
            name="head",
        )
        return head(x).astype(jnp.float32)

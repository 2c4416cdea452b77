"""A decoder-only transformer LM: FSDP x TP x sequence parallel, or plain flax with ``axis_name=None``."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..collectives import copy_to_axis
from ..fsdp import keep_module_name, shard_module_params
from ..tensor_parallel import AttentionBlock, ColumnParallelDense, MLPBlock, VocabParallelEmbed

__all__ = ["Transformer"]


def _norm(axis_name: str | None, sequence_parallel: bool):
    """LayerNorm; inside a sequence-parallel region its params get f (``copy_to_axis``):
    applied to this device's slice of the sequence, their gradient is a partial sum."""
    if axis_name is None or not sequence_parallel:
        return nn.LayerNorm
    shared = nn.map_variables(
        nn.LayerNorm,
        trans_in_fn=lambda v: jax.tree.map(functools.partial(copy_to_axis, axis_name=axis_name), v),
        mapped_collections="params",
        mutable=True,
    )
    return keep_module_name(shared, nn.LayerNorm)


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Carry in, carry out."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    mlp_hidden: int
    axis_name: str | None = "tensor"
    sequence_parallel: bool = False
    collective_matmul: str | None = None
    dtype: Any = None

    @nn.compact
    def __call__(self, x, _):
        norm = functools.partial(_norm(self.axis_name, self.sequence_parallel), dtype=self.dtype)
        h = norm(name="norm_attn")(x)
        x = x + AttentionBlock(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            name="attn",
            axis_name=self.axis_name,
            sequence_parallel=self.sequence_parallel,
            collective_matmul=self.collective_matmul,
            dtype=self.dtype,
        )(h)
        h = norm(name="norm_mlp")(x)
        return x + MLPBlock(
            self.mlp_hidden,
            name="mlp",
            axis_name=self.axis_name,
            sequence_parallel=self.sequence_parallel,
            collective_matmul=self.collective_matmul,
            dtype=self.dtype,
        )(h), None


class Transformer(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``, split on the vocab over ``axis_name``.

    Embedding, ``num_layers`` decoder blocks under ``nn.scan`` over ``nn.remat``,
    final norm, vocab-parallel head: train it with
    :func:`~fsdp_tp.vocab_parallel_cross_entropy` on the local logits. With
    ``fsdp_axis`` set, every layer's large parameters are also sharded over
    it; with ``sequence_parallel`` the residual stream between blocks is split
    along the sequence over ``axis_name``; ``collective_matmul`` turns the
    tensor-parallel collectives into overlapped rings (see
    :class:`~fsdp_tp.RowParallelDense`). ``axis_name=None`` (and no
    ``fsdp_axis``) is the plain flax model with the same parameter tree.
    ``dtype=jnp.bfloat16`` computes in bf16 on f32 parameters; the logits come
    back in f32 either way, for the loss. ``scan_layers=False`` unrolls the
    layers (parameters ``blocks_0``, ``blocks_1``, ...; compile time grows with depth).
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    mlp_hidden: int
    axis_name: str | None = "tensor"
    sequence_parallel: bool = False
    fsdp_axis: str | None = None
    min_weight_size: int = 2**18
    collective_matmul: str | None = None
    dtype: Any = None
    scan_layers: bool = True

    def _fsdp(self, cls):
        return (
            cls if self.fsdp_axis is None else shard_module_params(cls, self.fsdp_axis, self.min_weight_size)
        )

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        sp = self.axis_name is not None and self.sequence_parallel
        if self.axis_name is None:
            x = self._fsdp(nn.Embed)(self.vocab_size, self.d_model, dtype=self.dtype, name="embed")(ids)
        else:
            x = self._fsdp(VocabParallelEmbed)(
                self.vocab_size,
                self.d_model,
                axis_name=self.axis_name,
                sequence_axis=1 if sp else None,
                dtype=self.dtype,
                name="embed",
            )(ids)
        block_args = (
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.mlp_hidden,
            self.axis_name,
            sp,
            self.collective_matmul if self.axis_name is not None else None,
            self.dtype,
        )
        block = nn.remat(self._fsdp(DecoderBlock))
        if self.scan_layers:  # one traced and compiled block, its params stacked on a leading dim
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.num_layers,
                metadata_params={nn.PARTITION_NAME: None},
            )
            x, _ = stack(*block_args, name="blocks")(x, None)
        else:  # blocks_0, blocks_1, ...: what compile time costs without scan
            for i in range(self.num_layers):
                x, _ = block(*block_args, name=f"blocks_{i}")(x, None)
        x = _norm(self.axis_name, sp)(dtype=self.dtype, name="norm_final")(x)
        if self.axis_name is None:
            head = self._fsdp(nn.Dense)(self.vocab_size, use_bias=False, dtype=self.dtype, name="head")
            return head(x).astype(jnp.float32)
        head = self._fsdp(ColumnParallelDense)(
            self.vocab_size,
            use_bias=False,
            axis_name=self.axis_name,
            sequence_axis=1 if sp else None,
            collective_matmul=self.collective_matmul if sp else None,
            dtype=self.dtype,
            name="head",
        )
        return head(x).astype(jnp.float32)

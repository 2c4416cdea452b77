"""The library's GPT written in Flax NNX, as flax's NNX examples write a model, and the rules
that lay it out: ``fsdp-tp train --api nnx``.

:class:`NNXTransformer` computes the function of :class:`~fsdp_tp.models.Transformer`'s plain
twin and holds its parameter tree (paths, dtypes, and shapes but the attention kernels', whose
``heads * dim`` features ``nnx.MultiHeadAttention`` keeps as two dims): ``embed``, ``blocks``
(stacked by ``nnx.vmap`` and run by ``nnx.scan``, or ``blocks_0``, ``blocks_1``, ... in a loop),
``norm_final``, ``head``. That is what lets a run start from the Linen model's init
(:func:`fsdp_tp.recipe.nnx_gpt.nnx_maker`) and be checked against the Linen twin.

It is split by rules only: :func:`tp_rules` are Megatron's roles on its layers (the core's
:mod:`fsdp_tp.tp`: sequence parallelism and kv heads kept whole included), and
:func:`storage_rules` puts FSDP where Linen's ``shard_module_params`` puts it, so both APIs
hold the same bytes on every device.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from .._layout import fsdp_dim, fsdp_entry
from ..attention import attend
from ..nnx import tp_splits
from ..tp import ColumnParallel, HeadParallel, RowParallel, VocabParallel
from .remat import remat_policy

__all__ = ["TP_RULES", "NNXTransformer", "storage_rules", "tp_rules"]


def tp_rules(
    sequence_parallel: bool = False, replicated_kv: bool = False, collective_matmul: str | None = None
) -> tuple:
    """Megatron on the GPT's layers, by module path (each matches inside the scanned stack
    too): heads split over tensor (q/k/v column-parallel after one f, out row-parallel), the
    MLP column then row, the embedding split on the vocabulary, the head column-parallel with
    its logits left split on the vocabulary for the vocab-parallel loss.
    ``sequence_parallel``: the activations between them split along the sequence (dim 1), as
    the Linen GPT's layout does; ``replicated_kv``: kv heads kept whole (fewer than, or not
    divisible by, the tensor axis), as Linen's attention block keeps them;
    ``collective_matmul`` (``"unidirectional"`` / ``"bidirectional"``): the tensor-parallel
    collectives as ``ppermute`` rings overlapped with the matmuls, where the Linen GPT's
    layers have them (the sequence gathers and the row layers' reductions; the embedding's
    sum stays a collective).

    >>> [role for _, role in tp_rules(sequence_parallel=True, collective_matmul="bidirectional")][2]
    RowParallel(axis='tensor', letter=None, sequence_dim=1, collective_matmul='bidirectional')
    """
    seq, ring = (1 if sequence_parallel else None), collective_matmul
    return (
        (r"/attn$", HeadParallel(sequence_dim=seq, replicated_kv=replicated_kv, collective_matmul=ring)),
        (r"mlp/wi$", ColumnParallel(sequence_dim=seq, collective_matmul=ring)),
        (r"mlp/wo$", RowParallel(sequence_dim=seq, collective_matmul=ring)),
        (r"^embed$", VocabParallel(sequence_dim=seq)),
        (r"^head$", ColumnParallel(sequence_dim=seq, collective_matmul=ring)),  # (a ring needs seq)
    )


TP_RULES = tp_rules()  # without sequence parallelism, kv heads split


def _attention(d_model, num_heads, head_dim, num_kv_heads, *, dtype, attention, rngs):
    """Causal (grouped-query) self-attention, no biases: ``nnx.MultiHeadAttention``, computed by
    :func:`~fsdp_tp.attention.attend` (``attention`` picks the implementation, as for Linen).
    Its kernels hold Linen's ``(d, heads * dim)`` as ``(d, heads, dim)``."""

    def attention_fn(query, key, value, mask=None, **_):  # causal always; dropout unused
        # (``mask``: this model's segment ids (batch, seq), passed through as the call's mask,
        # which nnx.MultiHeadAttention hands on unread: a mask built of a device's tokens
        # could not be read across devices, the segment ids are)
        return attend(query, key, value, True, attention, segment_ids=mask)

    return nnx.MultiHeadAttention(
        num_heads,
        d_model,
        num_heads * head_dim,
        num_kv_heads=num_kv_heads,
        use_bias=False,
        attention_fn=attention_fn,
        decode=False,
        dtype=dtype,
        rngs=rngs,
    )


class MLP(nnx.Module):
    """``wi`` → gelu → ``wo``, with biases."""

    def __init__(self, d_model, hidden, *, dtype, rngs):
        self.wi = nnx.Linear(d_model, hidden, dtype=dtype, rngs=rngs)
        self.wo = nnx.Linear(hidden, d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.wo(nnx.gelu(self.wi(x)))


class DecoderBlock(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model, num_heads, head_dim, num_kv_heads, mlp_hidden, *, dtype, attention, rngs):
        self.norm_attn = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.attn = _attention(
            d_model, num_heads, head_dim, num_kv_heads, dtype=dtype, attention=attention, rngs=rngs
        )
        self.norm_mlp = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.mlp = MLP(d_model, mlp_hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x, segment_ids=None):
        x = x + self.attn(self.norm_attn(x), mask=segment_ids)  # (the segment ids: _attention's)
        return x + self.mlp(self.norm_mlp(x))


class NNXTransformer(nnx.Module):
    """Token ids ``(batch, seq)`` -> f32 logits ``(batch, seq, vocab)``: the NNX twin of
    :class:`~fsdp_tp.models.Transformer` (the same fields but ``layout``; tensor
    parallelism comes from :data:`TP_RULES`, not from the model).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = NNXTransformer(64, 32, 2, 4, 8, 2, 64, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape, model.blocks.attn.key.kernel.shape
    ((2, 5, 64), (2, 32, 2, 8))
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        mlp_hidden: int,
        *,
        dtype: Any = None,
        scan_layers: bool = True,
        attention: str = "reference",
        remat: str = "full",
        rngs: nnx.Rngs,
    ):
        remat_policy(remat, "NNXTransformer")
        self.num_layers, self.scan_layers, self.remat = num_layers, scan_layers, remat
        self.embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
        sizes = (d_model, num_heads, head_dim, num_kv_heads, mlp_hidden)
        block = functools.partial(DecoderBlock, *sizes, dtype=dtype, attention=attention)
        if scan_layers:  # one block's parameters stacked on a leading layer dim, as nn.scan stacks them

            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return block(rngs=rngs)

            self.blocks = stack(rngs)
        else:  # named as Linen names unrolled blocks, so both trees are the same
            for i in range(num_layers):
                setattr(self, f"blocks_{i}", block(rngs=rngs))
        self.norm_final = nnx.LayerNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, ids: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits of ``ids`` ``(batch, seq)``; ``segment_ids``: packed documents, as Linen's."""
        x = self.embed(ids)
        run = lambda block, x, segments: block(x, segments)
        if self.remat != "none":
            run = nnx.remat(run, policy=remat_policy(self.remat, "NNXTransformer"))
        if self.scan_layers:
            scan = nnx.scan(run, in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            x = scan(self.blocks, x, segment_ids)
        else:
            for i in range(self.num_layers):
                x = run(getattr(self, f"blocks_{i}"), x, segment_ids)
        return self.head(self.norm_final(x)).astype(jnp.float32)


def storage_rules(
    model: nnx.Module, sizes: Mapping[str, int], min_weight_size: int, tp: tuple = TP_RULES
) -> list[tuple]:
    """One anchored storage rule per parameter of ``model`` (abstract is enough): FSDP over
    ``fsdp`` on the dim Linen's ``shard_module_params`` picks (the largest dim that tensor
    parallelism leaves whole and the axis divides, in each layer's local shape, for
    parameters of more than ``min_weight_size`` local elements), nothing else. The tensor
    split is the roles' (``tp``, :data:`TP_RULES` by default, read by
    :func:`fsdp_tp.nnx.tp_splits`: no table repeats them); it joins these specs in
    ``shard_by_rules``.

    >>> from flax import nnx
    >>> model = nnx.eval_shape(lambda: NNXTransformer(64, 32, 2, 4, 8, 2, 64, rngs=nnx.Rngs(0)))
    >>> rules = dict(storage_rules(model, {"fsdp": 4, "tensor": 2}, 0))
    >>> rules["^blocks/mlp/wi/kernel$"], rules["^head/kernel$"]
    (P(None, 'fsdp', None), P('fsdp', None))
    """
    fsdp, splits = sizes.get("fsdp", 1), tp_splits(model, tp)
    rules = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = tuple(variable.get_raw_value().shape)
        stacked = int(path[0] == "blocks")  # the scanned stack's layer dim, never split
        local: list[int] = list(shape[stacked:])
        names: list[str | None] = [None] * len(local)
        text = "/".join(str(key) for key in path)
        for dim, axis in splits.get(text, ()):  # (dim from the end, axis): the roles'
            local[dim] //= sizes.get(str(axis), 1)
            names[dim] = str(axis)
        chosen = fsdp_dim(tuple(local), tuple(names), fsdp) if np.prod(local) > min_weight_size else None
        spec = [None] * stacked + [
            fsdp_entry(tuple(names), i, "fsdp") if i == chosen else None for i in range(len(local))
        ]
        rules.append((f"^{re.escape(text)}$", PartitionSpec(*spec)))
    return rules

"""Vocabulary-parallel embedding and cross-entropy: the vocab dim split over a mesh axis."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..._tree import module_path
from ...collectives import require_sequence_divisible

# vocab_parallel_cross_entropy is re-exported from where it lives, the framework-free fsdp_tp.tp.
from ...tp import row_reduce, vocab_lookup, vocab_parallel_cross_entropy
from .dense import split_param

__all__ = ["VocabParallelEmbed", "vocab_parallel_cross_entropy"]


class VocabParallelEmbed(nn.Module):
    """``nn.Embed`` with the table split on the vocab dim over ``axis_name``.

    Each device looks the ids up in its rows, zeros the ids it does not hold,
    and the partial rows are summed over the axis — or, with
    ``sequence_axis`` set (sequence parallelism), reduce-scattered along that
    dim, so each device leaves with its slice of the sequence.
    Same tree (``embedding``: (vocab, features)) and init as ``nn.Embed``.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> ids = jnp.array([[0, 5, 11, 7]])
    >>> def embed(ids):
    ...     return VocabParallelEmbed(12, 3).apply(
    ...         {"params": VocabParallelEmbed(12, 3).init(jax.random.key(0), ids)["params"]}, ids)
    >>> got = jax.shard_map(embed, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(ids)
    >>> ref = nn.Embed(12, 3).apply(nn.Embed(12, 3).init(jax.random.key(0), ids), ids)
    >>> bool(jnp.allclose(got, ref))
    True
    """

    num_embeddings: int
    features: int
    dtype: Any = None  # the output's dtype, as nn.Embed's
    param_dtype: Any = jnp.float32
    embedding_init: Any = nn.linear.default_embed_init
    axis_name: str = "tensor"
    sequence_axis: int | None = None

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = split_param(
            self,
            "embedding",
            self.embedding_init,
            (self.num_embeddings, self.features),
            self.param_dtype,
            (self.axis_name, None),
        )
        (table,) = nn.dtypes.promote_dtype(table, dtype=self.dtype, inexact=False)
        partial = vocab_lookup(ids, table.shape[0], self.axis_name, lambda i: jnp.take(table, i, axis=0))
        if self.sequence_axis is None:
            return row_reduce(partial, self.axis_name)
        require_sequence_divisible(
            module_path(self.path, "embedding"),
            ids.shape[self.sequence_axis],
            self.sequence_axis,
            self.axis_name,
        )
        return row_reduce(partial, self.axis_name, self.sequence_axis)

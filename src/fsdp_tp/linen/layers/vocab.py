"""Vocabulary-parallel embedding and cross-entropy: the vocab dim split over a mesh axis."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..._aliases import aliases_of
from ..._axes import TENSOR
from ..._renamed import DEPRECATED, RenamedFields
from ..._tree import module_path
from ...tp import Layer, VocabParallel
from .dense import split_names, split_param

__all__ = ["VocabParallelEmbed"]

__getattr__ = aliases_of(__name__)  # 0.1's vocab_parallel_cross_entropy here (fsdp_tp._aliases)


class VocabParallelEmbed(RenamedFields, nn.Module):
    """``nn.Embed`` with the table split on the vocab dim over ``axis``: the role
    :class:`~fsdp_tp.tp.VocabParallel` on this device's rows of the table.

    Each device looks the ids up in its rows, zeros the ids it does not hold,
    and the partial rows are summed over the axis — or, with
    ``sequence_dim`` set (sequence parallelism), reduce-scattered along that
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
    axis: str = TENSOR
    sequence_dim: int | None = None
    axis_name: Any = DEPRECATED  # 0.2's name of `axis`
    sequence_axis: Any = DEPRECATED  # 0.2's name of `sequence_dim`

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        role = VocabParallel(self.axis, sequence_dim=self.sequence_dim)
        path = module_path(self.path) or type(self).__name__  # (errors name a top-level layer by class)
        layer = Layer(kind="embed", path=path, num_embeddings=self.num_embeddings, norms_summed=True)
        shape = (self.num_embeddings, self.features)
        names = split_names(role.splits(layer), "embedding", 2, self.axis)
        table = split_param(self, "embedding", self.embedding_init, shape, self.param_dtype, names)
        (table,) = nn.dtypes.promote_dtype(table, dtype=self.dtype, inexact=False)
        return role.around("__call__", lambda i: jnp.take(table, i, axis=0), layer, (ids,), {})

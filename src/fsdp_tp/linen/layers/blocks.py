"""Transformer blocks built from the parallel layers, with unsharded twins in the same class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..._axes import TENSOR
from ..._renamed import DEPRECATED, RenamedFields
from .dense import ColumnParallelDense, RowParallelDense

__all__ = ["MLPBlock"]


class MLPBlock(RenamedFields, nn.Module):
    """Dense(hidden) → activation → Dense(out): the transformer MLP, split Megatron-style.

    With ``axis`` set, ``wi`` is column-parallel and ``wo`` row-parallel
    over it: one all-reduce forward and one backward per block. With
    ``axis=None`` it is the plain ``nn.Dense`` block, the unsharded twin
    with the same parameter tree.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh
    >>> mesh = make_mesh({"tensor": 8})
    >>> x = jnp.ones((2, 16))
    >>> plain = MLPBlock(64, axis=None).init(jax.random.key(0), x)["params"]
    >>> split, specs = init_sharded(lambda rng, x: MLPBlock(64).init(rng, x)["params"], mesh,
    ...                             (P(), P()), jax.random.key(0), x)
    >>> specs["wi"]["kernel"], specs["wo"]["kernel"]
    (P(None, 'tensor'), P('tensor', None))
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), nn.unbox(split), plain))
    True
    """

    hidden_features: int
    out_features: int | None = None
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    axis: str | None = TENSOR
    sequence_dim: int | None = None  # input and output split along this dim (the sequence) over axis
    collective_matmul: str | None = None  # None, "unidirectional" or "bidirectional" (see RowParallelDense)
    axis_name: Any = DEPRECATED  # 0.2's name of `axis`
    sequence_parallel: Any = DEPRECATED  # 0.2's sequence_dim=1 (True)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        out = self.out_features or x.shape[-1]
        kw = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        wi: nn.Module
        wo: nn.Module
        if self.axis is None:
            wi, wo = nn.Dense(self.hidden_features, name="wi", **kw), nn.Dense(out, name="wo", **kw)
        else:
            ring = self.collective_matmul
            tp = dict(kw, axis=self.axis, sequence_dim=self.sequence_dim, collective_matmul=ring)
            wi = ColumnParallelDense(self.hidden_features, name="wi", **tp)
            wo = RowParallelDense(out, name="wo", **tp)
        return wo(self.activation(wi(x)))

"""Vocabulary-parallel embedding and cross-entropy: the vocab dim split over a mesh axis."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..._tree import module_path
from ...collectives import require_sequence_divisible
from ...tp import row_reduce, vocab_lookup, vocab_start
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(logits, labels, axis_name):
    return _cross_entropy_fwd(logits, labels, axis_name)[0]


def _cross_entropy_fwd(logits, labels, axis_name):
    width = logits.shape[-1]
    local = labels - vocab_start(width, axis_name)
    hit = (local >= 0) & (local < width)
    # Only per-token scalars cross the wire: the max, the sum of exps, the target logit.
    peak = jax.lax.pmax(jax.lax.stop_gradient(logits.max(axis=-1)), axis_name)
    shifted = logits - peak[..., None]
    exps = jnp.exp(shifted)
    total = jax.lax.psum(exps.sum(axis=-1), axis_name)
    picked = jnp.take_along_axis(shifted, jnp.where(hit, local, 0)[..., None], axis=-1)[..., 0]
    target = jax.lax.psum(jnp.where(hit, picked, 0.0), axis_name)
    return jnp.log(total) - target, (exps / total[..., None], local, hit, labels)


def _cross_entropy_bwd(axis_name, residuals, g):
    probs, local, hit, labels = residuals
    onehot = jax.nn.one_hot(jnp.where(hit, local, -1), probs.shape[-1], dtype=probs.dtype)
    return g[..., None] * (probs - onehot), np.zeros(labels.shape, jax.dtypes.float0)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def vocab_parallel_cross_entropy(
    logits: jax.Array, labels: jax.Array, axis_name: str = "tensor"
) -> jax.Array:
    """Per-token softmax cross-entropy of logits split on the vocab (last) dim over ``axis_name``.

    ``logits``: this device's vocab slice, ``(..., vocab / axis size)``;
    ``labels``: global token ids, the same on every device of the axis.
    Returns ``(...)`` losses, the same on every device; the full logits are
    never gathered. The backward pass is explicit (softmax minus one-hot on
    the local slice), so it is right with and without ``check_vma``.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> logits, labels = jax.random.normal(jax.random.key(0), (3, 8)), jnp.array([1, 6, 3])
    >>> f = jax.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, "tensor"), P()),
    ...                   out_specs=P())
    >>> ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    >>> bool(jnp.allclose(f(logits, labels), ref, rtol=1e-6))
    True
    """
    return _cross_entropy(logits, labels, axis_name)

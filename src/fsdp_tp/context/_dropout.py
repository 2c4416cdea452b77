"""Attention dropout across the sequence split: each block of scores a device computes drops
with its block of the mask the unsharded model draws (:class:`AttentionDropout`).

Flax's attention draws one ``jax.random.bernoulli(rng, 1 - rate, (B, H, S, S))`` (or
``(1, 1, S, S)``, ``broadcast_dropout``) over the softmax's weights. A device of the ring
holds the weights of its queries against one visiting block of keys at a time: two runs of
the sequence, the queries' chunk and the keys' (:class:`~fsdp_tp.dropout.Window`), at
offsets the ring knows only when it runs (the visiting device is ``me - hop``), and its rows
and heads split as the step splits them. :meth:`AttentionDropout.keep` draws exactly that
block of the unsharded draw, in the forward and again in the backward, so no mask is ever
stored or sent.

>>> import jax, jax.numpy as jnp
>>> drop = AttentionDropout(0.5, broadcast=False)
>>> key = jax.random.key_data(jax.random.key(0))
>>> block = drop.keep(key, (2, 4, 8, 8), 2, (jnp.int32(8), jnp.int32(0)), 32, jnp.float32)
>>> full = jax.random.bernoulli(jax.random.key(0), 0.5, (2, 4, 32, 32))[:, :, 8:16, 0:8]
>>> block.shape, bool((block.reshape(2, 4, 8, 8) == 2.0 * full).all())   # (B, G, r, q, k), 1/keep kept
((2, 2, 2, 8, 8), True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..dropout._block_key import Window, block_key

__all__ = ["AttentionDropout"]


@dataclasses.dataclass(frozen=True)
class AttentionDropout:
    """Flax's attention dropout at ``rate`` (``broadcast``: one mask over rows and heads, flax's
    ``broadcast_dropout``), on attention weights whose rows are split over the mesh axes
    ``rows`` and heads over ``heads`` (box-name entries: ``None``, an axis, or axes major
    first), as the step splits them."""

    rate: float
    broadcast: bool = True
    rows: Any = None
    heads: Any = None

    def keep(self, key, shape: Sequence[int], groups: int, starts, total: int, dtype) -> jax.Array:
        """The multipliers (``0`` or ``1 / keep_prob``, of ``dtype``) of this device's block of
        weights of local shape ``shape`` ``(B, H, c_q, c_k)``, its queries and keys the runs
        of the sequence of ``total`` tokens from ``starts`` ``(q, k)``; as the blocks take them,
        ``(B or 1, groups, H / groups or 1, c_q, c_k)``. ``key``: the unsharded key's data."""
        c_q, c_k = shape[2:]
        if self.broadcast:
            shape, split = (1, 1, c_q, c_k), (None, None, Window(total), Window(total))
        else:
            split = (self.rows, self.heads, Window(total), Window(total))
        keep_prob = 1.0 - self.rate
        drawn_from = block_key(key, split, "attention dropout", starts)
        kept = jax.random.bernoulli(drawn_from, keep_prob, tuple(shape))
        kept = kept.reshape(shape[0], groups if shape[1] > 1 else 1, -1, c_q, c_k)
        return kept.astype(dtype) / jnp.asarray(keep_prob, dtype)

"""The steps the roles of :mod:`fsdp_tp.tp` share around a layer's call (the column and row
pair, the heads, the vocabulary): Megatron's *f* once per distinct input (:func:`copied`), and a
ring's chunks computed as they arrive (:func:`chunkwise`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..collective_matmul import RingChunks
from ._einsum import Equation
from ._role import Layer
from .pieces import column_input

__all__ = ["chunkwise", "copied"]


def copied(
    args: tuple, kwargs: dict, axis: str, sequence_dim: int | None = None, ring: str | None = None
) -> tuple[tuple, dict]:
    """Megatron's *f* on every floating array input, once per distinct array (self-attention
    passes one array as q, k and v: one backward all-reduce, not three); with
    ``sequence_dim``, the all-gather of the sequence slices instead (its backward
    reduce-scatters), or with ``ring`` its ``ppermute`` ring: the chunks as they arrive
    (:class:`~fsdp_tp.collective_matmul.RingChunks`), which the layers multiply one by one."""
    done: dict[int, Any] = {}

    def copy(x):
        if not (isinstance(x, jax.Array | jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if id(x) not in done:
            done[id(x)] = column_input(x, axis, sequence_dim, ring if sequence_dim is not None else None)
        return done[id(x)]

    return tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}


def chunkwise(run, layer: Layer, args: tuple, kwargs: dict):
    """``run`` on its input, or on each ring chunk as it arrives (the results in sequence
    order, where the layer puts the sequence: an einsum may move it): a layer that computes
    each position alone (a dense layer, an einsum over features)."""
    if not (args and isinstance(args[0], RingChunks)):
        return run(*args, **kwargs)
    chunks = args[0]
    out_dim = None
    if layer.kind == "einsum":
        eq = Equation.parse(layer.equation, layer.path)
        out_dim = eq.output_dim(chunks.dim, len(chunks.shape))
    return chunks.map(lambda chunk: run(chunk, *args[1:], **kwargs), out_dim)

"""The steps the roles of :mod:`fsdp_tp.tp` share around a layer's call: Megatron's *f* once
per distinct input (:func:`copied`), a ring's chunks computed as they arrive (:func:`chunkwise`),
an einsum's split letter, and the layers a split cannot take (a ring over a convolution, a
grouped convolution's channels), each refused with its fix.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._einsum import Equation, split_letter
from ..collective_matmul import RingChunks
from ..errors import RuleError
from ._role import Layer, TPRole
from .pieces import column_input

__all__ = [
    "chunkwise",
    "copied",
    "einsum_split",
    "ringable",
    "ungrouped",
]


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


def ringable(role: TPRole, layer: Layer, sequence: int | None) -> None:
    """A ring computes the layer chunk by chunk of the rows: a convolution's window reads its
    neighbours' rows, and an einsum's rows are the sequence only it names."""
    if layer.kind == "conv":
        why, fix = "reads its neighbours' rows", "."
    elif layer.kind == "einsum" and sequence is None:
        why, fix = "has no rows without sequence_dim", ", or give the role sequence_dim."
    else:
        return
    mode = getattr(role, "collective_matmul", None)
    raise RuleError(
        f"{layer.path}: {type(role).__name__}(collective_matmul={mode!r}) "
        f"computes the layer on chunks of its rows, and a {layer.kind} layer {why}; pass "
        f"collective_matmul=None{fix}"
    )


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


def ungrouped(layer: Layer) -> None:
    """A grouped convolution mixes channels within groups only: a channel split would cut
    across the groups, so it stays whole."""
    if layer.groups != 1:
        raise RuleError(
            f"{layer.path} is a convolution with feature_group_count={layer.groups}: splitting its "
            f"channels over a mesh axis would cut across its groups. Leave {layer.path} whole (drop "
            f"it from the tp rules)."
        )


def einsum_split(layer: Layer, role: TPRole, letter: str | None, what: str) -> tuple[Equation, str, int]:
    """An einsum layer's equation, the letter ``role`` splits and its kernel dim (``""`` and
    0 for another kind, which takes no ``letter``)."""
    return split_letter(layer.kind, layer.equation, layer.path, type(role).__name__, letter, what)

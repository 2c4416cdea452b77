"""The role of an embedding: :class:`VocabParallel`, its table split on the vocabulary,
its ``attend`` (tied logits) computing this device's slice of the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax

from .._tree import module_path
from ..collectives import gather_from_axis, require_sequence_divisible
from ..dropout import split_after
from ._around import copied
from ._role import Local, TPRole
from .pieces import row_reduce, vocab_lookup

__all__ = ["VocabParallel"]


@dataclass(frozen=True)
class VocabParallel(TPRole):
    """An embedding with the table split on the vocabulary: each device looks up the ids
    in its range (zeros for the others) and the rows are summed over the axis. ``attend``
    (logits tied to the table) computes this device's vocabulary slice and gathers it.
    ``sequence_dim``: the looked-up rows are reduce-scattered along it (each device leaves
    with its slice of the sequence), and ``attend`` all-gathers it first."""

    sequence_dim: int | None = None
    kinds: ClassVar[tuple[str, ...]] = ("embed",)
    methods: ClassVar[frozenset[str]] = frozenset({"__call__", "attend"})

    def splits(self, layer):
        return {"embedding": -2}

    def divides(self, layer):
        return {"num_embeddings": layer.num_embeddings}

    def local(self, layer, size):
        return Local(num_embeddings=layer.num_embeddings // size)

    def call(self, method, run, layer, args, kwargs):
        sequence = self.sequence_dim
        split_after({})  # the logits gathered: whole (the lookup's sum says what it leaves)
        if method == "attend":
            args, kwargs = copied(args, kwargs, self.axis, sequence)
            return gather_from_axis(run(*args, **kwargs), -1, self.axis)
        ids, *rest = args
        if sequence is not None:
            where = module_path((layer.path,), "embedding")
            require_sequence_divisible(where, ids.shape[sequence], sequence, self.axis)
        rows = layer.num_embeddings // jax.lax.axis_size(self.axis)
        lookup = vocab_lookup(ids, rows, self.axis, lambda i: run(i, *rest, **kwargs))
        return row_reduce(lookup, self.axis, sequence)  # summed, or scattered along the sequence

"""The role of a multi-head attention module: :class:`HeadParallel`, its heads split over
the axis, its projections computed by the column and row roles."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from ..dropout import split_after, splitting
from ..errors import RuleError
from ._around import chunkwise, copied
from ._matmul import RowParallel
from ._role import Layer, Local, TPRole
from .pieces import kept_block

__all__ = ["HeadParallel"]


@dataclass(frozen=True)
class HeadParallel(TPRole):
    """Multi-head attention: each device computes ``num_heads / size`` heads; query, key and
    value are split on the heads dim, the output projection on its heads dim
    (:class:`RowParallel`), so the block has one all-reduce forward and one backward.
    Inside, activations are split on the heads (the attention weights' dim -3), which is
    where a dropout mask is drawn by heads (:mod:`fsdp_tp.dropout`). ``sequence_dim``: the
    inputs' sequence slices are all-gathered first and the output reduce-scattered along it.
    ``replicated_kv`` (a module with ``num_kv_heads``: grouped-query attention with fewer kv
    heads than devices): the key and value projections stay whole on every device, and each
    device projects with the block of kv heads its query heads read
    (:func:`~fsdp_tp.tp.pieces.kept_block`: their gradients are summed over the axis, one more
    all-reduce backward per projection than a split). ``collective_matmul`` (with
    ``sequence_dim``): the gather of the inputs and the output projection's reduce-scatter as
    ``ppermute`` rings, the query, key and value projections computed chunk by chunk."""

    sequence_dim: int | None = None
    replicated_kv: bool = False
    collective_matmul: str | None = None
    kinds: ClassVar[tuple[str, ...]] = ("attention",)

    def splits(self, layer):
        projections = ("query",) if self._kept(layer) else ("query", "key", "value")
        return {f"{proj}/{name}": -2 for proj in projections for name in ("kernel", "bias")}

    def kept_whole(self, layer):
        if not self._kept(layer):
            return ()
        return tuple(f"{proj}/{name}" for proj in ("key", "value") for name in ("kernel", "bias"))

    def divides(self, layer):
        heads = {"num_heads": layer.num_heads}
        if layer.num_kv_heads and layer.num_kv_heads != layer.num_heads and not self._kept(layer):
            heads["num_kv_heads"] = layer.num_kv_heads
        return heads  # (kept kv heads: they and the axis size, one divides the other, per call)

    def local(self, layer, size):
        kv_heads = layer.num_kv_heads or layer.num_heads
        if not self._kept(layer):
            return Local(num_heads=layer.num_heads // size, num_kv_heads=kv_heads // size)
        kept = functools.partial(
            kept_block, dim=-2, blocks=kv_heads, axis=self.axis, where=layer.path, what="num_kv_heads"
        )
        return Local(
            num_heads=layer.num_heads // size,
            num_kv_heads=max(1, kv_heads // size),
            read=dict.fromkeys(self.kept_whole(layer), kept),
        )

    def _kept(self, layer: Layer) -> bool:
        if self.replicated_kv and not layer.num_kv_heads:
            raise RuleError(
                f"{layer.path}: HeadParallel(replicated_kv=True) keeps a grouped-query attention's kv "
                f"heads whole, and this attention module has no num_kv_heads (each head has its own "
                f"key and value). Drop replicated_kv."
            )
        return self.replicated_kv

    def inner(self):
        ring, sequence = self.collective_matmul, self.sequence_dim
        roles: dict[str, TPRole] = {
            "out": RowParallel(self.axis, sequence_dim=sequence, collective_matmul=ring)
        }
        if ring is not None and sequence is not None:  # the projections get the ring's chunks
            roles |= dict.fromkeys(("query", "key", "value"), _ChunkWise(self.axis))
        return roles

    def call(self, method, run, layer, args, kwargs):
        """``run`` computes this device's heads, its projections by their roles (``inner``)."""
        sequence = self.sequence_dim
        args, kwargs = copied(args, kwargs, self.axis, sequence, self.collective_matmul)
        with splitting({-3: self.axis}):  # (..., heads, queries, keys) weights
            out = run(*args, **kwargs)
        # what leaves: whole, or this device's slice of the sequence (out's reduce-scatter)
        split_after({} if sequence is None else {sequence - out.ndim: self.axis}, out.shape)
        return out


@dataclass(frozen=True)
class _ChunkWise(TPRole):
    """A projection inside a role's module (attention's query, key, value) that the module
    hands the ring's chunks: computed chunk by chunk, its split and sizes the outer role's."""

    kinds: ClassVar[tuple[str, ...]] = ("dense", "einsum")

    def splits(self, layer):
        return {}

    def divides(self, layer):
        return {}

    def call(self, method, run, layer, args, kwargs):
        return chunkwise(run, layer, args, kwargs)

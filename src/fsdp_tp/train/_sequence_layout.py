"""The batch laid out over the ``context`` axis as a train step runs it: which batch dims the
axis splits (:func:`step_split`), and the batch laid out over it on the way in and the outputs
back (:class:`LaidOut`).

A batch spec that names ``context`` on a leaf's dim past the first (``P("data", "context")``:
the sequence dim) is the whole request: :func:`~fsdp_tp.shard_step` lays each such leaf out as
:class:`~fsdp_tp.context.SequenceSplit` says (balanced by default), so the devices' tokens are
the chunks the ring expects, and puts the outputs it returns back in the user's order. Inside,
the axis is a batch axis (gradients and FSDP's gathers average over it) and the library's
attention computes over every device's keys (:mod:`fsdp_tp.context._across`).

>>> from jax.sharding import PartitionSpec as P
>>> step_split({"tokens": P("data", "context"), "doc": P("data")}, {"data": 2, "context": 4})
SequenceSplit(axis='context', balanced=True, strategy='ring')
>>> step_split(P("data"), {"data": 8}) is None
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._axes import entry_axes
from .._sequence_split import SequenceSplit
from .._types import Specs

__all__ = ["LaidOut", "step_split"]

_is_spec = lambda s: isinstance(s, PartitionSpec)


def _dims_over(spec: PartitionSpec, axis: str) -> list[tuple[int, Any]]:
    """The dims of ``spec`` whose entry names ``axis``, with the entry."""
    return [(dim, entry) for dim, entry in enumerate(spec) if axis in entry_axes(entry)]


def step_split(
    batch_specs: Specs,
    sizes: Mapping[str, int],
    given: SequenceSplit | None = None,
    where: str = "shard_step",
) -> SequenceSplit | None:
    """The sequence split ``batch_specs`` ask for on a mesh of ``sizes``: ``given`` (or the
    default :class:`SequenceSplit`) where a leaf's dim past the first is split over its axis,
    else ``None``. Refused: the axis sharing a dim with another axis, or on dim 0 (a batch
    axis there, not the sequence's), and a ``given`` split its batch specs do not name."""
    split = given or SequenceSplit()
    specs = [s for s in jax.tree.leaves(batch_specs, is_leaf=_is_spec) if _is_spec(s)]
    found = False
    for spec in specs:
        for dim, entry in _dims_over(spec, split.axis):
            if dim == 0 or entry != split.axis:
                raise ValueError(
                    f"{where}: batch spec {spec} names the sequence axis {split.axis!r} "
                    f"{'on dim 0, the rows' if dim == 0 else f'with other axes on dim {dim} ({entry!r})'}; "
                    f"the sequence split takes a dim of its own past the rows: P(('data', 'fsdp'), "
                    f"{split.axis!r}) for (rows, tokens, ...)."
                )
            found = True
    if not found:
        if given is None:
            _refuse_other_splits(specs, split.axis, where)
        if given is not None:
            raise ValueError(
                f"{where}: sequence={given} splits the sequence over {split.axis!r}, but no batch spec "
                f"names {split.axis!r} ({specs}); split each per-token leaf's sequence dim over it, "
                f"e.g. P('data', {split.axis!r})."
            )
        return None
    if split.axis not in sizes:
        raise ValueError(
            f"{where}: the batch specs split the sequence over {split.axis!r}, which is no axis of the "
            f"mesh ({dict(sizes)}); add it (make_mesh({{..., {split.axis!r}: n}})) or drop it from the specs."
        )
    return split


def _refuse_other_splits(specs: list[PartitionSpec], axis: str, where: str) -> None:
    """A leaf's dim past the rows split over another axis than the sequence split's: the step
    would take it for rows split over the first dim's axes alone, and each device would compute
    on its block of that dim as if it were the whole (the split named: ``SequenceSplit(axis=...)``)."""
    for spec in specs:
        for dim, entry in enumerate(spec):
            named = entry_axes(entry)
            if dim == 0 or not named:
                continue
            fix = (
                f"pass sequence=SequenceSplit(axis={named[0]!r}) (fsdp_tp.context.SequenceSplit) to "
                f"split the sequence over it"
                if len(named) == 1
                else "split the sequence over one axis, named by sequence=SequenceSplit(axis=...)"
            )
            raise ValueError(
                f"{where}: batch spec {spec} splits dim {dim} over {entry!r}, past the rows; a step splits "
                f"a leaf's dims past the rows only as its sequence, over the axis its sequence split names "
                f"({axis!r} unless told): {fix}, with attention computed across it, or leave dim {dim} "
                f"whole (P({spec[0]!r}))."
            )


def _normal(spec: PartitionSpec) -> tuple:
    """``spec``'s entries, trailing ``None`` dropped: ``P("data", "context")`` is
    ``P("data", "context", None)``."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """``split`` over ``size`` devices, applied to trees by their specs: each leaf of the batch
    whose spec splits a dim over the split's axis is reordered on that dim (:meth:`batch`, the
    way in), and each output laid out as such a leaf of ``batch_specs`` is, back
    (:meth:`outputs`): a per-token output, never a parameter's gradient stored over the axis."""

    split: SequenceSplit
    size: int
    batch_specs: Specs

    def batch(self, tree: Any) -> Any:
        return self._each(tree, self.batch_specs, self.split.to_devices, None)

    def tokens(self, tree: Any) -> int | None:
        """A device's tokens a sequence in its block of the batch ``tree`` (``None``: the
        leaves the split lays out differ in length)."""
        found: set[int] = set()

        def each(spec, sub):
            if _is_spec(spec) and (dims := _dims_over(spec, self.split.axis)):
                found.update(x.shape[dims[0][0]] for x in jax.tree.leaves(sub))

        jax.tree.map(each, self.batch_specs, tree, is_leaf=_is_spec)
        return found.pop() if len(found) == 1 else None

    def require_per_token(self, tree: Any, where: str = "shard_step") -> None:
        """Refuses, naming the leaf's path, a batch leaf laid out otherwise than the tokens: one
        with the sequence's length on dim 1 that its spec leaves whole (each device would read
        every token's against its own), or one split like the tokens of another length (a
        target cut by a shift: shifted with the batch it keeps the length)."""
        leaves: list[tuple[str, Any, PartitionSpec]] = []

        def each(path, spec, sub):
            for inner, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
                leaves.append((jax.tree_util.keystr((*path, *inner)), x, spec))

        jax.tree_util.tree_map_with_path(each, self.batch_specs, tree, is_leaf=_is_spec)
        split = {
            name: (x, spec)
            for name, x, spec in leaves
            if _is_spec(spec) and _dims_over(spec, self.split.axis)
        }
        at = lambda x, spec: x.shape[_dims_over(spec, self.split.axis)[0][0]]
        if not split:
            return
        first, (longest, spec) = max(split.items(), key=lambda item: at(*item[1]))
        length = at(longest, spec)
        for name, (x, leaf_spec) in split.items():
            if at(x, leaf_spec) != length:
                raise ValueError(
                    f"{where}: batch leaf {name} {tuple(x.shape)} is split over {self.split.axis!r} with "
                    f"{at(x, leaf_spec)} tokens where {first} has {length}: every leaf the split lays out "
                    f"holds the same tokens. A target cut by a shift (tokens[:, 1:]) is shifted with the "
                    f"batch instead, keeping the length: targets, weights = "
                    f"fsdp_tp.context.next_token_targets(tokens, segment_ids)."
                )
        for name, x, leaf_spec in leaves:
            if name in split or getattr(x, "ndim", 0) < 2 or x.shape[1] != length:
                continue
            raise ValueError(
                f"{where}: batch leaf {name or 'batch'} {tuple(x.shape)} holds the sequence's {length} "
                f"tokens on dim 1, but its spec {leaf_spec} leaves them whole while the tokens' ({first}: "
                f"{spec}) split them over {self.split.axis!r}: each device would read all {length} "
                f"against its {length // self.size}. Give it the tokens' spec, {spec}."
            )

    def outputs(self, tree: Any, specs: Specs) -> Any:
        """``tree`` (a step's outputs by ``specs``) with each per-token leaf back in the batch's
        order: one whose spec starts as a split batch leaf's does — the rows and the sequence
        alike; dims past those free (logits split on their vocabulary over ``tensor``,
        ``P("data", "context", "tensor")``, are per-token too)."""
        per_token = {
            _normal(s)
            for s in jax.tree.leaves(self.batch_specs, is_leaf=_is_spec)
            if _is_spec(s) and _dims_over(s, self.split.axis)
        }
        return self._each(tree, specs, self.split.from_devices, per_token)

    def _each(self, tree, specs, move, only: set | None):
        def leaf(spec, x):
            dims = _dims_over(spec, self.split.axis) if _is_spec(spec) else []
            if not dims or (only is not None and not any(tuple(spec)[: len(b)] == b for b in only)):
                return x
            return move(x, dims[0][0], self.size)

        each = lambda spec, sub: jax.tree.map(lambda x: leaf(spec, x), sub)
        return jax.tree.map(each, specs, tree, is_leaf=_is_spec)

"""Checkpoint names to parameter paths: declarative rules, each a regex over the checkpoint's
tensor names, the parameter path it fills (the regex's groups substituted), the views that turn
the stored tensor into the parameter's layout, and where in the parameter's stacked leading dims
it goes (a scanned model's layers, an expert bank's experts, a fused key/value kernel's two).

Views are invertible on blocks: a device's block of the parameter maps back to a box of the stored
tensor (:meth:`Source.box`), so a load reads only that box (:mod:`fsdp_tp.hub.load`).

- :class:`Transpose` (a ``(out, in)`` Linear weight to an ``(in, out)`` kernel),
- :class:`SplitDim` (a dim of ``heads * head_dim`` to its two dims: "reshape to heads"),
- :class:`Take` (one part of a fused tensor: Phi-3's ``qkv_proj``, ``gate_up_proj``).

>>> import numpy as np
>>> views = (Transpose(), SplitDim(1, (2, -1)))  # (N * H, D) -> (D, N, H)
>>> rule = Rule(r"layers\\.(\\d+)\\.q\\.weight", "blocks/q/kernel", views, at=(r"\\1",))
>>> stored = {"layers.0.q.weight": (6, 4), "layers.1.q.weight": (6, 4)}
>>> plan = match([rule], stored, {"blocks/q/kernel": (2, 4, 2, 3)})
>>> [(s.name, s.at) for s in plan["blocks/q/kernel"]]
[('layers.0.q.weight', (0,)), ('layers.1.q.weight', (1,))]
>>> source = plan["blocks/q/kernel"][1]
>>> source.box(((0, 4), (1, 2), (0, 3)))  # head 1 of the kernel: rows 3..6 of the weight
((3, 6), (0, 4))
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import CheckpointMismatchError

__all__ = ["Rule", "Source", "SplitDim", "Take", "Transpose", "View", "box_of", "match"]

Box = tuple[tuple[int, int], ...]


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A device's block ``index`` (JAX's slices) as ``(start, stop)`` a dim: ``((0, 3), (2, 4))``
    for ``(slice(None), slice(2, 4))`` of ``(3, 8)``."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


class View:
    """One step from the stored tensor towards the parameter: its output ``shape``, the box of
    its input that an output box needs (``cover``), and the output block from that input block."""

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError

    def cover(self, box: Box, shape: tuple[int, ...]) -> Box:
        raise NotImplementedError

    def apply(self, block: np.ndarray, box: Box, shape: tuple[int, ...]) -> np.ndarray:
        raise NotImplementedError

    def undo(self, block: np.ndarray, box: Box, shape: tuple[int, ...]) -> np.ndarray:
        """The input block (of :meth:`cover`'s box) that gives output ``block`` (of ``box``):
        the way back, for an export."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Transpose(View):
    """The dims in the order ``perm`` (default: reversed)."""

    perm: tuple[int, ...] | None = None

    def _perm(self, ndim: int) -> tuple[int, ...]:
        return tuple(range(ndim))[::-1] if self.perm is None else tuple(self.perm)

    def shape(self, shape):
        perm = self._perm(len(shape))
        if sorted(perm) != list(range(len(shape))):
            raise ValueError(f"Transpose{perm} does not permute the {len(shape)} dims of {shape}")
        return tuple(shape[p] for p in perm)

    def cover(self, box, shape):
        covered: list = [None] * len(shape)
        for out_dim, in_dim in enumerate(self._perm(len(shape))):
            covered[in_dim] = box[out_dim]
        return tuple(covered)

    def apply(self, block, box, shape):
        return block.transpose(self._perm(block.ndim))

    def undo(self, block, box, shape):
        return block.transpose(np.argsort(self._perm(block.ndim)))


@dataclasses.dataclass(frozen=True)
class SplitDim(View):
    """Dim ``dim`` read as ``sizes`` row-major (one of them may be ``-1``): ``(N * H, D)`` to
    ``(N, H, D)`` is ``SplitDim(0, (N, -1))``."""

    dim: int
    sizes: tuple[int, ...]

    def _sizes(self, shape) -> tuple[int, ...]:
        known = math.prod(s for s in self.sizes if s != -1)
        sizes = tuple(shape[self.dim] // known if s == -1 else s for s in self.sizes)
        if math.prod(sizes) != shape[self.dim] or list(self.sizes).count(-1) > 1:
            raise ValueError(
                f"SplitDim{(self.dim, self.sizes)}: dim {self.dim} of {shape} is not {self.sizes}"
            )
        return sizes

    def shape(self, shape):
        return (*shape[: self.dim], *self._sizes(shape), *shape[self.dim + 1 :])

    def cover(self, box, shape):
        # Whole rows of the first split dim: a block that takes part of an inner one (a split of
        # head_dim itself) reads its rows whole and is sliced after.
        inner = math.prod(self._sizes(shape)[1:])
        (lo, hi), count = box[self.dim], len(self.sizes)
        return (*box[: self.dim], (lo * inner, hi * inner), *box[self.dim + count :])

    def apply(self, block, box, shape):
        sizes, d = self._sizes(shape), self.dim
        rows = block.reshape(*block.shape[:d], -1, *sizes[1:], *block.shape[d + 1 :])
        inner = tuple(slice(lo, hi) for lo, hi in box[d + 1 : d + len(sizes)])
        return rows[(slice(None),) * (d + 1) + inner]

    def undo(self, block, box, shape):
        sizes, d = self._sizes(shape), self.dim
        if any(box[d + i] != (0, n) for i, n in enumerate(sizes[1:], 1)):
            raise ValueError(f"a block {box} split inside dims {d + 1}.. of {sizes} is not a box of dim {d}")
        return block.reshape(*block.shape[:d], -1, *block.shape[d + len(sizes) :])


@dataclasses.dataclass(frozen=True)
class Take(View):
    """Entries ``start:stop`` of dim ``dim``: one part of a fused tensor."""

    dim: int
    start: int
    stop: int

    def shape(self, shape):
        if not 0 <= self.start < self.stop <= shape[self.dim]:
            raise ValueError(f"Take{(self.dim, self.start, self.stop)} is outside dim {self.dim} of {shape}")
        return (*shape[: self.dim], self.stop - self.start, *shape[self.dim + 1 :])

    def cover(self, box, shape):
        lo, hi = box[self.dim]
        return (*box[: self.dim], (lo + self.start, hi + self.start), *box[self.dim + 1 :])

    def apply(self, block, box, shape):
        return block

    def undo(self, block, box, shape):
        return block


@dataclasses.dataclass(frozen=True)
class Rule:
    """Tensors whose names ``pattern`` matches whole fill the parameter at ``path`` (``\\1``: the
    match's groups), through ``views`` in order, at index ``at`` of its leading stacked dims
    (each an int or a group reference such as ``r"\\1"``)."""

    pattern: str
    path: str
    views: tuple[View, ...] = ()
    at: tuple[int | str, ...] = ()
    also: tuple[tuple[str, tuple[View, ...]], ...] = ()  # more parameters it fills: a fused tensor's

    def targets(self) -> tuple[tuple[str, tuple[View, ...]], ...]:
        """Each ``(path, views)`` the tensor fills: one, or a fused tensor's parts (Phi-3's
        ``qkv_proj`` fills q, k and v, each through its :class:`Take`)."""
        return ((self.path, tuple(self.views)), *self.also)


@dataclasses.dataclass(frozen=True)
class Source:
    """Stored tensor ``name`` (of ``shape``) through ``views``, at ``at`` of its parameter."""

    name: str
    shape: tuple[int, ...]
    views: tuple[View, ...]
    at: tuple[int, ...]

    def shapes(self) -> list[tuple[int, ...]]:
        """The stored shape, then each view's output shape."""
        shapes = [self.shape]
        for view in self.views:
            shapes.append(view.shape(shapes[-1]))
        return shapes

    def box(self, box: Box) -> Box:
        """The box of the stored tensor that the parameter's ``box`` (its stacked dims dropped) needs."""
        for view, shape in zip(reversed(self.views), reversed(self.shapes()[:-1]), strict=True):
            box = view.cover(box, shape)
        return box

    def _boxes(self, box: Box) -> list[Box]:
        """The box of the stored tensor, then of each view's output, that ``box`` needs."""
        boxes = [box]
        for view, shape in zip(reversed(self.views), reversed(self.shapes()[:-1]), strict=True):
            boxes.append(view.cover(boxes[-1], shape))
        return boxes[::-1]

    def block(self, stored: np.ndarray, box: Box) -> np.ndarray:
        """The parameter's ``box`` from ``stored``, the stored tensor's :meth:`box` of it."""
        for view, shape, out_box in zip(self.views, self.shapes()[:-1], self._boxes(box)[1:], strict=True):
            stored = view.apply(stored, out_box, shape)
        return stored

    def unblock(self, value: np.ndarray, box: Box) -> tuple[Box, np.ndarray]:
        """The stored tensor's box and values that the parameter's ``value`` (its ``box``) is:
        the views undone, for an export."""
        boxes, shapes = self._boxes(box), self.shapes()
        for view, shape, out_box in zip(self.views[::-1], shapes[-2::-1], boxes[:0:-1], strict=True):
            value = view.undo(value, out_box, shape)
        return boxes[0], value


def match(
    rules: Sequence[Rule],
    stored: Mapping[str, tuple[int, ...]],
    params: Mapping[str, tuple[int, ...]],
    ignore: Sequence[str] = (),
    where=lambda name: "the checkpoint",
    done: str = "loaded",
) -> dict[str, list[Source]]:
    """Each parameter's sources, every stored tensor taken by the first rule matching it. Raises
    one :class:`~fsdp_tp.errors.CheckpointMismatchError` listing every problem, a line each: a
    tensor no rule takes (and no ``ignore`` pattern), a rule's path the model lacks, a shape that
    does not fit, two tensors for one place, a parameter (or a layer of one) nothing fills.
    ``where(name)`` names a tensor's file; ``done`` what did not happen ("nothing was loaded")."""
    compiled = [(re.compile(rule.pattern), rule) for rule in rules]
    skipped = [re.compile(pattern) for pattern in ignore]
    found: dict[str, dict[tuple[int, ...], Source]] = {path: {} for path in params}
    problems: list[str] = []
    for name in sorted(stored):
        hit = next(((m, rule) for pattern, rule in compiled if (m := pattern.fullmatch(name))), None)
        if hit is None:
            if not any(p.fullmatch(name) for p in skipped):
                problems.append(
                    f"tensor {name!r} ({where(name)}) matches no rule: add a Rule for it, or "
                    f"its pattern to ignore="
                )
            continue
        m, rule = hit
        at = tuple(int(m.expand(a)) if isinstance(a, str) else a for a in rule.at)
        for path, views in rule.targets():
            source = Source(name, tuple(stored[name]), views, at)
            problem = _placed(source, m.expand(path), params, found, where)
            if problem:
                problems.append(problem)
    for path, sources in found.items():
        stacked = params[path][: len(next(iter(sources.values())).at)] if sources else ()
        missing = [i for i in np.ndindex(*stacked) if i not in sources] if sources else [()]
        if missing:
            what = (
                "nothing fills it" if not sources else f"nothing fills index {missing[0]} of its stacked dims"
            )
            problems.append(
                f"parameter {path!r} of shape {tuple(params[path])}: {what} ({len(missing)} "
                f"missing): the checkpoint lacks those tensors, or no rule maps them"
            )
    if problems:
        raise CheckpointMismatchError(
            f"the checkpoint does not fit the model ({len(problems)} problems; nothing was {done}):\n  "
            + "\n  ".join(problems)
        )
    return {path: [sources[i] for i in sorted(sources)] for path, sources in found.items()}


def _placed(source: Source, path: str, params, found: dict, where) -> str | None:
    """``source`` recorded as filling ``path`` at its index, or the problem that stops it."""
    name, at = source.name, source.at
    if path not in params:
        return (
            f"tensor {name!r} ({where(name)}) maps to {path!r}, which the model lacks; its "
            f"parameters are like {sorted(params)[:3]}: fix the rule's path"
        )
    shape = params[path]
    try:
        viewed = source.shapes()[-1]
    except ValueError as err:
        return f"tensor {name!r} ({where(name)}) of shape {source.shape}: {err}"
    fits = len(at) + len(viewed) == len(shape) and tuple(shape[len(at) :]) == viewed
    if not fits or any(not 0 <= i < n for i, n in zip(at, shape, strict=False)):
        return (
            f"tensor {name!r} ({where(name)}) of shape {source.shape} gives {viewed} at {at} of {path!r}, "
            f"whose shape is {tuple(shape)}: the model's config is not the checkpoint's (sizes, layers, "
            f"heads) or the rule's views are wrong"
        )
    if at in found[path]:
        return (
            f"tensors {found[path][at].name!r} and {name!r} both fill {path!r} at {at}: "
            f"make the rules' patterns or indices tell them apart"
        )
    found[path][at] = source
    return None

"""Megatron's regions in a traced computation (:class:`~fsdp_tp._trace.graph.Graph`): from one
split of a parameter read by a matmul, every value that must then be split with it, until
each path ends in a matmul that sums the split away (a row layer) or the split meets
something that cannot take it (the reason the plan gives).

A region grows by the graph's relations (:class:`~fsdp_tp._trace.graph.Node`'s ``same``):
a value split on a dim splits every value its operations keep that dim's positions with,
forward and back. A matmul of an activation by a parameter (a *kernel*) is where Megatron's
layers are:

- the result split on a dim of the kernel's (its output features, its heads): a column
  layer, whose input stays whole (one *f* before it);
- the activation split on a dim the matmul contracts with the kernel: a row layer, whose
  result is summed over the axis and so whole again;
- a table looked up on its split rows (an embedding): its result is summed, whole.

Anything else that mixes a split dim (a norm's mean over the features, a sum of two
activations' products over it, a loop's carry, an operation the finder does not know) ends
the region with its reason; so does a split that must reach a value that stays whole (the
model's input, a column layer's input, a row layer's sum).

A value's split is a tuple of dims. One dim: split over the axis (or, where the axis is
larger than the dim, each device one block of it, shared: kv heads kept whole). Two dims,
where a reshape meets an axis larger than a group's major dim: each device one block of the
first (shared by ``size / n`` devices) and its share of the second, e.g. 8 query heads
regrouped as 2 kv groups of 4 on an axis of 4 (each device a group, 2 of its 4 heads) — or
a kv projection's 16 features as 2 heads of 8 (half a head each, whose dims attention
contracts: refused there).
"""

from __future__ import annotations

import dataclasses

from ..._trace.graph import Graph, Node, contracted_pairs, kernel_operand
from ..._trace.relations import shape_text
from ..._trace.sites import source_of, user_site

__all__ = ["Refused", "Region", "grow"]

Split = tuple[int, ...]


class Refused(Exception):
    """A region that cannot be: ``str`` is why, in the model's terms."""


@dataclasses.dataclass
class Region:
    """The values split (``{value: dims}``), the matmuls of column and row layers, the tables
    looked up on their split rows, and whether a split reaches the model's output."""

    split: dict[int, Split] = dataclasses.field(default_factory=dict)
    columns: set[int] = dataclasses.field(default_factory=set)
    rows: set[int] = dataclasses.field(default_factory=set)
    lookups: set[int] = dataclasses.field(default_factory=set)
    output: bool = False

    def params(self, graph: Graph) -> dict[str, int]:
        """``{parameter path: its split dim, counted from the end}``."""
        out = {}
        for value, dims in self.split.items():
            if value in graph.params:
                if len(dims) != 1:
                    raise Refused(f"{graph.params[value]} would be split on two dims at once")
                out[graph.params[value]] = dims[0] - len(graph.shapes[value])
        return out


def grow(
    graph: Graph, kernels: dict[int, int], seed: tuple[int, int], outputs_split: bool, size: int | None = None
) -> Region:
    """The region of ``seed`` (``(value, dim)`` split over an axis of ``size``, ``None``:
    any that divides), or :class:`Refused` with the reason. ``outputs_split``: the model's
    outputs may leave split (else a split reaching one is gathered there, which one column
    layer alone may do)."""
    grower = _Grower(graph, kernels, size)
    grower.split(seed[0], (seed[1],), "the seed")
    grower.run()
    region = grower.region
    if reached := [v for v in graph.outputs if v in region.split]:
        region.output = True
        if not outputs_split and (region.rows or len(region.columns) != 1):
            raise Refused(f"the model's output {shape_text(graph.shapes[reached[0]])} would leave split")
    return region


class _Grower:
    def __init__(self, graph: Graph, kernels: dict[int, int], size: int | None):
        self.graph, self.kernels, self.size = graph, kernels, size
        self.region = Region()
        self.whole = {v: "the model's input" for v in graph.inputs} | {
            v: "a constant" for v in graph.constants
        }
        self.queue: list[int] = []

    def split(self, value: int | None, dims: Split, why: str) -> None:
        """``value`` split on ``dims``; one known split finer than another (more dims, the
        same first ones) is the same split seen from a value that lacks a dim."""
        if value is None or not dims:
            return
        if value in self.whole:
            raise Refused(f"{why} would split {self.whole[value]}")
        known = self.region.split.get(value)
        if known is not None and known[: len(dims)] == dims:
            return
        if known is not None and dims[: len(known)] != known:
            raise Refused(
                f"{why} would split a value of {_shape(self.graph, value)} on dims {known} and {dims}"
            )
        self.region.split[value] = dims
        self.queue.append(value)

    def keep_whole(self, value: int | None, what: str) -> None:
        if value is not None and value in self.region.split:
            raise Refused(f"{what} would be split")
        if value is not None:
            self.whole.setdefault(value, what)

    def run(self) -> None:
        graph, kernels = self.graph, self.kernels
        while self.queue:
            value = self.queue.pop()
            dims = self.region.split[value]
            made = graph.producer.get(value)
            if made is not None and value in kernels and not any(i in kernels for i in graph.nodes[made].ins):
                made = None  # a parameter's split is its own, not that of what an init made it from
            for index in sorted({made, *graph.users.get(value, ())} - {None}):
                self.visit(index, value, dims)

    def visit(self, index: int, value: int, dims: Split) -> None:
        node = self.graph.nodes[index]
        try:
            self._visit(index, node, value, dims)
        except Refused as why:
            site = user_site(source_of(node))
            if site is None or getattr(why, "placed", False):
                raise
            placed = Refused(f"{why} at {site}")  # (the model's line that refuses the split)
            placed.placed = True  # type: ignore[attr-defined]
            raise placed from None

    def _visit(self, index: int, node: Node, value: int, dims: Split) -> None:
        if node.prim in ("dot_general", "conv_general_dilated"):
            self.matmul(index, node, value, dims)
        elif node.prim == "gather" and value == node.ins[0] and dims[0] in node.params["looked_up"]:
            if value not in self.kernels or len(dims) != 1:
                raise Refused(f"gather looks up rows of a split {_shape(self.graph, value)}")
            self.region.lookups.add(index)  # a vocabulary role: rows looked up on each slice, summed
            self.keep_whole(node.outs[0], "an embedding's looked-up rows (summed over the axis)")
        elif node.prim == "reshape" and self.size is not None:
            self.reshape(node, value, dims)
        else:
            self.along(node, value, dims)

    def along(self, node: Node, value: int, dims: Split) -> None:
        """Every value of ``node`` split on the dims its relations keep with ``dims``: the
        leading ones it has (a value without a block's dim, e.g. k beside q's query groups,
        takes the block alone)."""
        for d in dims:
            if (value, d) in node.mixes:
                raise Refused(node.mixes[(value, d)])
        mapped: dict[int, dict[int, int]] = {}
        for d in dims:
            group = next((g for g in node.same if (value, d) in g), ())
            for other, od in group:
                mapped.setdefault(other, {})[d] = od
        for other, found in mapped.items():
            prefix = []
            for d in dims:
                if d not in found:
                    break
                prefix.append(found[d])
            if len(prefix) < len(found):
                raise Refused(f"{node.prim} splits a value of {_shape(self.graph, other)} without its block")
            self.split(other, tuple(prefix), node.prim)

    def reshape(self, node: Node, value: int, dims: Split) -> None:
        """A reshape under an axis of ``size``: a dim maps to its group's major dim where the
        axis divides that, else (the axis a multiple of it) to a block of it and a share of
        the next dim; a block and share of one group merged back are that group's dim."""
        a, b = node.ins[0], node.outs[0]
        assert a is not None
        other = b if value == a else a
        mine, theirs = (0, 1) if value == a else (1, 0)
        shapes = self.graph.shapes
        size = self.size
        assert size is not None
        for group in node.params["groups"]:
            here, there = group[mine], group[theirs]
            held = [d for d in dims if d in here]
            if not held:
                continue
            what = f"reshape {_shape(self.graph, a)} -> {_shape(self.graph, b)}"
            if held != here[: len(held)]:
                raise Refused(f"{what} merges a split dim below another")
            n = shapes[other][there[0]]
            if len(held) == 2 and len(there) == 1:
                self.split(other, (there[0],), what)  # a block and its share, merged back
            elif len(held) == 2:
                raise Refused(f"{what} regroups a block and its share")
            elif len(here) == 1 and len(there) == 1:
                self.split(other, (there[0],), what)
            elif shapes[value][held[0]] % size:
                raise Refused(f"{what} regroups dim {held[0]}, of which each device holds a shared block")
            elif n % size == 0:
                self.split(other, (there[0],), what)
            elif size % n == 0 and len(there) > 1 and shapes[other][there[1]] % (size // n) == 0:
                self.split(other, (there[0], there[1]), what)  # a block of n, a share of the next
            else:
                raise Refused(f"{what} cuts dim {held[0]} into parts {size} does not divide")
        if len([d for d in dims if any(d in g[mine] for g in node.params["groups"])]) != len(dims):
            raise Refused(f"reshape {_shape(self.graph, a)} -> {_shape(self.graph, b)} drops a split dim")

    def matmul(self, index: int, node: Node, value: int, dims: Split) -> None:
        """A matmul: a column layer (the result split on a kernel dim), a row layer (the operands
        split on a contracted pair), or, between two activations, their shared dims alone."""
        kernel = kernel_operand(node, self.kernels)
        if kernel is None:
            self.along(node, value, dims)
            return
        x = node.ins[0] if kernel == node.ins[1] else node.ins[1]
        pairs = contracted_pairs(node)
        if (value, dims[0]) in pairs:  # a row layer: the partial products summed over the axis
            other, d = pairs[(value, dims[0])]
            size = self.size
            if len(dims) != 1 or (size and self.graph.shapes[value][dims[0]] % size):
                raise Refused(f"{node.prim} would sum blocks shared between devices more than once")
            self.split(other, (d,), f"{node.prim} (a row layer)")
            self.region.rows.add(index)
            self.keep_whole(node.outs[0], "a row layer's sum")
            return
        group = next((g for g in node.same if (value, dims[0]) in g), None)
        if group is None:
            raise Refused(node.mixes.get((value, dims[0]), f"{node.prim} mixes dim {dims[0]}"))
        if len(dims) == 1 and any(v == kernel for v, _ in group) and not any(v == x for v, _ in group):
            self.region.columns.add(index)  # a column layer: its input whole, its result split
            self.keep_whole(x, "a column layer's input")
            for other, d in group:
                self.split(other, (d,), f"{node.prim} (a column layer)")
            return
        raise Refused(
            f"{node.prim} multiplies activations split on dim {dims[0]} by a whole kernel (its "
            f"gradient would be a partial sum no role reduces)"
        )


def _shape(graph: Graph, value: int) -> str:
    return shape_text(graph.shapes[value])

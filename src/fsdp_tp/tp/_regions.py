"""Megatron's regions in a traced computation (:class:`~fsdp_tp.tp._graph.Graph`): from one
split of a parameter read by a matmul, every value that must then be split with it, until
each path ends in a matmul that sums the split away (a row layer) or the split meets
something that cannot take it (the reason the plan gives).

A region grows by the graph's relations (:class:`~fsdp_tp.tp._graph.Node`'s ``same``):
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
"""

from __future__ import annotations

import dataclasses

from ._graph import Graph, Node

__all__ = ["Region", "grow", "kernels_of"]

# Operations that only move a parameter's values about: a kernel read through them is still
# the parameter (a cast to the compute dtype, a reshape to heads, a scan's slice of a stack).
_LAYOUT = frozenset(
    "convert_element_type reshape transpose squeeze slice scan_slice copy copy_p sharding_constraint".split()
)


class Refused(Exception):
    """A region that cannot be: ``str`` is why, in the model's terms."""


@dataclasses.dataclass
class Region:
    """The values split (``{value: dim}``), the matmuls of column and row layers, the tables
    looked up on their split rows, and whether a split reaches the model's output."""

    split: dict[int, int] = dataclasses.field(default_factory=dict)
    columns: set[int] = dataclasses.field(default_factory=set)
    rows: set[int] = dataclasses.field(default_factory=set)
    lookups: set[int] = dataclasses.field(default_factory=set)
    output: bool = False

    def params(self, graph: Graph) -> dict[str, int]:
        """``{parameter path: its split dim, counted from the end}``."""
        return {graph.params[v]: d - len(graph.shapes[v]) for v, d in self.split.items() if v in graph.params}


def kernels_of(graph: Graph) -> dict[int, int]:
    """``{value: the parameter it is}`` for every value that is a parameter moved about (or,
    in a traced init, a scan step's slice of a parameter it stacks)."""
    kernels = {v: v for v in graph.params}
    for node in reversed(graph.nodes):
        if node.prim == "scan_stack" and node.outs[0] in kernels and node.ins[0] is not None:
            kernels[node.ins[0]] = kernels[node.outs[0]]
    for node in graph.nodes:
        if node.prim in _LAYOUT and node.ins[0] in kernels:
            kernels[node.outs[0]] = kernels[node.ins[0]]
    return kernels


def grow(graph: Graph, kernels: dict[int, int], seed: tuple[int, int], outputs_split: bool) -> Region:
    """The region of ``seed`` (``(value, dim)`` split), or :class:`Refused` with the reason.
    ``outputs_split``: the model's outputs may leave split (else a split reaching one is
    gathered there, which one column layer alone may do)."""
    region = Region()
    whole = {v: "the model's input" for v in graph.inputs} | {v: "a constant" for v in graph.constants}
    queue: list[int] = []

    def split(value: int | None, dim: int, why: str) -> None:
        if value is None:
            return
        if value in whole:
            raise Refused(f"{why} would split {whole[value]}")
        if value in region.split:
            if region.split[value] != dim:
                raise Refused(f"{why} would split a value on two dims ({region.split[value]} and {dim})")
            return
        region.split[value] = dim
        queue.append(value)

    def keep_whole(value: int | None, what: str) -> None:
        if value is not None and value in region.split:
            raise Refused(f"{what} would be split")
        if value is not None:
            whole.setdefault(value, what)

    split(seed[0], seed[1], "the seed")
    done: set[tuple[int, int]] = set()
    while queue:
        value = queue.pop()
        dim = region.split[value]
        made = graph.producer.get(value)
        if made is not None and value in kernels and not set(graph.nodes[made].ins) & set(kernels):
            made = None  # a parameter's split is its own, not that of what an init made it from
        for index in {made, *graph.users.get(value, ())} - {None}:
            if (index, value) not in done:
                done.add((index, value))
                _visit(graph, kernels, index, value, dim, region, split, keep_whole)
    if reached := [v for v in graph.outputs if v in region.split]:
        region.output = True
        if not outputs_split and (region.rows or len(region.columns) != 1):
            raise Refused(f"the model's output {_shape(graph, reached[0])} would leave split")
    return region


def _visit(
    graph: Graph, kernels: dict, index: int, value: int, dim: int, region: Region, split, keep_whole
) -> None:
    node = graph.nodes[index]
    if node.prim in ("dot_general", "conv_general_dilated"):
        _matmul(graph, kernels, index, node, value, dim, region, split, keep_whole)
        return
    if (
        node.prim == "gather"
        and value == node.ins[0]
        and dim in node.params["looked_up"]
        and value in kernels
    ):
        region.lookups.add(index)  # a vocabulary role: rows looked up on each slice, summed
        keep_whole(node.outs[0], "an embedding's looked-up rows (summed over the axis)")
        return
    _along(node, value, dim, split)


def _along(node: Node, value: int, dim: int, split) -> None:
    if (value, dim) in node.mixes:
        raise Refused(node.mixes[(value, dim)])
    for group in node.same:
        if (value, dim) in group:
            for other, d in group:
                split(other, d, node.prim)


def _matmul(
    graph: Graph, kernels: dict, index: int, node: Node, value: int, dim: int, region, split, keep_whole
) -> None:
    """A matmul: a column layer (the result split on a kernel dim), a row layer (the operands
    split on a contracted pair), or, between two activations, their shared dims alone."""
    a, b = node.ins[0], node.ins[1]
    kernel = b if b in kernels else a if a in kernels else None
    if kernel is None or (a in kernels and b in kernels):
        _along(node, value, dim, split)
        return
    x = a if kernel == b else b
    pairs = _contracted(node)
    if (value, dim) in pairs:  # a row layer: the partial products summed over the axis
        other, d = pairs[(value, dim)]
        split(other, d, f"{node.prim} (a row layer)")
        region.rows.add(index)
        keep_whole(node.outs[0], "a row layer's sum")
        return
    group = next((g for g in node.same if (value, dim) in g), None)
    if group is None:
        raise Refused(node.mixes.get((value, dim), f"{node.prim} mixes dim {dim}"))
    if any(v == kernel for v, _ in group) and not any(v == x for v, _ in group):
        region.columns.add(index)  # a column layer: its input whole, its result split
        keep_whole(x, "a column layer's input")
        for other, d in group:
            split(other, d, f"{node.prim} (a column layer)")
        return
    raise Refused(
        f"{node.prim} multiplies activations split on dim {dim} by a whole kernel (its gradient "
        f"would be a partial sum no role reduces)"
    )


def _contracted(node: Node) -> dict[tuple[int, int], tuple[int, int]]:
    """The pairs of dims a matmul contracts, each way."""
    if node.prim == "conv_general_dilated":
        x, k = node.params["contracted"]
        return {x: k, k: x}
    (lc, rc), _ = node.params["dimension_numbers"]
    a, b = node.ins[0], node.ins[1]
    assert a is not None and b is not None  # (a kernel's matmul: no literal operand)
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for i, j in zip(lc, rc, strict=True):
        pairs[(a, i)], pairs[(b, j)] = (b, j), (a, i)
    return pairs


def _shape(graph: Graph, value: int) -> str:
    return f"[{','.join(map(str, graph.shapes[value]))}]"

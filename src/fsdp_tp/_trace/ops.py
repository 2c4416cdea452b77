"""What an operation does to a device's block of a value and to a partial sum, as the plan
check (:mod:`fsdp_tp._check.blocks`) reads them: which operations sum over a dim (their result a
partial sum), which are linear in a partial sum (it may pass them, to be summed after), which
collectives of the library complete a sum, and when a device's part of the dims a reshape groups
is still a block of them.

>>> is_block([2, 16], [8, 16]), is_block([8, 4], [8, 16])   # 2 of 8 heads whole; all heads, 4 of 16
(True, False)
"""

from __future__ import annotations

from .graph import Graph
from .relations import Node

__all__ = [
    "COLLECTIVES",
    "FLAX_ATTENTION",
    "LINEAR",
    "RANDOM",
    "SUMS",
    "is_block",
    "linear",
    "paired_shapes",
    "sums_over",
]

# Operations of the library that sum each device's share over the axis: a partial sum is whole after.
SUMS = frozenset({"psum", "psum_invariant", "psum2", "reduce_scatter"})
# Collectives: what leaves them is no longer the block that entered (gathered, permuted, summed).
COLLECTIVES = SUMS | frozenset({"all_gather", "all_to_all", "ppermute", "pmax", "pmin"})
# Operations linear in each operand: a partial sum may pass them and be summed after.
LINEAR = frozenset(
    """convert_element_type copy copy_p reduce_precision reshape transpose squeeze expand_dims
    broadcast_in_dim neg reduce_sum stop_gradient optimization_barrier sharding_constraint slice
    dynamic_slice pvary pcast""".split()
)
# Random draws of flax's own attention dropout: each device draws on its block with a key folded
# per block (docs/design.md invariant 9: the same distribution, not the unsharded mask).
RANDOM = frozenset({"random_bits", "threefry2x32"})
FLAX_ATTENTION = ("flax/linen/attention.py", "flax/nnx/nn/attention.py")


def paired_shapes(node: Node, ref: Node, local: Graph, reference: Graph) -> dict[int, tuple] | None:
    """``{local value: (its shape, its pair's shape)}`` (literals left out), or ``None`` where
    the two operations' operands and results do not line up (count, ranks)."""
    if len(node.ins) != len(ref.ins) or len(node.outs) != len(ref.outs):
        return None
    out = {}
    for v, r in zip([*node.ins, *node.outs], [*ref.ins, *ref.outs], strict=True):
        if v is None or r is None:  # a literal (JAX's replication check makes some values)
            continue
        if len(local.shapes[v]) != len(reference.shapes[r]):
            return None
        out[v] = (local.shapes[v], reference.shapes[r])
    return out


def sums_over(node: Node, value: int, dim: int) -> bool:
    """Whether ``node`` sums over ``(value, dim)``: a ``reduce_sum``, a contraction, or rows
    of a table looked up on its block (a vocabulary role remaps the ids and sums after)."""
    if node.prim == "reduce_sum":
        return value == node.ins[0]
    if node.prim == "dot_general":
        (lc, rc), _ = node.params["dimension_numbers"]
        return (value == node.ins[0] and dim in lc) or (value == node.ins[1] and dim in rc)
    if node.prim == "conv_general_dilated":
        return (value, dim) in node.params["contracted"]
    return node.prim == "gather" and value == node.ins[0] and dim in node.params["looked_up"]


def linear(node: Node, sums: list[int]) -> bool:
    """Whether ``node`` is linear in the partial sums among its operands (``sums``), so they
    may be summed over the axis after it: scaled, moved, cast, contracted with a whole value."""
    if node.prim in LINEAR:
        return True
    if node.prim in ("add", "sub", "add_any", "concatenate", "stack"):
        return len(sums) == len(node.ins)  # (a whole term, a literal, would be added n times)
    if node.prim in ("mul", "dot_general"):
        return len(sums) == 1
    return node.prim == "div" and sums == [node.ins[0]]


def is_block(held: list[int], whole: list[int]) -> bool:
    """Whether a device's part of the dims a reshape groups is a block of them: dims it holds
    one position of, then a block of one dim, then whole dims.

    >>> is_block([2, 8], [8, 8]), is_block([1, 2, 8], [2, 4, 8]), is_block([8, 2], [8, 8])
    (True, True, False)
    """
    j = 0
    while j < len(held) and held[j] == 1 and whole[j] != 1:
        j += 1
    return all(held[i] == whole[i] for i in range(j + 1, len(held)))

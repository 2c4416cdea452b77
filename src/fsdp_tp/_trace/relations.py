"""What each JAX primitive does to the dims of its operands and results, as the plan finder
reads it (:class:`Node`): which dims are one dim's positions across them (``same``: split
one, split them all) and which it computes across (``mixes``, with what it does there). A
primitive it does not know mixes every dim, so the finder refuses it rather than guess.

>>> node = Node("reduce_sum", [0], [1], {"axes": (1,)})
>>> relate(node, {0: (2, 8), 1: (2,)})
>>> node.same, node.mixes
([[(0, 0), (1, 0)]], {(0, 1): 'reduce_sum over dim 1 of [2,8]'})
>>> node = Node("unstack", [0], [1, 2], {"axis": 0})   # jax 0.12's `k, v = kv`
>>> relate(node, {0: (2, 4, 8), 1: (4, 8), 2: (4, 8)})
>>> node.same[0], node.mixes
([(0, 1), (1, 0), (2, 0)], {(0, 0): 'unstack cuts dim 0 of [2,4,8]'})
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DRAWN", "ELEMENTWISE", "Node", "relate", "shape_text"]

# The reason a split meets the model's own random draws (read back by the left-whole warning).
DRAWN = "random numbers the model draws"

# Operations that compute each position from the same positions of their operands.
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 cbrt ceil clamp conj convert_element_type copy
    copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh
    xor optimization_barrier sharding_constraint shift_left shift_right_logical shift_right_arithmetic
    one_minus_square
    population_count clz bitcast_convert_type""".split()
    # (and what moves no position: check_vma's type markers, a sum or max over devices)
    + "pvary pcast psum psum_invariant psum2 pmax pmin".split()
)
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
_ALONG_AXIS = dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"), "axis")


@dataclasses.dataclass
class Node:
    """One operation: ``ins`` / ``outs`` are value ids (``None``: a literal), ``same`` the
    groups of ``(value, dim)`` that are one dim's positions (split one, split them all),
    ``mixes`` the ``(value, dim)`` it computes across, with what it does there; ``source``:
    where the model's code made it (:func:`~fsdp_tp._trace.sites.site_of` reads it)."""

    prim: str
    ins: list[int | None]
    outs: list[int]
    params: dict[str, Any]
    same: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    mixes: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    known: bool = True  # False: a primitive this module does not know (it mixes every dim)
    source: Any = None  # the equation's source_info (its traceback and name stack), if any
    callers: tuple = ()  # the source_infos of the calls it was traced in (a jnp function JAX jits)


def relate(node: Node, shapes: dict[int, tuple[int, ...]]) -> None:
    """Fills ``node.same`` and ``node.mixes`` from its primitive (an unknown one mixes every dim)."""
    ins = [(v, shapes[v]) for v in node.ins if v is not None]
    outs = [(v, shapes[v]) for v in node.outs]
    p, name = node.params, node.prim

    what = lambda v, d, does: f"{does} dim {d} of {shape_text(shapes[v])}"

    def mix_all(does: str) -> None:
        for v, shape in ins + outs:
            for d in range(len(shape)):
                node.mixes[(v, d)] = what(v, d, does)

    if name not in ELEMENTWISE and node.ins and node.ins[0] is None:
        return  # (a literal's broadcast or reshape: one value, the same at every position)
    if name in ELEMENTWISE:
        out, shape = outs[0]
        for d in range(len(shape)):
            node.same.append([(v, d) for v, s in ins + outs if len(s) == len(shape) and s[d] == shape[d]])
    elif name in _REDUCTIONS:
        (x, shape), (out, _) = ins[0], outs[0]
        axes = tuple(p["axes"])
        kept = [d for d in range(len(shape)) if d not in axes]
        node.same += [[(x, d), (out, i)] for i, d in enumerate(kept)]
        node.mixes |= {(x, d): f"{name} over dim {d} of {shape_text(shape)}" for d in axes}
    elif name in _ALONG_AXIS or name in ("sort", "rev", "top_k"):
        (x, shape), axes = ins[0], _along(name, p, len(ins[0][1]))
        for d in range(len(shape)):
            group = [(v, d) for v, s in ins + outs if len(s) == len(shape)]
            if d in axes:
                for v, dd in group:
                    node.mixes[(v, dd)] = what(v, dd, f"{name} along")
            else:
                node.same.append(group)
    elif name == "broadcast_in_dim":
        (x, shape), (out, oshape) = ins[0], outs[0]
        for i, d in enumerate(p["broadcast_dimensions"]):
            if shape[i] == oshape[d]:
                node.same.append([(x, i), (out, d)])
    elif name == "transpose":
        (x, _), (out, _) = ins[0], outs[0]
        node.same += [[(x, d), (out, i)] for i, d in enumerate(p["permutation"])]
    elif name == "unstack":  # (jax 0.12's `k, v = kv`; 0.10 slices and squeezes)
        (x, shape), axis = ins[0], p["axis"] % len(ins[0][1])
        for d in range(len(shape)):
            if d == axis:
                node.mixes[(x, d)] = what(x, d, "unstack cuts")
            else:
                node.same.append([(x, d)] + [(o, d if d < axis else d - 1) for o, _ in outs])
    elif name == "squeeze":
        (x, shape), (out, _) = ins[0], outs[0]
        kept = [d for d in range(len(shape)) if d not in p["dimensions"]]
        node.same += [[(x, d), (out, i)] for i, d in enumerate(kept)]
    elif name == "reshape":
        _reshape(node, ins[0], outs[0])
    elif name in ("slice", "pad", "dynamic_slice", "concatenate", "split", "dynamic_update_slice"):
        _window(node, ins, outs)
    elif name == "dot_general":
        _dot(node, ins, outs)
    elif name == "conv_general_dilated":
        _conv(node, ins, outs)
    elif name == "gather":
        _gather(node, ins, outs)
    elif name in ("scan_slice", "scan_stack"):
        (x, shape), (out, oshape) = ins[0], outs[0]
        shift = 1 if name == "scan_slice" else -1
        for d in range(len(oshape)):
            if 0 <= d + shift < len(shape):
                node.same.append([(x, d + shift), (out, d)])
        node.mixes[(x, 0) if name == "scan_slice" else (out, 0)] = "the scanned dim"
    elif name == "iota":
        mix_all("a constant (an iota) along")
    elif name in ("random_bits", "random_wrap", "random_unwrap", "random_seed", "threefry2x32"):
        mix_all(f"{DRAWN} along")
    elif name == "carry":
        mix_all("a loop's carry, which crosses steps, holds")
    else:
        node.known = False
        mix_all(f"{name} (an operation the plan finder does not know) computes across")


def shape_text(shape) -> str:
    """A shape as the refusals write it: ``[2,8]``."""
    return f"[{','.join(map(str, shape))}]"


def _along(name: str, p: dict, rank: int) -> tuple[int, ...]:
    if name in _ALONG_AXIS:
        return (p[_ALONG_AXIS[name]] % rank,)
    if name == "sort":
        return (p["dimension"] % rank,)
    if name == "top_k":
        return (rank - 1,)
    return tuple(p["dimensions"])


def _reshape(node: Node, x: tuple, out: tuple) -> None:
    """Dims grouped where their products meet (``params["groups"]``: each group's non-1 dims
    on both sides); in a group, the major dims of both sides are one dim's positions (split N
    of (N, H) is split N*H alike), the rest mixed. :mod:`~fsdp_tp.tp._find.regions` refines this
    where the axis size does not divide the major dim."""
    (a, ashape), (b, bshape) = x, out
    node.params["groups"] = groups = []
    i = j = 0
    while i < len(ashape) or j < len(bshape):
        gi, gj = [i], [j]
        pa = ashape[i] if i < len(ashape) else 1
        pb = bshape[j] if j < len(bshape) else 1
        while pa != pb:
            if pa < pb:
                i += 1
                gi.append(i)
                pa *= ashape[i]
            else:
                j += 1
                gj.append(j)
                pb *= bshape[j]
        gi = [d for d in gi if d < len(ashape) and ashape[d] != 1]
        gj = [d for d in gj if d < len(bshape) and bshape[d] != 1]
        if gi and gj:
            groups.append((gi, gj))
            node.same.append([(a, gi[0]), (b, gj[0])])
            merges = f"reshape {shape_text(ashape)} -> {shape_text(bshape)} merges"
            node.mixes |= {(a, d): merges for d in gi[1:]} | {(b, d): merges for d in gj[1:]}
        i, j = i + 1, j + 1


def _window(node: Node, ins: list, outs: list) -> None:
    """Slices, pads and concatenations keep every dim whose extent they leave alone."""
    shapes = [s for _, s in ins + outs]
    rank = max(len(s) for s in shapes)
    for d in range(rank):
        group = [(v, d) for v, s in ins + outs if len(s) == rank]
        if all(s[d] == shapes[0][d] for _, s in ins + outs if len(s) == rank):
            node.same.append(group)
        else:
            node.mixes |= {m: f"{node.prim} cuts dim {d} of {shape_text(shapes[0])}" for m in group}


def _dot(node: Node, ins: list, outs: list) -> None:
    """``same``: the batch dims of both operands and the result, and each operand's free dims
    with the result's. The contracted dims are mixed: a split there leaves partial sums,
    which only a row role (the operand a parameter) reduces: :mod:`fsdp_tp.tp.auto` decides."""
    ((lhs, ls), (rhs, rs)), (out, _) = ins, outs[0]
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    node.same += [[(lhs, a), (rhs, b), (out, i)] for i, (a, b) in enumerate(zip(lb, rb, strict=True))]
    at = len(lb)
    for v, shape, contracted, batch in ((lhs, ls, lc, lb), (rhs, rs, rc, rb)):
        for d in range(len(shape)):
            if d in contracted:
                node.mixes[(v, d)] = f"dot_general contracts dim {d} of {shape_text(shape)}"
            elif d not in batch:
                node.same.append([(v, d), (out, at)])
                at += 1


def _conv(node: Node, ins: list, outs: list) -> None:
    """A convolution as a matmul over its feature dims: the input's features contracted with
    the kernel's input features, the kernel's output features the result's, each example the
    result's; the spatial dims mixed (windows)."""
    ((x, xs), (k, ks)), (out, os) = ins, outs[0]
    lhs, rhs, res = node.params["dimension_numbers"]
    node.mixes |= {
        (v, d): f"conv_general_dilated mixes dim {d}"
        for v, s in ((x, xs), (k, ks), (out, os))
        for d in range(len(s))
    }
    if node.params.get("feature_group_count", 1) == 1 and node.params.get("batch_group_count", 1) == 1:
        del node.mixes[(k, rhs[0])], node.mixes[(out, res[1])]
        node.same.append([(k, rhs[0]), (out, res[1])])
        # Each example convolved alone (a batch split keeps it); a kernel's gradient is another
        # convolution, whose examples are its contracted features.
        del node.mixes[(x, lhs[0])], node.mixes[(out, res[0])]
        node.same.append([(x, lhs[0]), (out, res[0])])
        node.mixes[(x, lhs[1])] = f"conv_general_dilated contracts dim {lhs[1]} of {shape_text(xs)}"
        node.mixes[(k, rhs[1])] = f"conv_general_dilated contracts dim {rhs[1]} of {shape_text(ks)}"
    node.params["contracted"] = ((x, lhs[1]), (k, rhs[1]))


def _gather(node: Node, ins: list, outs: list) -> None:
    """A lookup of rows by ids (``jnp.take`` of an embedding): the table's sliced-whole dims
    are the result's offset dims; the looked-up dim is mixed (a vocabulary role looks it up
    on its slice and sums)."""
    (table, ts), (out, _) = ins[0], outs[0]
    dn = node.params["dimension_numbers"]
    whole = [d for d in range(len(ts)) if d not in dn.collapsed_slice_dims]
    for v, shape in ins + outs:
        for d in range(len(shape)):
            node.mixes[(v, d)] = f"gather indexes dim {d} of {shape_text(shape)}"
    node.params["looked_up"] = tuple(dn.collapsed_slice_dims)
    for d, o in zip(whole, dn.offset_dims, strict=False):
        if node.params["slice_sizes"][d] == ts[d]:
            del node.mixes[(table, d)], node.mixes[(out, o)]
            node.same.append([(table, d), (out, o)])
    # Each id looks its row up alone: the ids' dims (but the last, the index vector) are the
    # result's batch dims, one for one (a sequence split keeps a lookup token by token).
    # A dim of the table batched with one of the ids (``jnp.take_along_axis``: each row, each
    # token its own lookup) is that batch dim too.
    if len(ins) > 1 and (ids := ins[1])[0] is not None:
        batch = [o for o in range(len(outs[0][1])) if o not in dn.offset_dims]
        batched = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
        if len(batch) == len(ids[1]) - 1:
            for d, o in zip(range(len(ids[1]) - 1), batch, strict=True):
                node.mixes.pop((ids[0], d), None), node.mixes.pop((out, o), None)
                group = [(ids[0], d), (out, o)]
                if d in batched:
                    node.mixes.pop((table, batched[d]), None)
                    group.append((table, batched[d]))
                node.same.append(group)

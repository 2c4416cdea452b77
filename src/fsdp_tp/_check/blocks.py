"""One device's trace read against the unsharded model's, operation by operation
(:class:`Blocks`): whether each keeps every device's part a block of the unsharded computation.

For each operation the model's code made in both traces (:func:`~fsdp_tp._trace.sites.pair`), a
dim's two sizes say what a device holds of it: all of it, or a block (16 of 64: a fourth).
Then an operation that computes across a dim (a ``mixes`` of
:class:`~fsdp_tp._trace.graph.Node`: a max, a slice, a flip, a concatenation, an index) must not
cross a block, except a sum (a ``reduce_sum``, a contraction, a table looked up on its rows),
whose result is a *partial sum* that only linear operations may touch until a role sums it
over the axis; a reshape keeps each device's part a block (:func:`_block`); every dim a
device holds is a block of the unsharded dim. The library's own operations (the roles'
collectives, FSDP's gathers) carry what they receive; a role's ``psum`` completes a sum.

Long because the walk and its refusals are one class: a refusal reads the walk's state (the
partial sums, each split's origin, the pairs of operations), so 0.2's split into a base class that
declared this one's attributes is merged back (issue 83).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

from .._trace.graph import Graph
from .._trace.ops import COLLECTIVES, FLAX_ATTENTION, RANDOM, SUMS, is_block, linear, paired_shapes, sums_over
from .._trace.relations import Node, shape_text
from .._trace.sites import is_library, pair, scope_of, site_of, source_of, user_site
from ..errors import RuleError
from .partners import partners
from .refusals import (
    PARTIAL_SUM_READ,
    RULE_DROPPED,
    SEQUENCE_SPLIT,
    SEQUENCE_WHOLE,
    Named,
    PartialSum,
    axes_text,
    blaming,
    mixing_fix,
    names_text,
    reshape_fix,
    step_mixing_fix,
    step_partial_fix,
    values_text,
)

__all__ = ["Blocks"]


def _axes_of(node: Node) -> tuple:
    """The mesh axes a collective runs over (``psum``'s ``axes``, the others' ``axis_name``)."""
    axes = node.params.get("axes", node.params.get("axis_name", ()))
    return axes if isinstance(axes, tuple) else (axes,)


def _backward(node: Node) -> bool:
    """Whether ``node`` is of a backward pass (JAX's transpose of the forward's, its name stack
    marked so, or a call's it is inlined from): a step's backward computes what its forward
    reads, by the transposes of the same operations, checked as the forward's."""
    stacks = [str(getattr(source, "name_stack", "")) for source in (node.source, *node.callers)]
    return any("transpose(" in stack for stack in stacks)


class Blocks:
    """The walk over ``local`` (one device's trace) against ``reference`` (the unsharded
    model's), for roles over ``sizes``' axes; :meth:`run` refuses with a ``RuleError`` (its
    words start with ``where``; ``named`` says a name stack's module and role, ``whole`` how
    the user leaves a module whole; a library operation of a primitive in ``split_by`` starts a
    split's origin, as the Linen Megatron layers' own matmuls do) and collects in
    ``undecided`` the operations it does not know that a split reaches. ``sequence``: the axis
    a step splits the sequence over (dim 1 of the inputs), whose refusals name that fix."""

    def __init__(
        self,
        local: Graph,
        reference: Graph,
        sizes: Mapping[str, int],
        where: str,
        named: Named,
        whole: str = RULE_DROPPED,
        split_by: Collection[str] = (),
        sequence: str | None = None,
        step: bool = False,
    ):
        self.sequence = sequence  # (the axis a step splits the sequence over, if it does)
        self.step = step  # (the whole step read against it on the whole batch: _check.step)
        self.local, self.reference, self.where, self.named, self.whole = local, reference, where, named, whole
        self.split_by = split_by
        self.sizes = dict(sizes)
        self.total = math.prod(self.sizes.values())
        self.pairs = pair(local, reference)
        self.partial: dict[int, PartialSum] = {}
        self.origin: dict[int, str] = {}  # a split value -> the name stack of the op that split it
        self.known: dict[int, tuple[int, ...]] = {}  # a value -> what a device holds of each dim
        self.modelled: set[int] = set()  # values the model's own code made
        self.library: set[int] = set()  # values the library made (collectives, masks, gathers)
        self.undecided: dict[str, None] = {}
        # Dims of a value that hold other devices' rows (an experts' buffer sent to the devices
        # of its experts by an all_to_all): any size, computed row by row, never across.
        self.rows: dict[int, frozenset[int]] = {}
        # Values the model's code made from whole ones by an operation the unsharded model does
        # not run (``pos[:x.shape[1]]``, a whole slice there): the same on every device.
        self.alike: dict[int, Node] = {}

    def run(self, split_outputs: tuple[int, ...]) -> None:
        """Every operation, then the outputs (which may leave split on ``split_outputs``)."""
        if not self.pairs and any(site_of(source_of(n)) and not is_library(n) for n in self.local.nodes):
            self.undecided["every operation (none of the device's pairs with the unsharded model's)"] = None
        for index, node in enumerate(self.local.nodes):
            if not node.outs:  # (a callback, a print: it computes nothing the model reads)
                continue
            if self.step and _backward(node):  # (the forward's mirror: checked as it)
                continue
            if node.prim != "all_to_all":
                self.rowwise(node, self.reference.nodes[self.pairs[index]] if index in self.pairs else None)
            if index in self.pairs:
                self.modelled.update(node.outs)
                self.paired(node, self.reference.nodes[self.pairs[index]])
            elif source_of(node) is None or is_library(node):
                self.library.update(node.outs)
                self.carried(node)
            elif site_of(source_of(node)) is None:
                self.unplaced(node)
            elif self.touched(node):
                self.modelled.update(node.outs)
                where = user_site(source_of(node))
                self.undecided[f"{node.prim} at {where} (not in the unsharded trace)"] = None
            elif node.prim in ("slice", "dynamic_slice") and self.cut_whole(node):
                self.alike |= dict.fromkeys(node.outs, node)
        self.outputs(split_outputs)

    def unplaced(self, node: Node) -> None:
        """An operation of a helper JAX traced before and replays (``jnp.where``, ``jnp.take``):
        its traceback holds no line. Its operands say whose it is: the library's where it reads
        a value the library made (a vocabulary lookup's mask), carried as the library's are;
        the model's where it reads the model's, checked by what is known of their splits."""
        if any(v in self.library for v in node.ins) or not any(v in self.modelled for v in node.ins):
            self.library.update(node.outs)
            self.carried(node)
            return
        self.modelled.update(node.outs)
        self.rule(node, None, {v: self.known[v] for v in node.ins if v in self.known})

    def cut_whole(self, node: Node) -> bool:
        """Whether ``node`` cuts values every device holds whole (not literals, the model's
        inputs, what the library made or a known block)."""
        ins = [v for v in node.ins if v is not None]
        split = lambda v: (
            v in self.library or v in self.local.inputs or max(self.known.get(v, (1,)), default=1) > 1
        )
        return bool(ins) and not any(split(v) for v in ins)

    def touched(self, node: Node) -> bool:
        return any(v in self.partial or v in self.origin for v in node.ins)

    def carried(self, node: Node) -> None:
        """A library operation (or a loop's carry): a partial sum stays partial unless a
        collective sums it, and a split keeps its origin through anything but a collective."""
        if node.prim == "all_to_all":
            self.sent(node)
        if node.prim in ("pvary", "pcast") and node.ins[0] in self.alike:  # (a retype: the same numbers)
            self.alike[node.outs[0]] = self.alike[node.ins[0]]
        across = node.prim in COLLECTIVES and not (self.step and not self.over_split(node))
        if node.prim in SUMS and across:
            self.summed_blocks(node)
        if across:
            return
        sums = [self.partial[v] for v in node.ins if v in self.partial]
        origin = next((self.origin[v] for v in node.ins if v in self.origin), None)
        if origin is None and node.prim in self.split_by:  # (a library layer's own matmul)
            origin = scope_of(node)
        for out in node.outs:
            if sums:
                self.partial[out] = sums[0]
            if origin is not None:
                self.origin[out] = origin

    def over_split(self, node: Node) -> bool:
        """Whether collective ``node`` runs over an axis of the split read (a step's batch axes;
        a tensor role's ``psum`` in a step is the model's, over its own)."""
        return any(a in self.sizes for a in _axes_of(node))

    def summed_blocks(self, node: Node) -> None:
        """A role's sum over the axis of what each device holds a block of, no partial sum
        (nothing contracted the split dim: a module of raw kernels ending on a column, given a
        Region that sums): the blocks would be added, not joined, into another model's output."""
        for v in node.ins:
            if (
                v is not None
                and v not in self.partial
                and v in self.origin
                and max(self.known.get(v, (1,)), default=1) > 1
            ):
                held = shape_text(self.local.shapes[v])
                why = (
                    f"{node.prim} sums over {axes_text(self.sizes)} the blocks each device holds of {held} "
                    f"(no partial sums: nothing contracted the split dim), adding what should be joined"
                )
                fix = "gather what the module returns (Region(..., gather_output=True)), or contract it first"
                self.refuse(node, None, self.origin[v], why, fix)

    def sent(self, node: Node) -> None:
        """An all_to_all sends a buffer's rows to the experts' devices (its output holds theirs
        on ``concat_axis``), or sends them back (the dim it splits held them)."""
        x, split, concat = node.ins[0], node.params["split_axis"], node.params["concat_axis"]
        held = self.rows.get(x, frozenset()) if x is not None else frozenset()
        self.rows[node.outs[0]] = held - {split} if split in held else held | {concat}

    def rowwise(self, node: Node, ref: Node | None) -> None:
        """Other devices' rows pass row by row to the dims ``node`` keeps; computing across them
        is refused."""
        for v in node.ins:
            if v is None:  # (a literal)
                continue
            for d in self.rows.get(v, ()):
                if (v, d) in node.mixes:
                    why = f"{node.mixes[(v, d)]}, which holds rows other devices sent to their experts"
                    self.refuse(
                        node, ref, self.origin.get(v, scope_of(node)), why, "compute the experts row by row"
                    )
        for group in node.same:
            if any(v in node.ins and d in self.rows.get(v, ()) for v, d in group):
                for v, d in group:
                    if v in node.outs:
                        self.rows[v] = self.rows.get(v, frozenset()) | {d}

    def paired(self, node: Node, ref: Node) -> None:
        shapes = paired_shapes(node, ref, self.local, self.reference)
        if shapes is None:  # (the same line made something else: traced under other conditions)
            if self.touched(node):
                self.undecided[f"{node.prim} at {user_site(source_of(node))} (another op unsharded)"] = None
            return
        factors = {v: self.factors(node, ref, v, *held_whole) for v, held_whole in shapes.items()}
        for v in node.ins:
            if v in self.alike and any(n > 1 for n in factors.get(v, ())):
                self.refuse_alike(self.alike[v], v, factors[v], scope_of(node))
        self.known |= factors
        self.rule(node, ref, factors)

    def factors(self, node: Node, ref: Node, value: int, held: tuple, whole: tuple) -> tuple[int, ...]:
        """What a device holds of each dim of ``value``: 1 (all of it, or other devices' rows)
        or n (a block, an n-th)."""
        rows = self.rows.get(value, frozenset())
        # (an empty dim holds nothing to split: read as whole)
        held = tuple(
            b if d in rows or a == 0 else a for d, (a, b) in enumerate(zip(held, whole, strict=True))
        )
        for d, (a, b) in enumerate(zip(held, whole, strict=True)):
            if a and (a > b or b % a or self.total % (b // a)):
                self.refuse(
                    node,
                    ref,
                    self.origin.get(value, scope_of(node)),
                    f"each device computes on dim {d} of size {a} where the {self._whole} has {b}, "
                    f"not a block of it over {axes_text(self.sizes)}",
                    step_mixing_fix(self.sequence)
                    if self.step
                    else "split and gather alike in a column layer and its row layer (the same sequence_dim, "
                    "or none), and feed the model whole inputs or its sequence slices",
                )
        return tuple(b // a if a else 1 for a, b in zip(held, whole, strict=True))

    def rule(self, node: Node, ref: Node | None, factors: dict[int, tuple[int, ...]]) -> None:
        """One operation's checks, given what a device holds of its values (``factors``)."""
        sums = [v for v in node.ins if v in self.partial]
        if self.step and node.prim in SUMS and sums and self.over_split(node):  # (the step's own psum)
            self.collected(node, self.partial[sums[0]])
            return
        split = [(v, d) for v, f in factors.items() for d, n in enumerate(f) if n > 1]
        if not split and not sums:
            self.carried(node)
            return
        origin = next((self.origin[v] for v in node.ins if v in self.origin), scope_of(node))
        for out in node.outs:
            if ref is None or sums or any(n > 1 for n in factors.get(out, ())):
                self.origin[out] = origin
        made = self.mixed(node, ref, factors, split, origin)
        # (a step's whole term added to its share, an auxiliary loss: its pmean adds it once)
        offset = self.step and node.prim in ("add", "sub", "add_any")
        if sums and not linear(node, sums) and not offset:
            self.refuse_partial(node, ref, self.partial[sums[0]])
        if sums or made:
            module = scope_of(node) if self.named(scope_of(node))[0] else origin  # (the row layer's)
            contracted = node.prim in ("dot_general", "conv_general_dilated")
            over = (
                max(  # (one operand's summed dims: a contraction sums the other's alike)
                    math.prod(factors[v][d] for u, d in split if u == v and sums_over(node, v, d))
                    for v, _ in split
                )
                if made
                else 1
            )
            made_here = PartialSum(made or "", str(user_site(source_of(node))), module, contracted, over)
            record = self.partial[sums[0]] if sums else made_here
            if sums and made:  # (summed again over split dims: a share of a share)
                record = dataclasses.replace(record, over=record.over * over)
            for out in node.outs:
                self.partial[out] = record

    def collected(self, node: Node, made: PartialSum) -> None:
        """The step's own sum over mesh axes (a ``psum``, a ``pmean``'s): the partial sums it
        reads are whole after it where its axes hold every share (``made.over`` of them), else
        still a share of the sum (a ``pmean`` over ``data`` of what is split over ``data`` and
        ``context`` too)."""
        axes = _axes_of(node)
        summed = math.prod(self.sizes.get(a, 1) for a in axes if isinstance(a, str))
        if summed >= made.over:
            return
        left = dataclasses.replace(made, over=made.over // summed, missed=(*made.missed, *map(str, axes)))
        for out in node.outs:
            self.partial[out] = left

    def mixed(self, node: Node, ref: Node | None, factors: dict, split: list, origin: str) -> str | None:
        """Refuses an operation that computes across a block; returns what it sums, if it
        makes a partial sum."""
        if node.prim == "reshape" and ref is not None:
            self.reshape(node, ref, origin)
            return None
        made = None
        for v, d in split:
            if (v, d) not in node.mixes:
                continue
            if sums_over(node, v, d):
                made = node.mixes[(v, d)]
            elif node.prim in RANDOM and str(site_of(source_of(node))).startswith(FLAX_ATTENTION):
                continue
            elif not node.known:
                self.undecided[f"{node.prim} at {user_site(source_of(node))}"] = None
            else:
                why = f"{node.mixes[(v, d)]}, of which each device holds 1/{factors[v][d]}"
                features = d == len(self.local.shapes[v]) - 1
                # (the step's sequence split: the only split, or a dim other than the features)
                by_sequence = self.sequence is not None and (not features or len(self.sizes) == 1)
                fix = step_mixing_fix(self.sequence) if self.step else mixing_fix(node.prim, features)
                self.refuse(node, ref, origin, why, fix, by_sequence)
        for group in node.same:  # (a dim of 1 on both sides is broadcast: no block)
            found = {factors[v][d] for v, d in group if v in factors and self._size(v, d, factors) > 1}
            if len(found) > 1:
                why = f"{node.prim} combines blocks of different sizes ({sorted(found)}) of one dim"
                self.refuse(node, ref, origin, why, "give the layers whose outputs meet here the same roles")
        return made

    def _size(self, value: int, dim: int, factors: dict) -> int:
        """A dim's unsharded size (1 on both sides: broadcast, no block)."""
        return self.local.shapes[value][dim] * factors[value][dim]

    def reshape(self, node: Node, ref: Node, origin: str) -> None:
        """In each group of dims a reshape merges or splits (on the unsharded shapes), a
        device's part is a block of the group."""
        for side, (value, full) in enumerate(((node.ins[0], ref.ins[0]), (node.outs[0], ref.outs[0]))):
            assert value is not None and full is not None
            for group in ref.params["groups"]:
                held = [self.local.shapes[value][d] for d in group[side]]
                whole = [self.reference.shapes[full][d] for d in group[side]]
                if not is_block(held, whole):
                    self.refuse_reshape(node, ref, origin, group[1][0])

    # The refusals: each a RuleError naming the role, the module, the operation at its line,
    # both shapes, why the sharded model would compute another function, and a fix then accepted.

    def outputs(self, split_outputs: tuple[int, ...]) -> None:
        """What leaves the model is whole (or split on ``split_outputs``), never partial sums."""
        for value, full in zip(self.local.outputs, self.reference.outputs, strict=False):
            held, whole = self.local.shapes[value], self.reference.shapes[full]
            split = {d for d, (a, b) in enumerate(zip(held, whole, strict=False)) if a != b}
            if value in self.partial or not split <= {d % max(len(held), 1) for d in split_outputs}:
                what = "partial sums" if value in self.partial else f"split on dim {min(split)}"
                if self.step:
                    self.refuse_step_output(value, what, held, whole)
                module, role = self.named(self.origin.get(value, ""))
                by = f" (by {role} on {module})" if module else ""
                err = RuleError(
                    f"{self.where}: the model's output leaves {what}{by}: {shape_text(held)} on each device, "
                    f"{shape_text(whole)} unsharded. Fix: end the region with a RowParallel layer, or give "
                    f"the last ColumnParallel gather_output=True."
                )
                raise blaming(err, module, f"the plan check: the model's output would leave {what}")

    def refuse_step_output(self, value: int, what: str, held: tuple, whole: tuple) -> None:
        """A step's result (a gradient, a metric) that is one device's share of a sum, or its
        block of a value split another way than the batch."""
        made = self.partial.get(value)
        where = f" of {made.what} at {made.site}" if made else ""
        summed = f", summed over {names_text(list(made.missed))} only" if made and made.missed else ""
        axes = tuple(self.sizes)
        raise RuleError(
            f"{self.where}: the step returns {what}{where}{summed}: {shape_text(held)} on each device, "
            f"{shape_text(whole)} on the whole batch, which is split over {axes_text(self.sizes)}. Fix: "
            f"pmean (or psum) it over every axis the batch is split over: jax.lax.pmean(x, {axes!r}) "
            f"(sync_gradients(grads, {axes!r}) for the gradients)."
        )

    def refuse_reshape(self, node: Node, ref: Node, origin: str, major: int) -> None:
        full, held = self.reference.shapes[ref.outs[0]], self.local.shapes[node.outs[0]]
        self.refuse(
            node,
            ref,
            origin,
            f"it regroups each device's block with whole dims: the unsharded model makes "
            f"{shape_text(full)}, each device {shape_text(held)}, not a block of it",
            reshape_fix(full, held, major),
        )

    def refuse_partial(self, node: Node, ref: Node | None, made: PartialSum) -> None:
        partial = f"the partial sums of {made.what} (at {made.site}: each device's share of a sum)"
        if node.prim in ("add", "sub", "add_any") and made.contracted:
            why = f"{node.prim} adds a value whole on every device to {partial}, counted {self.total} times"
            fix = "add it after the sum (RowParallel adds a module's bias once, after its sum)"
        elif self.step:
            summed = f" (summed over {names_text(list(made.missed))} only)" if made.missed else ""
            why = f"{node.prim} reads {partial}{summed} before they are summed over {axes_text(self.sizes)}"
            fix = step_partial_fix(node.prim, tuple(self.sizes))
            self.refuse(node, ref, made.module, why, fix, kind=PARTIAL_SUM_READ)
        else:
            why = f"{node.prim} reads {partial} before anything sums them over {axes_text(self.sizes)}"
            fix = "a mean, norm or softmax of split features must see them all: compute it after the sum"
        self.refuse(node, ref, made.module, why, fix)

    def refuse_alike(self, node: Node, value: int, factors: tuple[int, ...], origin: str) -> None:
        """``node`` made ``value`` from values whole on every device, smaller than the unsharded
        model's (which ``factors`` says): every device holds the same part, as if its block."""
        held = self.local.shapes[value]
        dim = next(d for d, n in enumerate(factors) if n > 1)
        whole = shape_text(tuple(h * n for h, n in zip(held, factors, strict=True)))
        why = (
            f"each device makes the same {shape_text(held)} of values it holds whole, read as its block of "
            f"{whole} (the unsharded model's), which differs from device to device"
        )
        where = SEQUENCE_WHOLE if dim < len(held) - 1 else "compute it where that dim is whole"
        cut = "cut it by the model's sizes, not a split value's shape (no device cuts its own block)"
        fix = f"{cut}; {where}"
        self.refuse(node, None, origin, why, fix)

    def leave_whole(self, module: str) -> str:
        """How to leave ``module`` whole so that the plan is then accepted: with the layers it
        is split together with (:func:`~fsdp_tp._check.partners.partners`), each of whose
        splits would be refused again beside a whole one."""
        together = partners(self.reference, module, self.named)
        if len(together) == 1:
            return f"leave {module} whole ({self.whole})"
        others = [m for m in together if m != module]
        whole = self.whole.replace("its tp rule", "their tp rules")
        return f"leave {module} whole together with {names_text(others)}, the layers split with it ({whole})"

    @property
    def _what(self) -> str:
        return "step" if self.step else "model"

    @property
    def _whole(self) -> str:
        return "step on the whole batch" if self.step else "unsharded model"

    def refuse(
        self, node: Node, ref: Node | None, origin: str, why: str, fix: str, by_sequence=False, kind=""
    ) -> None:
        module, role = self.named(origin)
        sides = (("in", node.ins, ref.ins if ref else []), ("out", node.outs, ref.outs if ref else []))
        shapes = "; ".join(
            f"{what} {values_text(self.local, vs)} on each device"
            + (f", {values_text(self.reference, rs)} unsharded" if rs else "")
            for what, vs, rs in sides
        )
        drop = f"; or {self.leave_whole(module)}" if module else ""
        at = user_site(source_of(node)) or "a line JAX does not record"
        verb = "split" if role.startswith("the ") else "splits"  # ("the tp rules", "the Megatron layers")
        splits = f"{role} on {module or 'the model'} {verb}"
        # (the step's split: the only one, or a dim no role's module splits, past the features)
        if self.step:  # (no module to leave whole: the step's own code, over the batch's axes)
            splits, module, drop = f"the batch split over {axes_text(self.sizes)} reaches", "", ""
        elif self.sequence is not None and (by_sequence or len(self.sizes) == 1 or role.startswith("the ")):
            splits, module, drop = f"the sequence split over {self.sequence!r} reaches", "", ""
            fix = SEQUENCE_SPLIT  # (not a rule's: nothing to leave whole)
        err = RuleError(
            f"{self.where}: {splits} what the {self._what}'s code at {at} "
            f"does not keep apart: {node.prim} ({shapes}): {why}; the sharded {self._what} would compute "
            f"another function. Fix: {fix}{drop}."
        )
        raise blaming(err, module, f"the plan check: {node.prim} at {at}: {why}", kind)

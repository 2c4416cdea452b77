"""What the plan check says where it refuses (:class:`Refusals`, the wording of
:class:`~fsdp_tp.tp._blocks.Blocks`' refusals): the role and module whose split reaches the
operation, the operation and its line in the user's source, both shapes, why the sharded
model would compute another function, and a fix that is then accepted.

>>> shape_text((2, 8, 4)), axes_text({"tensor": 4})
('[2,8,4]', "'tensor' (4)")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from ..errors import RuleError
from ._graph import Graph
from ._partners import partners
from ._relations import Node, shape_text
from ._sites import source_of, user_site

__all__ = ["RULE_DROPPED", "Named", "PartialSum", "Refusals", "axes_text", "blaming", "mixing_fix"]

Named = Callable[[str], tuple[str, str]]  # a name stack -> (module path, its role as written)
RULE_DROPPED = "drop its tp rule"  # how a module under tp rules is left whole
# Where a dim other than the features (the sequence a role's sequence_dim splits) is whole.
_SEQUENCE_WHOLE = (
    "compute it where that dim is whole: a sequence split by the roles' sequence_dim is whole "
    "from a column layer to its row layer, and everywhere without sequence_dim"
)


@dataclasses.dataclass(frozen=True)
class PartialSum:
    """Where a partial sum was made: the operation, its line, the module whose split it sums."""

    what: str
    site: str
    module: str
    contracted: bool  # a matmul's (a row layer's products), not a reduction's (a mean, a norm)


class Refusals:
    """The refusals of a walk over ``local`` (one device's trace) against ``reference`` (the
    unsharded model's) for roles over ``sizes``' axes (``total`` devices): each a
    :class:`~fsdp_tp.errors.RuleError` starting with ``where``, naming through ``named``."""

    local: Graph
    reference: Graph
    sizes: dict[str, int]
    total: int
    where: str
    named: Named
    whole: str  # how the user leaves a module whole (RULE_DROPPED under tp rules)
    partial: dict[int, PartialSum]  # a value -> where the partial sum it holds was made
    origin: dict[int, str]  # a split value -> the name stack of the op that split it

    def outputs(self, split_outputs: tuple[int, ...]) -> None:
        """What leaves the model is whole (or split on ``split_outputs``), never partial sums."""
        for value, full in zip(self.local.outputs, self.reference.outputs, strict=False):
            held, whole = self.local.shapes[value], self.reference.shapes[full]
            split = {d for d, (a, b) in enumerate(zip(held, whole, strict=False)) if a != b}
            if value in self.partial or not split <= {d % max(len(held), 1) for d in split_outputs}:
                what = "partial sums" if value in self.partial else f"split on dim {min(split)}"
                module, role = self.named(self.origin.get(value, ""))
                by = f" (by {role} on {module})" if module else ""
                err = RuleError(
                    f"{self.where}: the model's output leaves {what}{by}: {shape_text(held)} on each device, "
                    f"{shape_text(whole)} unsharded. Fix: end the region with a RowParallel layer, or give "
                    f"the last ColumnParallel gather_output=True."
                )
                raise blaming(err, module, f"the plan check: the model's output would leave {what}")

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
        where = _SEQUENCE_WHOLE if dim < len(held) - 1 else "compute it where that dim is whole"
        cut = "cut it by the model's sizes, not a split value's shape (no device cuts its own block)"
        fix = f"{cut}; {where}"
        self.refuse(node, None, origin, why, fix)

    def leave_whole(self, module: str) -> str:
        """How to leave ``module`` whole so that the plan is then accepted: with the layers it
        is split together with (:func:`~fsdp_tp.tp._partners.partners`), each of whose
        splits would be refused again beside a whole one."""
        together = partners(self.reference, module, self.named)
        if len(together) == 1:
            return f"leave {module} whole ({self.whole})"
        others = [m for m in together if m != module]
        whole = self.whole.replace("its tp rule", "their tp rules")
        return f"leave {module} whole together with {_names(others)}, the layers split with it ({whole})"

    def refuse(self, node: Node, ref: Node | None, origin: str, why: str, fix: str) -> None:
        module, role = self.named(origin)
        sides = (("in", node.ins, ref.ins if ref else []), ("out", node.outs, ref.outs if ref else []))
        shapes = "; ".join(
            f"{what} {_texts(self.local, vs)} on each device"
            + (f", {_texts(self.reference, rs)} unsharded" if rs else "")
            for what, vs, rs in sides
        )
        drop = f"; or {self.leave_whole(module)}" if module else ""
        at = user_site(source_of(node)) or "a line JAX does not record"
        verb = "split" if role.startswith("the ") else "splits"  # ("the tp rules", "the Megatron layers")
        err = RuleError(
            f"{self.where}: {role} on {module or 'the model'} {verb} what the model's code at {at} "
            f"does not keep apart: {node.prim} ({shapes}): {why}; the sharded model would compute "
            f"another function. Fix: {fix}{drop}."
        )
        raise blaming(err, module, f"the plan check: {node.prim} at {at}: {why}")


def reshape_fix(full: tuple[int, ...], held: tuple[int, ...], major: int) -> str:
    """How a reshape keeps each device's block whole: where the split count divides the dim
    the split lands on (``major``), that dim sized from the array (-1); where it does not (a
    fused ``qkv.reshape(b, s, 3, heads, hd)``: 3 parts over 4 devices), a dim it divides put
    first, the other after it (head-major: ``(b, s, heads, 3, hd)``), or the parts apart.

    >>> reshape_fix((4, 4, 3, 4, 8), (4, 4, 3, 1, 8), 2)[:69]
    'put a dim the 4 devices divide first: reshape to (4, 4, -1, 3, 8), -1'
    >>> reshape_fix((4, 4, 4, 8), (4, 4, 1, 8), 2)[-93:]
    'reshape to (4, 4, -1, 8), -1 where the unsharded model has 4, so each device keeps whole ones'
    """
    n = math.prod(full) // max(math.prod(held), 1)
    if full[major] % n == 0:
        fixed = ", ".join("-1" if d == major else str(size) for d, size in enumerate(full))
        return (
            f"size the dim the split lands on from the array, not from the module's constants: reshape "
            f"to ({fixed}), -1 where the unsharded model has {full[major]}, so each device keeps whole ones"
        )
    apart = "give each part its own layer and rule (q, k and v apart)"
    after = next((d for d in range(major + 1, len(full)) if full[d] % n == 0), None)
    if after is None:
        return apart
    order = [*range(major), after, *(d for d in range(major, len(full)) if d != after)]
    fixed = ", ".join("-1" if d == after else str(full[d]) for d in order)
    return (
        f"put a dim the {n} devices divide first: reshape to ({fixed}), -1 where the unsharded model has "
        f"{full[after]}, the {full[major]} after it, so each device's block holds whole groups of every "
        f"part (the columns of a part interleave, a layout of the same parameters); or {apart}"
    )


def _names(modules: list[str]) -> str:
    return modules[0] if len(modules) == 1 else f"{', '.join(modules[:-1])} and {modules[-1]}"


def blaming(err: RuleError, module: str, reason: str) -> RuleError:
    """``err`` carrying the module it refuses (``err.module``: a plan finder leaves its region
    whole) and the reason in a few words (``err.reason``)."""
    err.module, err.reason = module, reason  # type: ignore[attr-defined]
    return err


def mixing_fix(prim: str, features: bool = True) -> str:
    """The fix for ``prim`` computing across a split dim: the features (a value's last dim,
    split between a column layer and its row layer) or another (the sequence a role's
    ``sequence_dim`` splits between the layers, whole from a column layer to its row layer)."""
    if not features:
        return _SEQUENCE_WHOLE
    if prim in ("slice", "split", "dynamic_slice", "concatenate", "pad", "gather"):
        return "give each part its own layer (q, k and v apart) and rule, so each device splits each part"
    return "compute it where that dim is whole (after the row layer's sum)"


def _texts(graph: Graph, values) -> str:
    return " ".join(shape_text(graph.shapes[v]) for v in values if v is not None)


def axes_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{axis!r} ({size})" for axis, size in sizes.items())

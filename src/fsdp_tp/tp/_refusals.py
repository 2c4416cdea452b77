"""What the plan check says where it refuses (:class:`Refusals`, the wording of
:class:`~fsdp_tp.tp._blocks.Blocks`' refusals): the role and module whose split reaches the
operation, the operation and its line in the user's source, both shapes, why the sharded
model would compute another function, and a fix that is then accepted.

>>> shape_text((2, 8, 4)), axes_text({"tensor": 4})
('[2,8,4]', "'tensor' (4)")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..errors import RuleError
from ._graph import Graph
from ._relations import Node, shape_text
from ._sites import user_site

__all__ = ["RULE_DROPPED", "Named", "PartialSum", "Refusals", "axes_text", "blaming", "mixing_fix"]

Named = Callable[[str], tuple[str, str]]  # a name stack -> (module path, its role as written)
RULE_DROPPED = "drop its tp rule"  # how a module under tp rules is left whole


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

    def refuse_reshape(self, node: Node, ref: Node, origin: str, major: int) -> None:
        full, held = self.reference.shapes[ref.outs[0]], self.local.shapes[node.outs[0]]
        fixed = ", ".join("-1" if d == major else str(n) for d, n in enumerate(full))
        self.refuse(
            node,
            ref,
            origin,
            f"it regroups each device's block with whole dims: the unsharded model makes "
            f"{shape_text(full)}, each device {shape_text(held)}, not a block of it",
            f"size the dim the split lands on from the array, not from the module's constants: reshape "
            f"to ({fixed}), -1 where the unsharded model has {full[major]}, so each device keeps whole ones",
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

    def refuse(self, node: Node, ref: Node | None, origin: str, why: str, fix: str) -> None:
        module, role = self.named(origin)
        sides = (("in", node.ins, ref.ins if ref else []), ("out", node.outs, ref.outs if ref else []))
        shapes = "; ".join(
            f"{what} {_texts(self.local, vs)} on each device"
            + (f", {_texts(self.reference, rs)} unsharded" if rs else "")
            for what, vs, rs in sides
        )
        drop = f"; or leave {module} whole ({self.whole})" if module else ""
        at = user_site(node.source) or "a line JAX does not record"
        err = RuleError(
            f"{self.where}: {role} on {module or 'the model'} splits what the model's code at {at} "
            f"does not keep apart: {node.prim} ({shapes}): {why}; the sharded model would compute "
            f"another function. Fix: {fix}{drop}."
        )
        raise blaming(err, module, f"the plan check: {node.prim} at {at}: {why}")


def blaming(err: RuleError, module: str, reason: str) -> RuleError:
    """``err`` carrying the module it refuses (``err.module``: a plan finder leaves its region
    whole) and the reason in a few words (``err.reason``)."""
    err.module, err.reason = module, reason  # type: ignore[attr-defined]
    return err


def mixing_fix(prim: str) -> str:
    if prim in ("slice", "split", "dynamic_slice", "concatenate", "pad", "gather"):
        return "give each part its own layer (q, k and v apart) and rule, so each device splits each part"
    return "compute it where that dim is whole (after the row layer's sum)"


def _texts(graph: Graph, values) -> str:
    return " ".join(shape_text(graph.shapes[v]) for v in values if v is not None)


def axes_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{axis!r} ({size})" for axis, size in sizes.items())

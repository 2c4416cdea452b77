"""The words of the plan check's refusals (:class:`~fsdp_tp._check.blocks.Blocks` raises
them): the shapes, the axes and the names spelled, the fix for a reshape and for a mix of split
features, and a refusal blamed on the module whose split it is.

>>> shape_text((2, 8, 4)), axes_text({"tensor": 4})
('[2,8,4]', "'tensor' (4)")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from .._trace.graph import Graph
from .._trace.relations import shape_text
from ..errors import RuleError

__all__ = [
    "RULE_DROPPED",
    "SEQUENCE_WHOLE",
    "Named",
    "PartialSum",
    "axes_text",
    "blaming",
    "mixing_fix",
    "names_text",
    "reshape_fix",
    "step_mixing_fix",
    "step_partial_fix",
    "values_text",
]

Named = Callable[[str], tuple[str, str]]  # a name stack -> (module path, its role as written)
RULE_DROPPED = "drop its tp rule"  # how a module under tp rules is left whole
# Where a dim other than the features (the sequence a role's sequence_dim splits) is whole.
# (the fixes for a dim other than the features computing across: a role's sequence_dim, and a
# step's sequence split, SEQUENCE_SPLIT below)
SEQUENCE_WHOLE = (
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
    over: int = 0  # how many devices' shares it is one of (the step's check: _check.step)
    missed: tuple[str, ...] = ()  # the axes a step's psum summed it over, too few


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


def names_text(modules: list[str]) -> str:
    return modules[0] if len(modules) == 1 else f"{', '.join(modules[:-1])} and {modules[-1]}"


# A refusal's kind (``err.kind``), where a caller acts on it: the step's own code reads a
# device's share of a sum (check_sharded then names the (sum, weight) loss it takes).
PARTIAL_SUM_READ = "a partial sum read"


def blaming(err: RuleError, module: str, reason: str, kind: str = "") -> RuleError:
    """``err`` carrying the module it refuses (``err.module``: a plan finder leaves its region
    whole), the reason in a few words (``err.reason``) and its kind (``err.kind``, e.g.
    :data:`PARTIAL_SUM_READ`; empty: none a caller acts on)."""
    err.module, err.reason, err.kind = module, reason, kind  # type: ignore[attr-defined]
    return err


SEQUENCE_SPLIT = (
    "take positions (and masks' segment ids) as inputs with the batch, which the step lays out "
    "with the tokens (fsdp_tp.context.document_positions gives a packed sequence's), and mix "
    "tokens only through the attention the library computes across devices "
    "(fsdp_tp.attention.attend, or jax.nn.dot_product_attention with is_causal=True)"
)


def mixing_fix(prim: str, features: bool = True) -> str:
    """The fix for ``prim`` computing across a split dim: the features (a value's last dim,
    split between a column layer and its row layer) or another (the sequence a role's
    ``sequence_dim`` splits between the layers, whole from a column layer to its row layer).
    A step's sequence split has its own, :data:`SEQUENCE_SPLIT`, which the refusal gives."""
    if not features:
        return SEQUENCE_WHOLE
    if prim in ("slice", "split", "dynamic_slice", "concatenate", "pad", "gather"):
        return "give each part its own layer (q, k and v apart) and rule, so each device splits each part"
    return "compute it where that dim is whole (after the row layer's sum)"


def step_mixing_fix(sequence: str | None) -> str:
    """The fix for a step's own code computing across the tokens or rows the batch split gives
    each device: a next-token shift with the batch (before the layout), a reduction by sums."""
    shift = (
        "shift the targets with the batch, on the whole sequence before the step lays it out: "
        "targets, weights = fsdp_tp.context.next_token_targets(tokens, segment_ids), passed as batch leaves "
        "split like the tokens (no slice, roll or pad of a per-token leaf in the step)"
    )
    reduce = "reduce over the batch's tokens and rows only by sums, summed over its axes after"
    return f"{shift}; {reduce}" if sequence is not None else f"{reduce}; {shift}"


def step_partial_fix(prim: str, axes: tuple[str, ...]) -> str:
    """The fix for a step's per-device share of a sum read by a non-linear op: a ratio of
    per-device sums (a token-weighted mean a device, then averaged), batch statistics of a
    device's rows (a norm without ``axis_name``)."""
    return (
        f"complete the sum over every device before the {prim}: psum it (pmean for a mean) over "
        f"{axes!r}; a token-weighted loss: fsdp_tp.gradients.global_mean_loss(local_sum, local_count, "
        f"{axes!r}) (a per-device loss whose pmean is the whole batch's weighted mean); batch "
        f"statistics: BatchNorm(axis_name={axes!r})"
    )


def values_text(graph: Graph, values) -> str:
    return " ".join(shape_text(graph.shapes[v]) for v in values if v is not None)


def axes_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{axis!r} ({size})" for axis, size in sizes.items())

"""Whether a tensor-parallel plan computes the unsharded model: :func:`check_plan`.

A role runs its module on this device's slices; the model's own code around it runs as
written, on whatever it is handed. The plan is Megatron's only if that code keeps each
device's part a block of the unsharded computation. Code sized from the module's own
constants breaks that without an error: with q's 64 features split 4 ways,
``x.reshape(b, s, self.heads, -1)`` regroups a device's 16 features into all 8 heads. Only the
trace shows it, so each front end traces the model's call twice, abstractly, before anything
trains: as one device computes it under the plan, and as the unsharded model does. :class:`.blocks.Blocks`
reads one against the other; a refusal names the operation, its line, the role, both shapes, a fix.

The roles run without their rings there (:class:`~fsdp_tp._context.Check`'s ``unringed``: the
same numbers, a ring being the same gather or reduce-scatter in chunks, each layer called once,
as in the unsharded model's trace), and an error of the model's own code on its slices is named
with the plan (:func:`raise_failure`). An operation the check does not know, reached by a
split, leaves the plan unchecked there: one :class:`~fsdp_tp.errors.UncheckedPlanWarning`.
:func:`check_call` drives all of it once for every front end (Linen's rules, NNX's, the Linen
Megatron layers'), each of which only traces and names a call for it (a :class:`PlanCall`).
Inside a step that splits the sequence over ``context`` (:mod:`fsdp_tp.context`), a call is
checked against the model on the whole sequence too, tensor roles or none: code that mixes
tokens other than through the library's attention (positions from the local length, a mask
from local shapes, a cumsum) is refused at its line (:func:`sequence_split`).

>>> import jax, jax.numpy as jnp
>>> def attention(p, x):   # q's features regrouped by a head count: (2, 16) -> (2, 4, 4)
...     return (x @ p).reshape(2, 4, -1).sum(-1)
>>> reference = Graph.trace(attention, jnp.ones((8, 16)), jnp.ones((2, 8)))
>>> local = Graph.trace(attention, jnp.ones((8, 4)), jnp.ones((2, 8)))   # a fourth of the features
>>> named = lambda stack: ("q", "ColumnParallel()")   # (the module and role of a name stack)
>>> check_plan(local, [Reference(lambda: reference)], {"tensor": 4}, "demo", named)
Traceback (most recent call last):
...
fsdp_tp.errors.RuleError: demo: ColumnParallel() on q splits what the model's code at ... reshape ...
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax

from .._axes import bound_axis_names
from .._context import CHECK
from .._sequence_split import sequence_split
from .._trace.graph import Graph
from ..errors import RuleError, UncheckedPlanWarning, warn
from ..tp._find.finder import find_plan
from ..tp._find.plan import letter_hints
from ..tp._role import Layer, axes_of
from ..tp._rules import CompiledRole
from .blocks import Blocks
from .failures import raise_failure
from .refusals import PARTIAL_SUM_READ, RULE_DROPPED, Named
from .round_trips import require_no_round_trip

__all__ = [
    "PARTIAL_SUM_READ",
    "Graph",
    "PlanCall",
    "Reference",
    "check_call",
    "check_plan",
    "checking",
    "own_trace",
    "raise_failure",
    "references_for",
    "switched_off",
]


def checking() -> bool:
    """Whether the front ends check plans (always, but inside :func:`switched_off`)."""
    return not CHECK.get().off


def switched_off() -> contextlib.AbstractContextManager[Any]:
    """Within, no plan is checked: how a test shows that the equality of outputs and gradients
    (its oracle) catches what the check refuses."""
    return CHECK.scoped(off=True)


def own_trace() -> contextlib.AbstractContextManager[Any]:
    """Within, a front end's trace of the model's call for the check: no plan is checked again
    in it, and the roles run without their rings (``unringed``)."""
    return CHECK.scoped(off=True, unringed=True)


@dataclasses.dataclass(frozen=True)
class Reference:
    """How to trace the unsharded model (``build``), and the dims its outputs may leave split
    on (``split_outputs``; negative: from the end)."""

    build: Callable[[], Graph]
    split_outputs: tuple[int, ...] = (-1,)


@dataclasses.dataclass(frozen=True)
class PlanCall:
    """One call of a model under tp roles, as its front end traces and names it for
    :func:`check_call`: the ``roles`` and the plan as ``written`` (``"the tp rules [...]"``, for
    a refusal, which starts with ``where``), what makes two calls one check besides the axis
    sizes (``same``, hashable: input shapes, a Linen module's fields), one device's trace under
    the plan (``local()``), the unsharded model's on the same inputs (``unsharded(whole=None)``:
    their shapes through ``whole`` where given), the name stack's module and role (``named``),
    the call as the finder reads it (``finder()``, a ``FindCall.trace``; ``None`` where the plan
    is the finder's), against which a refusal names the einsum letters ``rules`` (compiled, as
    written) left to chance. ``sizes``: the axes' sizes where the front end knows them (a
    mesh's), else the bound axes' the roles split over; ``whole``, ``split_by``: as
    :func:`check_plan`'s."""

    roles: tuple[Any, ...]
    written: str
    where: str
    same: Hashable
    local: Callable[[], Graph]
    unsharded: Callable[..., Graph]
    named: Named
    rules: tuple[CompiledRole, ...] = ()
    finder: Callable[[], tuple[Graph, Mapping[str, Layer]]] | None = None
    sizes: Mapping[str, int] | None = None
    whole: str = RULE_DROPPED
    split_by: tuple[str, ...] = ()


def check_call(call: PlanCall, checked: set) -> None:
    """Refuses (``RuleError``) a plan under which ``call`` does not compute blocks of the unsharded
    model's, once per ``call.same`` and axis sizes (none: not checked). Every front end's, here.
    Under a step's sequence split, the blocks are of the model on the whole sequence."""
    if not checking():
        return  # (the check's own trace of the call)
    sequence = sequence_split()
    if sequence is not None and (calls := CHECK.get().calls) is not None:
        calls.count += 1  # (the step's model met a check of the whole sequence: plain.step_calls)
    if not call.roles and sequence is None:
        return
    sizes = call.sizes
    if sizes is None:
        bound = bound_axis_names()
        sizes = {axis: jax.lax.axis_size(axis) for axis in sorted(axes_of(call.roles)) if axis in bound}
    if sequence is not None:
        sizes = {**sizes, sequence[0]: sequence[1]}
    key = (call.same, repr(sizes))
    if not sizes or key in checked:
        return
    hinted = lambda: _letter_hints(call, max(sizes.values()))
    with CHECK.scoped(unringed=True):  # (every trace unringed: a sequence split's attention local in each)
        try:
            local = call.local()
        except Exception as err:
            where, whole = call.where, call.whole
            raise_failure(err, call.unsharded, where, call.written, sizes, hinted, whole, roles=call.roles)
        references = (
            [_whole_sequence(call.unsharded, sequence[1])]
            if sequence is not None
            else references_for(call.unsharded, call.roles, sizes)
        )
        axis = sequence[0] if sequence is not None else None
        check_plan(local, references, sizes, call.where, call.named, hinted, call.whole, call.split_by, axis)
    checked.add(key)


def _whole_sequence(build: Callable[[Callable | None], Graph], size: int) -> Reference:
    """The unsharded model on the whole sequence: dim 1 of each input past a vector ``size``
    times a device's (the step splits every per-token leaf so), its outputs split there too."""
    whole = lambda shape: tuple(x * size if i == 1 else x for i, x in enumerate(shape))
    return Reference(lambda: build(whole), (1, -1))


def _letter_hints(call: PlanCall, size: int) -> str:
    """What a refusal of ``call``'s plan adds: each einsum letter its rules left to chance that
    the plan found from the model for an axis of ``size`` takes otherwise."""
    if call.finder is None or not call.rules:
        return ""
    graph, layers = call.finder()
    return letter_hints(call.rules, layers, find_plan(graph, layers, size=size))


def check_plan(
    local: Graph,
    references: Sequence[Reference],
    sizes: Mapping[str, int],
    where: str,
    named: Named,
    hints: Callable[[], str] = str,
    whole: str = RULE_DROPPED,
    split_by: Collection[str] = (),
    sequence: str | None = None,
) -> list[str]:
    """Raises :class:`~fsdp_tp.errors.RuleError` where ``local`` (one device's trace under the
    plan, whose roles split over ``sizes``' axes) does not compute blocks of the unsharded
    model's trace on the same inputs: the first of ``references`` it fits, the first one's
    refusal if none. ``where``: the caller, as the error starts; ``named(name_stack)``: the
    module an operation belongs to and its role as the user wrote it. Returns (and warns of)
    the operations the check does not know that a split reaches.

    A model's output may leave split on its last dim (logits over a vocabulary split, for
    :func:`~fsdp_tp.vocab_parallel_cross_entropy`), never as partial sums. ``hints()``:
    what a refusal adds (:func:`~fsdp_tp.tp._find.plan.letter_hints`: the einsum letters the plan
    finder gives), computed only then; ``whole``: how the user leaves a module whole;
    ``split_by``: the primitives by which the library's own layers split (:class:`Blocks`);
    ``sequence``: the axis a step splits the sequence over, whose refusals say so."""
    refused = None
    for index, reference in enumerate(references):
        try:
            graph = reference.build()
        except Exception:
            if index == 0:  # (the unsharded model on the device's own inputs: its own error)
                raise
            continue  # (the model cannot run on this reference's inputs: not what it computes)
        blocks = Blocks(local, graph, sizes, where, named, whole, split_by, sequence)
        try:
            blocks.run(reference.split_outputs)
        except RuleError as err:
            refused = refused or err
            continue
        require_no_round_trip(local, where, named)
        if blocks.undecided:
            warn(
                UncheckedPlanWarning(
                    f"{where}: the tp plan could not be checked at {'; '.join(blocks.undecided)}: the "
                    f"check does not know what these do to a split dim. Prove the model equal to "
                    f"unsharded on a batch: fsdp_tp.testing.check_sharded(model, batch, loss, mesh, "
                    f"rules, tp_rules=...)."
                )
            )
        return list(blocks.undecided)
    assert refused is not None  # (no reference: nothing to fit)
    if extra := hints():  # (in place: the refusal keeps what it carries, its module and reason)
        refused.args = (f"{refused.args[0]}{extra}", *refused.args[1:])
    raise refused


def references_for(
    build: Callable[[Callable | None], Graph], roles: Iterable[Any], sizes: Mapping[str, int]
) -> list[Reference]:
    """The unsharded traces a device's trace may fit: the model on the same inputs, and, where
    every role with a ``sequence_dim`` has the same one over one axis, on inputs that dim times
    the axis size (a caller may feed a sequence-parallel model its sequence slices, which it
    then returns). ``build(whole)``: the trace, each input's shape through ``whole`` if given."""
    found = {(r.sequence_dim, r.axis) for r in roles if getattr(r, "sequence_dim", None) is not None}
    references = [Reference(lambda: build(None))]
    if len(found) == 1:
        ((dim, axis),) = found
        n = sizes.get(axis, 1)
        whole = lambda shape: tuple(x * n if i == dim else x for i, x in enumerate(shape))
        references.append(Reference(lambda: build(whole), (dim, -1)))
    return references

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
import traceback
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import jax

from ..._axes import bound_axis_names
from ..._context import CHECK
from ...errors import RuleError, UncheckedPlanWarning, warn
from .._experts import ExpertParallel
from .._find.plan import letter_hints
from .._jaxpr.graph import Graph
from .._jaxpr.sites import Site, flax_file, made_by_jax, users_file
from .._role import Layer, axes_of
from .._rules import CompiledRole
from ..auto import find_plan
from .blocks import Blocks
from .refusals import RULE_DROPPED, Named, axes_text
from .round_trips import require_no_round_trip

__all__ = [
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
    model's, once per ``call.same`` and axis sizes (none: not checked). Every front end's, here."""
    if not checking() or not call.roles:
        return  # (the check's own trace of the call)
    sizes = call.sizes
    if sizes is None:
        bound = bound_axis_names()
        sizes = {axis: jax.lax.axis_size(axis) for axis in sorted(axes_of(call.roles)) if axis in bound}
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
        references = references_for(call.unsharded, call.roles, sizes)
        check_plan(local, references, sizes, call.where, call.named, hinted, call.whole, call.split_by)
    checked.add(key)


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
    ``split_by``: the primitives by which the library's own layers split (:class:`Blocks`)."""
    refused = None
    for index, reference in enumerate(references):
        try:
            graph = reference.build()
        except Exception:
            if index == 0:  # (the unsharded model on the device's own inputs: its own error)
                raise
            continue  # (the model cannot run on this reference's inputs: not what it computes)
        blocks = Blocks(local, graph, sizes, where, named, whole, split_by)
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


def _flax_layer(err: Exception) -> str | None:
    """The class of the Flax layer whose own code raised ``err`` (its innermost frame outside
    JAX with a ``self`` is a Flax module's), else ``None``."""
    found = None
    tb = err.__traceback__
    while tb is not None:
        file, owner = tb.tb_frame.f_code.co_filename, tb.tb_frame.f_locals.get("self")
        if not made_by_jax(file) and _is_module(owner):  # (a Scope's frame, or a helper's: not one)
            found = type(owner).__name__ if flax_file(file) else None
        tb = tb.tb_next
    return found


def _is_module(owner: object) -> bool:
    return any(c.__module__ in ("flax.linen.module", "flax.nnx.module") for c in type(owner).__mro__)


def raise_failure(
    err: Exception,
    unsharded: Callable[[], Any],
    where: str,
    rules: str,
    sizes: Mapping[str, int],
    hints: Callable[[], str] = str,
    whole: str = RULE_DROPPED,
    roles: Iterable = (),
) -> NoReturn:
    """Raises what fits an error of the model's code on a device's slices under the plan
    (``rules``: the plan as written, ``"the tp rules [...]"``): the library's own errors as they
    are (they name their fix), and the model's own as they are where the unsharded model
    (``unsharded()`` traces it) fails too; else a :class:`~fsdp_tp.errors.RuleError` naming the
    line that failed, with ``hints()`` (:func:`~fsdp_tp.tp._find.plan.letter_hints`) after it and
    ``whole``, how a module is left whole."""
    frames = traceback.extract_tb(err.__traceback__)
    sites = [Site(f.filename, f.lineno or 0, f.name) for f in reversed(frames)]
    raiser = next((s for s in sites if not made_by_jax(s.file)), None)
    if type(err).__module__.startswith("fsdp_tp") or (raiser is not None and raiser.library):
        if isinstance(err, RuleError) and (extra := hints()):  # (a letter the rule left to chance)
            err.args = (f"{err.args[0]}{extra}", *err.args[1:])
        raise err  # (the library's own refusal: it names its fix)
    try:
        unsharded()
    except Exception:
        raise err from None  # (not the plan's doing: the model refuses these inputs itself)
    line = next((s for s in sites if users_file(s.file)), None)
    roles = list(roles)
    experts = [r for r in roles if isinstance(r, ExpertParallel)]
    if experts and not any(r.returns for r in experts):
        raise RuleError(
            f"{where}: under {rules} the model's code fails on each device's slices"
            f"{f' at {line}' if line else ''}: {type(err).__name__}: {err}. No ExpertParallel layer has "
            f"returns=True, so the experts' outputs never go back to their tokens' devices and the combine "
            f"reads the experts' buffers as its own. Fix: give the expert bank's last layer (the one whose "
            f"output the combine reads, e.g. the down projection) its own rule with "
            f"ExpertParallel(returns=True).{hints()}"
        ) from err
    if (layer := _flax_layer(err)) is not None:  # (a Flax layer the rules leave whole)
        raise RuleError(
            f"{where}: under {rules}, a {layer} the rules leave whole fails on a device's "
            f"slice of the features a column layer splits{f' at {line}' if line else ''}: "
            f"{type(err).__name__}: {err}. Its own sizes (its parameters') are the unsharded "
            f"model's, and a layer that reads the features whole (a norm over them) between a "
            f"column layer and its row layer is not the unsharded model's on a slice. Fix: leave the "
            f"column and row layers around it whole ({whole}), or move it out of the pair.{hints()}"
        ) from err
    raise RuleError(
        f"{where}: under {rules} the model's code fails on each device's slices"
        f"{f' at {line}' if line else ''}: {type(err).__name__}: {err}. Each role computes its "
        f"module on a block of what it splits over {axes_text(sizes)}, and the code around it runs as "
        f"written: a size taken from the module's constants (a head count, a stacked k/v dim) no "
        f"longer fits. Fix: size that code from the arrays it gets (reshape with -1 where the "
        f"split dim lands), give an einsum role the letter the model splits (letter=...), or leave "
        f"the modules around that line whole ({whole}).{hints()}"
    ) from err

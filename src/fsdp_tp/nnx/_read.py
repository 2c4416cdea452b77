"""Gather on read for NNX: a parameter Variable that holds this device's block and hands the
module the gathered value wherever the module reads it (and an rng key, folded per batch
shard).

An NNX module reads a parameter with ``self.kernel[...]`` (or ``.value``, ``get_value()``),
so the gather belongs in the Variable's ``get_value``, which flax asks us to override in a
Variable type of our own (its metadata hooks are deprecated). :func:`read_type` makes, per
Variable type of the model (``nnx.Param`` or a user's subclass), the subclass that does
it. The gather lands inside the module's call and inside any ``nnx.scan`` / ``nnx.remat``
of the model: a scan passes each layer's slice of the stacked block, so its gather moves
one layer's parameter, and a remat re-gathers in the backward pass. A parameter read twice
in one trace (a tied embedding: the lookup, then the logits) is gathered once, so its
gradient is reduce-scattered once (:func:`read_once`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax.extend
from flax import nnx
from flax.core.meta import Partitioned

from .._axes import varying_axes
from .._context import STEP
from .._types import AxisName
from ..collectives._gather import gather_box
from ..dropout import fold_rng_over_axis
from ..errors import RuleError
from ..precision import MixedPrecision

__all__ = ["FoldPlan", "ReadPlan", "on_read", "read_once", "read_type", "unfolded"]

_PLAN = "fsdp_tp_read"  # the Variable metadata key that holds the ReadPlan
_GATHERED = "_fsdp_tp_gathered"  # the read type's slot: (block, plan, trace, gathered value)


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """How a stored block becomes the value the module computes with: ``names`` per dim of
    the stored parameter (stacked layer dims first), gathered over ``axes``; over
    ``batch_axes`` the gradient comes back as the reduce-scattered mean. ``read_whole_over``:
    axes a tp role reads blocks of the whole value over (kv heads kept whole), whose sum of
    the gradient is then taken on the block, after the reduce-scatter. Hashable: NNX keeps
    Variable metadata in the graph it passes through its transforms."""

    path: str
    names: tuple
    axes: frozenset[AxisName]
    batch_axes: frozenset[AxisName]
    read_whole_over: frozenset[AxisName] = frozenset()
    precision: MixedPrecision | None = None  # read rounded to its gather_dtype, gathered in it

    def read(self, block):
        names = self.names
        if (dropped := len(names) - block.ndim) > 0:  # inside nnx.scan / vmap: one layer's slice
            if any(n is not None for n in names[:dropped]):
                raise RuleError(
                    f"{self.path}: its stacked layer dims {tuple(range(dropped))} are split over "
                    f"{names[:dropped]}, and nnx.scan / nnx.vmap hands each layer its slice of them; "
                    f"a device's block holds only some layers. Split another dim: give the layer "
                    f"dims None in the rule, e.g. P(None, {names[dropped - 1]!r})."
                )
            names = names[dropped:]
        # Under check_vma=True a split block varies over its axes; the gathered value then
        # meets data that varies over the batch axes (gather_box casts the block, not the
        # full value). Under check_vma=False nothing carries a vma.
        vary = self.batch_axes | self.read_whole_over if varying_axes(block) else frozenset()
        value = gather_box(Partitioned(block, names), self.axes, self.batch_axes, vary, self.precision)
        # What stays split is a tp role's slice, which the module computes on.
        return value.value if isinstance(value, Partitioned) else value


@contextlib.contextmanager
def unfolded() -> Iterator[None]:
    """Within: rng keys are read as stored (an exact dropout draws its block of the unsharded
    mask from the unsharded key, :mod:`fsdp_tp.nnx._dropout`)."""
    with STEP.scoped(keys_as_stored=True):
        yield


@dataclasses.dataclass(frozen=True)
class FoldPlan:
    """An rng key read folded over the batch axes: each batch shard draws its own random
    values where a module draws them itself, while the stored key (what the step returns)
    stays the one the init made. ``nnx.Dropout`` reads it :func:`unfolded`."""

    batch_axes: tuple[AxisName, ...]

    def read(self, key):
        return key if STEP.get().keys_as_stored else fold_rng_over_axis(key, self.batch_axes)


def read_once(variable: nnx.Variable, block) -> Any:
    """``block`` read through ``variable``'s plan, gathered once per trace: a second read of the
    same block in the same trace (``jax.extend.core.get_opaque_trace_state``, what NNX checks
    Variables with) hands back the first read's value. Two gathers of one parameter would
    reduce-scatter its gradient twice (the sum of the two halves, each its own collective:
    14 reduce-scatters for 13 parameters with tied logits). A read inside another trace (a
    remat, a scan, a ``jax.checkpoint`` around part of a module) gathers there, as FSDP must."""
    plan = variable.get_metadata(_PLAN)
    if not isinstance(plan, ReadPlan):  # an rng key: folding it is cheap and moves nothing
        return plan.read(block)
    trace = jax.extend.core.get_opaque_trace_state(convention="nnx")
    try:
        cached_block, cached_plan, cached_trace, value = object.__getattribute__(variable, _GATHERED)
        if cached_block is block and cached_plan is plan and cached_trace == trace:
            return value
    except AttributeError:  # never read yet (the slot is empty)
        pass
    value = plan.read(block)
    object.__setattr__(variable, _GATHERED, (block, plan, trace, value))
    return value


@functools.cache
def read_type(variable_type: type[nnx.Variable]) -> type[nnx.Variable]:
    """The subclass of ``variable_type`` whose ``get_value`` gathers (one per type, so graphs
    that hold it compare equal from step to step). Its one slot holds the last gather
    (:func:`read_once`): it lives as long as the Variable the step's ``merge`` made."""

    def get_value(self, **kwargs):
        index = kwargs.pop("index", None)
        value = read_once(self, variable_type.get_value(self, **kwargs))
        return value if index is None or index is Ellipsis else value[index]

    namespace = {"get_value": get_value, "__module__": __name__, "__slots__": (_GATHERED,)}
    return type(variable_type.__name__, (variable_type,), namespace)


def on_read(variable: nnx.Variable, block, plan: ReadPlan | FoldPlan) -> nnx.Variable:
    """A Variable like ``variable`` (its type and metadata) holding ``block``, read through ``plan``."""
    return read_type(type(variable)).from_metadata(block, {**variable.get_metadata(), _PLAN: plan})

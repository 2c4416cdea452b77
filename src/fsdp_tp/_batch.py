"""Which mesh axes the batch is split over: told once by the step, asked by everything that
averages over the batch (a transform's gathers, the gradient sync, dropout masks).

:func:`~fsdp_tp.shard_step` knows the batch's ``PartitionSpec``; a model transform and
:func:`~fsdp_tp.sync_gradients` are told axis names by the user. When the two disagree the
gradients are averaged over other devices than the batch was split over, and the run trains
another model without a word (a transform told ``batch_axes=("data",)`` on a batch split over
``data x fsdp`` slices the fsdp gradient where it must average it). So the step says what its
batch spec splits (:func:`batch_split_over`, while it traces), a transform left without
``batch_axes`` takes that, and one given names is checked against it
(:func:`resolve_batch_axes`), as the sync is (:func:`require_step_batch`).

>>> from jax.sharding import PartitionSpec as P
>>> batch_axes_of({"ids": P(("data", "fsdp")), "mask": P(("data", "fsdp"), None)})
('data', 'fsdp')
>>> batch_axes_of(P()) is None   # a replicated batch splits over nothing
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax.sharding import PartitionSpec

from ._axes import as_axis_tuple, bound_axis_names, entry_axes
from ._context import STEP
from ._types import AxisName, Specs
from .errors import BatchAxesError, UnboundAxisNameError

__all__ = [
    "DEFAULT_BATCH_AXES",
    "batch_axes_of",
    "batch_split_over",
    "checked_batch_axes",
    "require_step_batch",
    "resolve_batch_axes",
    "step_batch_axes",
]

DEFAULT_BATCH_AXES = ("data", "fsdp")
"""The axes a transform averages over when neither it nor a step says: those the mesh has."""


def batch_axes_of(batch_specs: Specs) -> tuple[AxisName, ...] | None:
    """The axes dim 0 of the batch is split over, in mesh order of the spec (major first), when
    every split leaf of ``batch_specs`` agrees; ``None`` when nothing is split or they differ."""
    specs = jax.tree.leaves(batch_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    splits = {entry_axes(spec[0]) for spec in specs if isinstance(spec, PartitionSpec) and len(spec)}
    splits.discard(())
    return splits.pop() if len(splits) == 1 else None


@contextlib.contextmanager
def batch_split_over(axes: tuple[AxisName, ...] | None) -> Iterator[None]:
    """Within (the step's trace): the batch is split over ``axes`` (``None``: not known)."""
    with STEP.scoped(batch_axes=axes):
        yield


def step_batch_axes() -> tuple[AxisName, ...] | None:
    """The axes the enclosing step's batch is split over, or ``None`` outside a step."""
    return STEP.get().batch_axes


def checked_batch_axes(batch_axes, caller: str) -> tuple[AxisName, ...] | None:
    """``batch_axes`` as a tuple of names (``None`` stays ``None``: the step's, or the
    defaults the mesh has), or a :class:`~fsdp_tp.errors.BatchAxesError` naming what was passed."""
    if batch_axes is None:
        return None
    names = as_axis_tuple(batch_axes)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise BatchAxesError(
            f"{caller}: batch_axes must name the mesh axes the batch is split over, e.g. "
            f"('data', 'fsdp'), or be left out (the step's); got {batch_axes!r}."
        )
    return names


def _sized(axes) -> set:
    """The axes of ``axes`` with more than one device: a size-1 axis splits nothing."""
    return {a for a in axes if jax.lax.axis_size(a) > 1}


def resolve_batch_axes(batch_axes: tuple[AxisName, ...] | None, caller: str) -> tuple[AxisName, ...]:
    """Inside ``jax.shard_map``: the axes a transform averages over. Left out: the step's batch
    axes, else those of :data:`DEFAULT_BATCH_AXES` the mesh has. Given: each must be a bound
    axis, and the set (axes of size 1 aside) must be the step's."""
    bound = bound_axis_names()
    step = step_batch_axes()
    if batch_axes is None:
        return step if step is not None else tuple(a for a in DEFAULT_BATCH_AXES if a in bound)
    if not bound:  # outside jax.shard_map (an abstract init): nothing is gathered or averaged
        return batch_axes
    if missing := [a for a in batch_axes if a not in bound]:
        raise UnboundAxisNameError(
            f"{caller}: batch_axes={batch_axes!r} names {missing[0]!r}, which is no axis of the mesh "
            f"this runs on ({list(bound)}); name the axes the batch is split over, or leave "
            f"batch_axes out to take the step's."
        )
    require_step_batch(batch_axes, caller, "batch_axes")
    return batch_axes


def require_step_batch(axes: tuple[AxisName, ...], caller: str, what: str) -> None:
    """Inside a step: ``axes`` (axes of size 1 aside) are the ones its batch is split over."""
    step = step_batch_axes()
    if step is None or _sized(axes) == _sized(step):
        return
    sizes = {a: jax.lax.axis_size(a) for a in dict.fromkeys((*step, *axes)) if a in bound_axis_names()}
    raise BatchAxesError(
        f"{caller}: {what}={axes!r}, but shard_step's batch_specs split the batch over {step!r} "
        f"(axis sizes {sizes}); gradients averaged over other axes than the batch is split over "
        f"train another model. Pass {what}={step!r}, or split the batch over {axes!r}."
    )

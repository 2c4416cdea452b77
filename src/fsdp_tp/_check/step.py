"""The whole step read against the same step on the whole batch: :func:`check_step`.

The model's call is checked where it is made (:mod:`fsdp_tp._check.driver`), but the numbers
are made by the whole step: the loss, the target shift, the reductions and the sync are the
user's code too, and each device runs it on its block of the batch. Code that is right on the
whole batch can be silently wrong there: ``jnp.roll(tokens, -1, axis=1)`` or
``logits[:, :-1]`` against ``tokens[:, 1:]`` pairs tokens across a device's chunks of a split
sequence; ``sum(ce * w) / sum(w)`` a device, then ``pmean``, weights each device's tokens by its
own count (under ``data`` alone too, whenever the rows' weights differ); a ``pmean`` over fewer
axes than the batch is split over returns a share of the sum.

So :func:`~fsdp_tp.shard_step` traces its step once more as each device runs it and once on the
whole batch (each leaf's dims times the sizes of the axes its spec splits them over), abstractly,
and :class:`~fsdp_tp._check.blocks.Blocks` reads one against the other with the rule it applies
to a model under tensor roles: an operation that computes across a dim the batch split must
not cross a device's block, but for a sum, whose partial result may pass only linear operations
until a ``psum`` over every share completes it. A refusal names the operation, its line and the
fix; an operation the check does not know is left to :func:`fsdp_tp.testing.check_sharded`
(no warning: the step's code is checked where it can be, not proved).

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> whole_shapes({"x": jnp.ones((2, 4, 3))}, {"x": P("data", "context")}, {"data": 2, "context": 4})
{'x': ShapeDtypeStruct(shape=(4, 16, 3), dtype=float32)}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._axes import entry_axes, varying_axes
from .._trace.graph import Graph
from .._types import PyTree, Specs
from .blocks import Blocks
from .driver import checking, own_trace

__all__ = ["check_step", "whole_shapes"]

_is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)


def whole_shapes(batch: PyTree, batch_specs: Specs, sizes: Mapping[str, int]) -> PyTree:
    """The whole batch's leaves, abstractly: each dim of a device's block times the sizes of
    the axes its spec splits it over."""

    def leaf(spec, x):
        entries = tuple(spec) + (None,) * (x.ndim - len(spec))
        shape = tuple(
            n * math.prod(sizes.get(str(a), 1) for a in entry_axes(e))
            for n, e in zip(x.shape, entries, strict=False)
        )
        return jax.ShapeDtypeStruct(shape, x.dtype)

    each = lambda spec, sub: jax.tree.map(lambda x: leaf(spec, x), sub)
    return jax.tree.map(each, batch_specs, batch, is_leaf=_is_spec)


def check_step(
    run: Callable[[PyTree, PyTree], Any],
    state: PyTree,
    batch: PyTree,
    batch_specs: Specs,
    sizes: Mapping[str, int],
    where: str,
    sequence: str | None = None,
) -> None:
    """Refuses (``RuleError``) a step ``run(state, batch)`` whose per-device trace (on this
    device's ``batch``) does not compute blocks of its trace on the whole batch, or returns
    a device's share of a sum. ``sizes``: the axes the batch is split over (their sizes, each
    > 1); ``sequence``: the axis that splits the sequence, if one does (its refusals say how
    to shift targets with the batch). Inside the step's per-device trace, its axes bound."""
    if not checking() or not sizes:
        return
    whole = whole_shapes(batch, batch_specs, sizes)
    varying = [varying_axes(x) for x in jax.tree.leaves(batch)]

    def on_whole(state, whole_batch):  # (typed varying as the device's batch is: the same collectives)
        leaves, tree = jax.tree.flatten(whole_batch)
        return run(state, jax.tree.unflatten(tree, map(_like, leaves, varying)))

    with own_trace():  # (no check inside the check's traces; attention on each side's tokens)
        local = Graph.trace(run, state, batch)
        try:
            reference = Graph.trace(on_whole, state, whole)
        except Exception:  # (a step sized from its device's block, which the model's check read)
            return
    named = lambda stack: ("", "the batch split")
    split_outputs = tuple(range(max((len(s.shape) for s in jax.tree.leaves(whole)), default=0)))
    Blocks(local, reference, sizes, where, named, sequence=sequence, step=True).run(split_outputs)


def _like(x: jax.Array, axes) -> jax.Array:
    """``x`` typed varying over ``axes`` (a retype: the same numbers)."""
    missing = tuple(sorted((a for a in axes if a not in varying_axes(x)), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

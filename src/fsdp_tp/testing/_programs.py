"""The programs :func:`~fsdp_tp.testing.check_equal` compiles: both sides' inits in one
(:func:`inits`), then a train step a side (:func:`sharded_step`, :func:`twin_run`), each
reading the outputs off its loss's own forward (:func:`loss_and_outputs`).

Compiling is most of a check's time (a 2-layer ViT's four programs: about 10 of its 15 s on
two CPU cores), so each program holds only what a comparison reads: one forward a step, and
the two inits together, where XLA computes what they share (the key each parameter's draw
folds from, and the draws themselves where the sharded init computes a parameter in full)
once. The values are the ones each program computes alone, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._sequence_split import SequenceSplit
from .._tree import named_shardings
from ..gradients import batch_mean, sync_gradients
from ..partitioning import specs_of
from ..sharded_init import init_programs  # (init_sharded's, without running them)
from ..train import TrainState, shard_step

__all__ = ["Comparison", "inits", "loss_and_outputs", "sharded_step", "train_state", "twin_run"]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A sharded ``model`` (per device) and its unsharded ``twin`` on ``mesh``, the batch split
    over ``batch_axes``. ``loss(model, params, x, y)``: a batch's mean loss (per device, its
    rows); ``twin_loss`` the twin's (default: the same); ``twin_reads(params)``: what the twin
    computes on (a mixed-precision run's rounded parameters); ``output_spec``: the sharded
    output's layout (default: split like the batch); ``reduction``: how the devices' losses
    make one, as a failure on the loss says. ``sequence``: the sequence (dim 1 of every
    leaf of the batch and outputs past a vector) split over its axis as well, which is then a
    batch axis of the step (:attr:`step_axes`)."""

    model: Any
    twin: Any
    mesh: Mesh
    batch_axes: tuple
    loss: Callable
    twin_loss: Callable | None = None
    twin_reads: Callable = lambda params: params
    output_spec: P | None = None
    check_vma: bool = True
    sequence: SequenceSplit | None = None
    reduction: str = "the devices' losses averaged (pmean)"  # (how the loss is made one value, named)

    @property
    def step_axes(self) -> tuple:
        """The axes the gradients and the loss average over: the rows', and the sequence's."""
        return (*self.batch_axes, self.sequence.axis) if self.sequence is not None else self.batch_axes

    def spec_of(self, leaf) -> P:
        """The layout of one leaf of the batch or the outputs: a scalar replicated, rows split
        over the batch axes, the sequence (dim 1) over the sequence's axis."""
        if not jnp.ndim(leaf):
            return P()
        return (
            P(self.batch_axes, self.sequence.axis)
            if self.sequence and jnp.ndim(leaf) > 1
            else P(self.batch_axes)
        )

    def specs_of(self, tree) -> Any:
        return jax.tree.map(self.spec_of, tree)


def inits(c: Comparison, rng, x) -> tuple[Any, Any]:
    """The sharded model's parameters (boxed, laid out as :func:`~fsdp_tp.init_sharded` lays
    them) and the twin's (unboxed, on one device, as ``jax.jit(c.twin.init)`` gives them),
    from one compiled program."""
    init_fn, specs = (lambda r, x: c.model.init(r, x)["params"]), (P(), P(c.batch_axes))
    traced, programs = init_programs(init_fn, c.mesh, specs, (rng, x), None, False, c.check_vma)
    both = lambda r, x: (c.twin.init(r, x)["params"], [leaf for run in programs for leaf in run(r, x)])
    twin, leaves = jax.jit(both)(rng, x)
    # (a model's own boxes, nn.with_logical_partitioning's, are metadata: its parameters are their values)
    # The twin's step runs on one device, as jax.jit(c.twin.init)'s output would have it: fresh
    # arrays (the program's outputs carry its mesh, which every later step would compile anew for).
    twin = jax.tree.map(lambda leaf: jnp.asarray(np.asarray(leaf)), meta.unbox(twin))
    return jax.tree.unflatten(traced.treedef, leaves), twin


def train_state(c: Comparison, tx, params, rng) -> tuple[TrainState, Any]:
    """A train state for ``tx`` on the sharded ``params``, and its specs: ``TrainState.create``
    under ``jax.jit`` on global arrays into the specs' shardings, as ``init_sharded`` builds an
    optimizer state (so the step compiles once, not again for an eager state's Python step).
    On ``params``' shapes (``abstract_init``'s), the state's shapes: nothing runs."""
    create = lambda p: TrainState.create(apply_fn=c.model.apply, params=p, tx=tx, rng=rng)
    specs = specs_of(jax.eval_shape(create, params), c.mesh)
    program = jax.jit(create, out_shardings=named_shardings(specs, c.mesh))
    shapes = all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params))
    return (jax.eval_shape(program, params) if shapes else program(params)), specs


def sharded_step(
    c: Comparison, specs, sync: Callable = sync_gradients, donate: bool = False, reads=None, batch_specs=None
):
    """The train step of ``c`` on a state laid out by ``specs`` (:func:`~fsdp_tp.shard_step`),
    with the mean loss as its metric; given ``reads`` (the output's specs), ``(outputs, loss,
    synced gradients)`` on the step's batch, at the parameters before its update.
    ``batch_specs``: the batch's (default: its rows split over the batch axes)."""
    axes = c.step_axes

    def step_fn(state, data):
        x, y = data
        (loss, out), grads = loss_and_outputs(c.model, c.loss, state.params, x, y)
        grads, loss = sync(grads, axes), jax.lax.pmean(loss, axes)
        if reads is None:
            return grads, loss
        # A scalar output (a loss term the model returns, a router's balance) is read as a loss
        # is: the devices' mean.
        out = jax.tree.map(lambda o: batch_mean(o, axes) if jnp.ndim(o) == 0 else o, out)
        return grads, (out, loss, grads)

    metrics = P() if reads is None else (reads, P(), specs.params)
    return shard_step(
        step_fn,
        c.mesh,
        specs,
        batch_specs if batch_specs is not None else (P(c.batch_axes), P(c.batch_axes)),
        metrics_specs=metrics,
        check_vma=c.check_vma,
        donate_state=donate,
        sequence=c.sequence,
    )


def twin_run(c: Comparison, tx, params, data, reads: bool = False):
    """The twin's parameters after a step per batch, its optimizer state after each step, and,
    with ``reads``, ``(outputs, loss, gradients)`` on the first batch at ``params`` (read off the
    first step, as :func:`sharded_step` reads the sharded model's)."""
    twin_loss = c.twin_loss or c.loss

    @jax.jit
    def step(params, opt_state, x, y):
        (loss, out), grads = loss_and_outputs(c.twin, twin_loss, params, x, y, c.twin_reads)
        updates, opt_state = tx.update(grads, opt_state, params)
        read = (out, loss, grads) if reads else None
        return optax.apply_updates(params, updates), opt_state, read

    opt_state, first, states = tx.init(params), None, []
    for x, y in data:
        params, opt_state, read = step(params, opt_state, x, y)
        first = first or read
        states.append(opt_state)
    return params, states, first


def loss_and_outputs(model, loss: Callable, params, x, y, reads: Callable = lambda params: params):
    """``((loss, outputs), gradients)`` of ``loss(model, reads(params), x, y)``: the outputs
    are ``model.apply({"params": reads(params)}, x)``, read off the loss's own forward where the
    loss makes that call (one forward a step program, not a second for the outputs: the twin's
    step of a 2-layer ViT compiles in 2.26 s instead of 2.57), else computed on their own."""
    calls: list = []

    def recorded(p):
        read = reads(p)
        value = loss(_Recorded(model, read, x, calls), read, x, y)
        return value, (calls[0] if len(calls) == 1 else None)

    (value, out), grads = jax.value_and_grad(recorded, has_aux=True)(params)
    if out is None:  # (the loss calls apply otherwise, or more than once)
        out = model.apply({"params": reads(params)}, x)
    return (value, out), grads


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """``model``, keeping what its ``apply`` returns when called at exactly ``params`` on the
    step's batch ``x`` (the same objects, traced: so the kept value is the outputs the check
    reads, whatever else the loss computes)."""

    model: Any
    params: Any
    x: Any
    calls: list

    def apply(self, variables, *args, **kwargs):
        out = self.model.apply(variables, *args, **kwargs)
        exact = variables.get("params") is self.params and len(args) == 1 and args[0] is self.x
        if exact and not kwargs:
            self.calls.append(out)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)

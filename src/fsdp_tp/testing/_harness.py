"""The equivalence a sharded model owes its unsharded twin (docs/design.md invariants 1-5), run
on batches: :func:`check_equal` over a :class:`Comparison`.

Both models are called as a Linen module is, ``init(rng, x) -> {"params": ...}`` and
``apply({"params": p}, x)``, per device for the sharded one (``fsdp_tp.testing.NNXSharded`` and
``NNXTwin`` give an NNX model that face). In order, each failing with the first leaf out of
tolerance named (:func:`~fsdp_tp.testing.assert_trees_close`):

1. the tree and the init, bit for bit (``init``);
2. outputs, loss and synced gradients on the first batch (``output``, ``loss``, ``grads``);
3. the parameters after a step per batch of each optimizer (``sgd params after 3 steps``), the
   update on global arrays as :func:`~fsdp_tp.shard_step` runs it.

This is the suite's own proof (``tests/equivalence.py`` calls it) and the user's
(:func:`~fsdp_tp.testing.check_sharded` builds the pair from a model and rules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core import meta
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._tree import named_shardings
from ..gradients import batch_mean, sync_gradients
from ..partitioning import specs_of
from ..sharded_init import init_sharded
from ..train import TrainState, shard_step
from ._compare import assert_trees_close

__all__ = ["OPTIMIZERS", "Comparison", "check_equal", "twin_steps"]

# Adam's update lr * g / (|g| + eps) turns on the sign of g where |g| ~ eps: a gradient that
# cancels to ~1e-7 then moves by a different lr-sized step in two runs whose g differ by
# rounding. eps = 1e-3 keeps the update a well-conditioned function of g, still Adam-like.
OPTIMIZERS: Mapping[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "adamw": lambda: optax.adamw(1e-2, eps=1e-3, weight_decay=1e-2),
}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A sharded ``model`` (per device) and its unsharded ``twin`` on ``mesh``, the batch split
    over ``batch_axes``. ``loss(model, params, x, y)``: a batch's mean loss (per device, its
    rows); ``twin_loss`` the twin's (default: the same); ``twin_reads(params)``: what the twin
    computes on (a mixed-precision run's rounded parameters); ``output_spec``: the sharded
    output's layout (default: split like the batch)."""

    model: Any
    twin: Any
    mesh: Mesh
    batch_axes: tuple
    loss: Callable
    twin_loss: Callable | None = None
    twin_reads: Callable = lambda params: params
    output_spec: P | None = None
    check_vma: bool = True


def check_equal(
    c: Comparison,
    data: Sequence[tuple[Any, Any]],
    rng: jax.Array,
    optimizers: Mapping[str, Callable[[], optax.GradientTransformation]] = OPTIMIZERS,
    sync: Callable = sync_gradients,
) -> None:
    """Raises ``AssertionError`` naming the first leaf where ``c.model`` is not ``c.twin``: init,
    then outputs, loss and gradients on ``data[0]``, then parameters after a step per batch of
    each of ``optimizers``. ``sync``: the gradient sync the sharded step uses."""
    x, y = data[0]
    # (a model's own boxes, nn.with_logical_partitioning's, are metadata: its parameters are their values)
    twin_params = meta.unbox(jax.jit(c.twin.init)(rng, x)["params"])
    batch = P(c.batch_axes)
    boxed, _ = init_sharded(
        lambda r, x: c.model.init(r, x)["params"], c.mesh, (P(), batch), rng, x, check_vma=c.check_vma
    )
    assert_trees_close(meta.unbox(boxed), twin_params, "init", exact=True)

    # The outputs, loss and synced gradients on data[0] are read off the first optimizer's first
    # step (the program shard_step runs, before its update), not from programs of their own: the
    # check compiles one program fewer on each side. With no optimizer, a step that moves nothing.
    rows = lambda out: jax.tree.map(lambda o: P() if not jnp.ndim(o) else batch, out)  # (a scalar: P())
    runs, batches = (dict(optimizers), data) if optimizers else ({"": optax.set_to_zero}, data[:1])
    for i, (name, make) in enumerate(runs.items()):
        tx = make()
        want, _, read = _twin_run(c, tx, twin_params, batches, reads=i == 0)
        state, state_specs = train_state(c, tx, boxed, rng)
        step = sharded_step(c, state_specs, sync, reads=read and (c.output_spec or rows(read[0])))
        for j, (x, y) in enumerate(batches):
            state, metrics = step(state, (x, y))
            if read and j == 0:
                for what, got, wanted in zip(("output", "loss", "grads"), metrics, read, strict=True):
                    assert_trees_close(meta.unbox(got), wanted, what)
        if optimizers:
            assert_trees_close(meta.unbox(state.params), want, f"{name} params after {len(data)} steps")


def train_state(c: Comparison, tx, params, rng) -> tuple[TrainState, Any]:
    """A train state for ``tx`` on the sharded ``params``, and its specs: ``TrainState.create``
    under ``jax.jit`` on global arrays into the specs' shardings, as ``init_sharded`` builds an
    optimizer state (so the step compiles once, not again for an eager state's Python step)."""
    create = lambda p: TrainState.create(apply_fn=c.model.apply, params=p, tx=tx, rng=rng)
    specs = specs_of(jax.eval_shape(create, params), c.mesh)
    return jax.jit(create, out_shardings=named_shardings(specs, c.mesh))(params), specs


def sharded_step(c: Comparison, specs, sync: Callable = sync_gradients, donate: bool = False, reads=None):
    """The train step of ``c`` on a state laid out by ``specs`` (:func:`~fsdp_tp.shard_step`),
    with the mean loss as its metric; given ``reads`` (the output's specs), ``(outputs, loss,
    synced gradients)`` on the step's batch, at the parameters before its update."""
    batch = P(c.batch_axes)

    def step_fn(state, data):
        x, y = data
        loss, grads = jax.value_and_grad(lambda p: c.loss(c.model, p, x, y))(state.params)
        grads, loss = sync(grads, c.batch_axes), jax.lax.pmean(loss, c.batch_axes)
        if reads is None:
            return grads, loss
        out = c.model.apply({"params": state.params}, x)
        # A scalar output (a loss term the model returns, a router's balance) is read as a loss
        # is: the devices' mean.
        out = jax.tree.map(lambda o: batch_mean(o, c.batch_axes) if jnp.ndim(o) == 0 else o, out)
        return grads, (out, loss, grads)

    metrics = P() if reads is None else (reads, P(), specs.params)
    return shard_step(
        step_fn,
        c.mesh,
        specs,
        (batch, batch),
        metrics_specs=metrics,
        check_vma=c.check_vma,
        donate_state=donate,
    )


def twin_steps(c: Comparison, tx, params, data) -> tuple[Any, Any]:
    """The twin's ``(params, optimizer state)`` after a step per batch."""
    params, opt_state, _ = _twin_run(c, tx, params, data)
    return params, opt_state


def _twin_run(c: Comparison, tx, params, data, reads: bool = False):
    """The twin's ``(params, optimizer state)`` after a step per batch, and, with ``reads``,
    ``(outputs, loss, gradients)`` on the first batch at ``params`` (read off the first step, as
    :func:`sharded_step` reads the sharded model's)."""
    twin_loss = c.twin_loss or c.loss

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: twin_loss(c.twin, c.twin_reads(p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        # (only a reading step returns what it read: the others' programs keep their outputs)
        read = (c.twin.apply({"params": c.twin_reads(params)}, x), loss, grads) if reads else None
        return optax.apply_updates(params, updates), opt_state, read

    opt_state, first = tx.init(params), None
    for x, y in data:
        params, opt_state, read = step(params, opt_state, x, y)
        first = first or read
    return params, opt_state, first

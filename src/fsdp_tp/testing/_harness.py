"""The equivalence a sharded model owes its unsharded twin (docs/design.md invariants 1-5), run
on batches: :func:`check_equal` over a :class:`Comparison`.

Both models are called as a Linen module is, ``init(rng, x) -> {"params": ...}`` and
``apply({"params": p}, x)``, per device for the sharded one (``fsdp_tp.testing.NNXSharded`` and
``NNXTwin`` give an NNX model that face). In order, each failing with the first leaf out of
tolerance named (:func:`~fsdp_tp.testing.assert_trees_close`):

1. the tree and the init, bit for bit (``init``);
2. outputs, loss and synced gradients on the first batch (``output``, ``loss``, ``grads``);
3. the parameters after a step per batch of the first optimizer (``sgd params after 3 steps``),
   and at each of those steps every other optimizer's update of the same gradients at the same
   parameters (``adamw update at step 2``): the update on global arrays as
   :func:`~fsdp_tp.shard_step` runs it, all the optimizers' in one compiled step a side.

This is the suite's own proof (``tests/equivalence.py`` calls it) and the user's
(:func:`~fsdp_tp.testing.check_sharded` builds the pair from a model and rules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

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

__all__ = ["OPTIMIZERS", "AlongsideState", "Comparison", "alongside", "check_equal", "twin_run"]

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
    then outputs, loss and gradients on ``data[0]``, then, at each step of a batch, every
    optimizer's update but the first's, and the parameters after the first's steps (all of
    ``optimizers`` in one program a side: :func:`alongside`). ``sync``: the gradient sync the
    sharded step uses."""
    x, y = data[0]
    # (a model's own boxes, nn.with_logical_partitioning's, are metadata: its parameters are their values)
    twin_params = meta.unbox(jax.jit(c.twin.init)(rng, x)["params"])
    batch = P(c.batch_axes)
    boxed, _ = init_sharded(
        lambda r, x: c.model.init(r, x)["params"], c.mesh, (P(), batch), rng, x, check_vma=c.check_vma
    )
    assert_trees_close(meta.unbox(boxed), twin_params, "init", exact=True)

    # One step program a side for every optimizer (the first's update applied, the others' kept
    # in the state: see alongside), and the outputs, loss and synced gradients on data[0] read
    # off its first step (the program shard_step runs, before its update), not from programs of
    # their own. With no optimizer, one step that moves nothing reads them.
    named = dict(optimizers) if optimizers else {"": optax.set_to_zero}
    batches = data if optimizers else data[:1]
    tx = alongside({name: make() for name, make in named.items()})
    want, states, read = twin_run(c, tx, twin_params, batches, reads=True)
    rows = lambda out: jax.tree.map(lambda o: P() if not jnp.ndim(o) else batch, out)  # (a scalar: P())
    state, state_specs = train_state(c, tx, boxed, rng)
    step = sharded_step(c, state_specs, sync, reads=c.output_spec or rows(read[0]))
    for j, ((x, y), twin_state) in enumerate(zip(batches, states, strict=True)):
        state, metrics = step(state, (x, y))
        if j == 0:
            for what, got, expected in zip(("output", "loss", "grads"), metrics, read, strict=True):
                assert_trees_close(meta.unbox(got), expected, what)
        for name, update in state.opt_state.updates.items():
            wanted = twin_state.updates[name]
            assert_trees_close(meta.unbox(update), wanted, f"{name} update at step {j + 1}")
    if optimizers:
        first = next(iter(named))
        assert_trees_close(meta.unbox(state.params), want, f"{first} params after {len(data)} steps")


class AlongsideState(NamedTuple):
    """:func:`alongside`'s state: each optimizer's own (``states``), and every one's update but
    the first's at the last step (``updates``), by name."""

    states: dict[str, Any]
    updates: dict[str, Any]


def alongside(txs: Mapping[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """The first of ``txs``, with every other one's update of the same gradients at the same
    parameters computed too and kept in the state (:class:`AlongsideState`): one program checks
    them all, each update its own assertion (not their sum, which could hide one behind
    another). The others' states follow the first one's parameters.

    >>> import jax.numpy as jnp, optax
    >>> tx = alongside({"sgd": optax.sgd(1.0), "double": optax.sgd(2.0)})
    >>> params = {"w": jnp.ones(2)}
    >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"], state.updates["double"]["w"]
    (Array([-1., -1.], dtype=float32), Array([-2., -2.], dtype=float32))
    """
    first, *others = txs

    def init(params):
        kept = {name: jax.tree.map(jnp.zeros_like, params) for name in others}
        return AlongsideState({name: tx.init(params) for name, tx in txs.items()}, kept)

    def update(grads, state, params=None):
        states, kept = dict(state.states), {}
        for name, tx in txs.items():
            kept[name], states[name] = tx.update(grads, states[name], params)
        return kept.pop(first), AlongsideState(states, kept)

    return optax.GradientTransformation(init, update)


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


def twin_run(c: Comparison, tx, params, data, reads: bool = False):
    """The twin's parameters after a step per batch, its optimizer state after each step, and,
    with ``reads``, ``(outputs, loss, gradients)`` on the first batch at ``params`` (read off the
    first step, as :func:`sharded_step` reads the sharded model's)."""
    twin_loss = c.twin_loss or c.loss

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: twin_loss(c.twin, c.twin_reads(p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        read = (c.twin.apply({"params": c.twin_reads(params)}, x), loss, grads) if reads else None
        return optax.apply_updates(params, updates), opt_state, read

    opt_state, first, states = tx.init(params), None, []
    for x, y in data:
        params, opt_state, read = step(params, opt_state, x, y)
        first = first or read
        states.append(opt_state)
    return params, states, first

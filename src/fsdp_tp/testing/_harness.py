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

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.core import meta

from ..gradients import sync_gradients
from ._compare import assert_trees_close
from ._programs import Comparison, inits, sharded_step, train_state, twin_run
from ._reference import Reference, TwinRun, fingerprint

__all__ = [
    "OPTIMIZERS",
    "AlongsideState",
    "Comparison",
    "alongside",
    "check_equal",
    "sharded_step",
    "train_state",
    "twin_run",
]

# Adam's update lr * g / (|g| + eps) turns on the sign of g where |g| ~ eps: a gradient that
# cancels to ~1e-7 then moves by a different lr-sized step in two runs whose g differ by
# rounding. eps = 1e-3 keeps the update a well-conditioned function of g, still Adam-like.
OPTIMIZERS: Mapping[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "adamw": lambda: optax.adamw(1e-2, eps=1e-3, weight_decay=1e-2),
}


def check_equal(
    c: Comparison,
    data: Sequence[tuple[Any, Any]],
    rng: jax.Array,
    optimizers: Mapping[str, Callable[[], optax.GradientTransformation]] = OPTIMIZERS,
    sync: Callable = sync_gradients,
    reference: Reference | None = None,
    key: Hashable = None,
) -> None:
    """Raises ``AssertionError`` naming the first leaf where ``c.model`` is not ``c.twin``: init,
    then outputs, loss and gradients on ``data[0]``, then, at each step of a batch, every
    optimizer's update but the first's, and the parameters after the first's steps (all of
    ``optimizers`` in one program a side: :func:`alongside`). ``sync``: the gradient sync the
    sharded step uses. ``reference``: the twin's run read from it where a check under the same
    ``key`` (what ``c.twin``, its loss and its reads are, which only the caller can name) on the
    same batches, rng and optimizers computed it (:class:`~fsdp_tp.testing.Reference`)."""
    x, y = data[0]
    boxed, twin_params = inits(c, rng, x)
    assert_trees_close(meta.unbox(boxed), twin_params, "init", exact=True)

    # One step program a side for every optimizer (the first's update applied, the others' kept
    # in the state: see alongside), and the outputs, loss and synced gradients on data[0] read
    # off its first step (the program shard_step runs, before its update), not from programs of
    # their own. With no optimizer, one step that moves nothing reads them.
    named = dict(optimizers) if optimizers else {"": optax.set_to_zero}
    batches = data if optimizers else data[:1]
    tx = alongside({name: make() for name, make in named.items()})
    compute = lambda: TwinRun(twin_params, *twin_run(c, tx, twin_params, batches, reads=True))
    if reference is None:
        twin = compute()
    else:
        if key is None:
            raise TypeError(
                "fsdp_tp.testing.check_equal: reference= needs key=, a hashable naming what the twin "
                "computes (its model, loss and reads: a check only shares runs of the same twin)."
            )
        twin = reference.run((key, fingerprint((batches, rng)), tuple(named.items())), twin_params, compute)
    want, states, read = twin.params, twin.states, twin.reads
    state, state_specs = train_state(c, tx, boxed, rng)
    reads = c.output_spec or c.specs_of(read[0])  # (a scalar: P())
    step = sharded_step(c, state_specs, sync, reads=reads, batch_specs=c.specs_of((x, y)))
    for j, ((x, y), twin_state) in enumerate(zip(batches, states, strict=True)):
        state, metrics = step(state, (x, y))
        if j == 0:
            labels = ("output", f"loss ({c.reduction})", "grads")
            for what, got, expected in zip(labels, metrics, read, strict=True):
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

"""The train step: the state, rngs per shard, microbatching (:func:`accumulate_gradients`,
defined in :mod:`fsdp_tp.train._microbatches`), and the jitted step.

The step is two halves in one ``jax.jit``: the forward and backward pass per device under
``jax.shard_map`` (the user's ``step_fn``, which returns synced gradients), then the
optimizer on global arrays (:mod:`fsdp_tp._optimizer` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
from flax import struct
from flax.training import train_state
from jax.sharding import Mesh, PartitionSpec

from .._aliases import aliases_of
from .._batch import batch_axes_of, batch_split_over
from .._check.plain import step_calls
from .._check.step import check_step
from .._context import STEP
from .._optimizer import checked_tx, per_device_step, refuse_on_shards
from .._sequence_split import SequenceSplit
from .._tree import named_shardings
from .._types import PyTree, Specs
from ..context._across import jax_attention_across
from ..partitioning import check_specs
from ..tp.pieces import shared_column_inputs
from ._microbatches import accumulate_gradients
from ._sequence_layout import LaidOut, step_split

__all__ = ["TrainState", "accumulate_gradients", "shard_step", "state_init_fn"]

__getattr__ = aliases_of(__name__)  # 0.1's fold_rng_over_axis here (fsdp_tp._aliases)

_REPLICATED = PartitionSpec()


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus an rng, replicated like the step counter,
    and ``model_state``: the model's collections other than ``params`` (``batch_stats``, say),
    a dict by collection name, updated by the step (:func:`shard_step`), never by the optimizer.

    >>> import jax, jax.numpy as jnp, optax
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.5),
    ...                           rng=jax.random.key(0))
    >>> state = state.apply_gradients(grads={"w": jnp.ones(3)})
    >>> int(state.step), state.params["w"].tolist()
    (1, [0.5, 0.5, 0.5])
    """

    rng: jax.Array
    model_state: PyTree = struct.field(default_factory=dict)

    def apply_gradients(self, *, grads, **kwargs):
        """``flax``'s update, refused where it would see one device's shards (inside
        :func:`shard_step`'s ``step_fn``, or under ``jax.shard_map`` with split parameters):
        there a transform that reduces over a leaf or across leaves is silently wrong."""
        refuse_on_shards(self.params)
        return super().apply_gradients(grads=grads, **kwargs)


def state_init_fn(model, tx) -> Callable[..., TrainState]:
    """``init_fn(rng, *inputs)``: a :class:`TrainState` of ``model``'s params (initialized on
    ``inputs``), its other collections as ``model_state``, the optimizer ``tx`` and ``rng``.
    Build one for the sharded model and one for its twin: they make the same state, which
    is what ``init_sharded`` needs.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> state = state_init_fn(nn.BatchNorm(use_running_average=False), optax.sgd(0.1))(
    ...     jax.random.key(0), jnp.ones((1, 2)))
    >>> state.params["scale"].shape, state.model_state["batch_stats"]["mean"].shape, int(state.step)
    ((2,), (2,), 0)
    """

    checked_tx(tx, "state_init_fn")

    def init_fn(rng, *inputs):
        variables = dict(model.init(rng, *inputs))
        params = variables.pop("params", {})
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=rng, model_state=variables)

    return init_fn


def _refuse_donated(state: PyTree) -> None:
    """A state this step already consumed (donated) is refused in one line: reading a
    donated multi-device array can kill the process on CPU instead of raising."""
    # Every step pays for this walk, so a leaf's path is found only once one is deleted. Under
    # an outer jit (a caller's guarded step) the leaves are tracers: nothing to check.
    deleted = lambda x: isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
    if not any(map(deleted, jax.tree.leaves(state))):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if deleted(leaf):
            raise ValueError(
                f"shard_step: the state passed was donated to an earlier call of this step (its "
                f"buffer{jax.tree_util.keystr(path)} is deleted); pass the state that call returned "
                f"(state, metrics = step(state, batch)), or build the step with donate_state=False "
                f"to keep the old state."
            )


@contextlib.contextmanager
def as_a_step(batch_specs: Specs, sequence: SequenceSplit | None = None, tokens=None) -> Iterator[None]:
    """Within, a per-device trace is a step's, as :func:`shard_step` traces one (and the plan
    its step): transforms, the sync and dropout average over (and draw for) the axes the batch
    of ``batch_specs`` is split over, or say that they were told others; layers that read one
    activation share its collective (Megatron's *f*, an expert layer's dispatch). Under a
    ``sequence`` split its axis is a batch axis too (each device's loss is over its tokens) and
    attention computes across it (:mod:`fsdp_tp.context._across`); ``tokens``: a device's tokens a
    sequence (:meth:`~fsdp_tp.train._sequence_layout.LaidOut.tokens`)."""
    axes = batch_axes_of(batch_specs)
    if sequence is not None:
        axes = (*(axes or ()), sequence.axis)
    with batch_split_over(axes), STEP.scoped(sequence=sequence, tokens=tokens), shared_column_inputs():
        with jax_attention_across(sequence):
            yield


def _split_sizes(batch_specs: Specs, sizes, split: SequenceSplit | None) -> dict:
    """The axes the batch is split over (rows, and the sequence under ``split``), with their
    sizes, those of one device left out: what the whole step is checked over."""
    axes = [*(batch_axes_of(batch_specs) or ()), *((split.axis,) if split is not None else ())]
    return {axis: sizes[axis] for axis in axes if sizes.get(axis, 1) > 1}


def shard_step(
    step_fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    mesh: Mesh,
    state_specs: PyTree,
    batch_specs: Specs,
    *,
    metrics_specs: Specs = _REPLICATED,
    check_vma: bool = True,
    donate_state: bool = True,
    sequence: SequenceSplit | None = None,
) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
    """Builds the jitted train step from a per-device ``step_fn(state, batch) -> (grads, metrics)``.

    ``step_fn`` runs under ``jax.shard_map``: it computes this device's loss and returns
    the gradients of ``state.params``, synced (:func:`~fsdp_tp.sync_gradients`), and the
    metrics, replicated (``pmean`` them over the batch axes) unless ``metrics_specs`` says
    otherwise. The step then applies ``state.tx`` to the gradients on *global* arrays, in
    the same ``jax.jit``, so every optax transform gives the unsharded update (global-norm
    clipping, LAMB, LARS, Adafactor included) and the state keeps ``state_specs``.
    ``state`` is a :class:`TrainState` (or any flax ``TrainState``). When it holds a
    ``model_state`` (``batch_stats``, say), ``step_fn`` returns ``(grads, metrics,
    model_state)``: the collections the model's ``apply(..., mutable=...)`` gave back, the
    same on every device (the model's ``BatchNorm(axis_name=batch_axes)`` makes them so,
    or :func:`~fsdp_tp.gradients.batch_mean`), laid out like the state's.

    A batch spec that splits a dim past the rows over ``context`` (``P("data", "context")``)
    splits the sequence (context parallelism): each such leaf is laid out as ``sequence`` (a
    :class:`~fsdp_tp.context.SequenceSplit`; default balanced, attention by the ring) says on
    the way in, and each output laid out as such a batch leaf is put back in the batch's
    order; inside, the axis is a batch axis (sync the gradients and average the loss over it
    too) and the library's attention computes over every device's keys. The model is checked
    against the whole sequence at its first call (:mod:`fsdp_tp._check.plain`): laid out
    by ``shard_by_rules``, or a plain Linen ``apply`` or ``nnx.merge``'s model; a step that
    calls it otherwise warns (``UncheckedPlanWarning``): prove it with
    :func:`fsdp_tp.testing.check_sharded` on that mesh.

    The whole step is checked too, under every batch split (:mod:`fsdp_tp._check.step`): traced
    as each device runs it and on the whole batch, at its first call; a shift of the tokens in
    the step (shift them with the batch: :func:`~fsdp_tp.context.next_token_targets`), a ratio of a
    device's sums before the ``pmean`` (:func:`~fsdp_tp.gradients.global_mean_loss`), a result
    averaged over fewer axes than the batch is split over, are refused at their line.

    The state is donated, so the caller must not reuse the state it passed. When JAX
    rejects the state or batch, they are checked against their specs, so a mismatched tree
    or an indivisible batch fails with a message naming the leaf.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import TrainState, init_sharded, make_mesh, sync_gradients
    >>> mesh = make_mesh({"data": 8})
    >>> def init_fn(rng):
    ...     return TrainState.create(apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(1.0), rng=rng)
    >>> def step_fn(state, x):
    ...     loss, grads = jax.value_and_grad(lambda p: ((p["w"] - x) ** 2).mean())(state.params)
    ...     return sync_gradients(grads, "data"), jax.lax.pmean(loss, "data")
    >>> state, specs = init_sharded(init_fn, mesh, P(), jax.random.key(0))
    >>> step = shard_step(step_fn, mesh, specs, P("data"))
    >>> state, loss = step(state, jnp.arange(8.0))   # w moves to 2 * mean(x) * lr = 7.0
    >>> float(loss), float(state.params["w"])
    (17.5, 7.0)
    """
    if not hasattr(state_specs, "params"):
        raise TypeError(
            f"shard_step: state_specs must be the specs of a train state (with .params), as "
            f"init_sharded returns them for a fsdp_tp.TrainState; got {type(state_specs).__name__}."
        )
    model_state = getattr(state_specs, "model_state", None) or {}
    updated = (model_state,) if jax.tree.leaves(model_state) else ()
    inner = per_device_step(step_fn, tuple(model_state) if updated else ())
    split = step_split(batch_specs, mesh.shape, sequence)
    laid = LaidOut(split, mesh.shape[split.axis], batch_specs) if split is not None else None

    split_sizes = _split_sizes(batch_specs, mesh.shape, split)

    def per_device_fn(state, batch):
        with as_a_step(batch_specs, split, laid.tokens(batch) if laid is not None else None):
            if split is None:
                out = inner(state, batch)
            else:
                with step_calls("shard_step"):  # (a plain apply checked against the whole sequence)
                    out = inner(state, batch)
            # (the model's own check ran in the call above; now the code around it)
            axis = split.axis if split is not None else None
            check_step(inner, state, batch, batch_specs, split_sizes, "shard_step", axis)
            return out

    per_device = jax.shard_map(
        per_device_fn,
        mesh=mesh,
        in_specs=(state_specs, batch_specs),
        out_specs=(state_specs.params, metrics_specs, *updated),
        check_vma=check_vma,
    )

    def update(state, batch):
        if laid is not None:  # (the user's order in and out; the chunks the ring expects inside)
            laid.require_per_token(batch)
            batch = laid.batch(batch)
        grads, metrics, *new_model_state = per_device(state, batch)
        if laid is not None:
            metrics = laid.outputs(metrics, metrics_specs)
        kwargs = {"model_state": new_model_state[0]} if new_model_state else {}
        return state.apply_gradients(grads=grads, **kwargs), metrics

    sharded = jax.jit(
        update,
        out_shardings=(named_shardings(state_specs, mesh), named_shardings(metrics_specs, mesh)),
        donate_argnums=(0,) if donate_state else (),
    )

    def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        if donate_state:
            _refuse_donated(state)
        try:
            return sharded(state, batch)
        except (ValueError, TypeError) as err:
            # A mismatched tree or an indivisible batch is rejected while tracing, before
            # anything runs or is donated: only then is it worth walking the trees to say
            # which leaf and which dim (no per-step cost on the happy path).
            if laid is not None:  # (a leaf laid out otherwise than the tokens: said before its sizes)
                laid.require_per_token(batch)
            check_specs(state, state_specs, mesh, "state")
            check_specs(batch, batch_specs, mesh, "batch")
            raise err

    step.lower = sharded.lower  # type: ignore[attr-defined]  # for HLO and memory analysis
    return step

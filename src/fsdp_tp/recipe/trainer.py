"""The train loop behind ``fsdp-tp train``: the state and the sharded step (``--check``'s
twin: :mod:`fsdp_tp.recipe.twin`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core.meta import unbox
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._sequence_split import SequenceSplit
from ..gradients import sync_gradients
from ..models import Layout
from ..sharded_init import init_sharded
from ..tp.pieces import vocab_parallel_cross_entropy
from ..train import accumulate_gradients, as_a_step, shard_step, state_init_fn
from ..train._sequence_layout import LaidOut
from .batches import batch_loss, split_windows
from .config import ModelConfig
from .data import Tokens, windows_at
from .moe_lm import moe_loss, sharded_moe_parts

__all__ = [
    "APIS",
    "BATCH_AXES",
    "OPTIMIZERS",
    "Settings",
    "ShardedGPT",
    "Trainer",
    "init_arguments",
    "sharded_gpt",
    "step_fn",
]

BATCH_AXES = ("data", "fsdp")
BATCH = P(BATCH_AXES)
APIS = ("linen", "nnx")  # --api: the Flax API the GPT is written in

# --optimizer: each takes the learning-rate schedule.
OPTIMIZERS: dict[str, Callable[[optax.Schedule], optax.GradientTransformation]] = {
    "adamw": lambda lr: optax.adamw(lr, weight_decay=0.01),
    "adafactor": lambda lr: optax.adafactor(lr),
    "lamb": lambda lr: optax.lamb(lr, weight_decay=0.01),
    "lion": lambda lr: optax.lion(lr, weight_decay=0.01),
    "sgd": lambda lr: optax.sgd(lr, momentum=0.9),
}


@dataclass(frozen=True)
class Settings:
    model: ModelConfig
    steps: int
    batch: int
    microbatches: int
    lr: float
    warmup: int
    seed: int
    layout: Layout  # on the data x fsdp x tensor mesh: FSDP over fsdp, TP over tensor
    check_vma: bool
    optimizer_name: str = "adamw"  # a key of OPTIMIZERS
    clip_norm: float = 1.0  # clip the gradient's global norm to this (0: no clipping)
    api: str = "linen"  # one of APIS: the GPT in Linen (the layout's layers) or NNX (by rules)
    sequence: SequenceSplit | None = None  # the sequence split over --mesh's context axis
    packed: int | None = None  # --packed: the token ending a document (None: a window is one)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's rows are split over: ``expert`` too for a mixture of
        experts (expert parallelism sends each device's tokens to the experts over it)."""
        return (*BATCH_AXES, "expert") if self.model.experts else BATCH_AXES

    @property
    def step_axes(self) -> tuple[str, ...]:
        """The axes the loss and gradients average over: the rows', and the sequence's."""
        return (*self.batch_axes, self.sequence.axis) if self.sequence is not None else self.batch_axes

    def batch_specs(self):
        """The step's batch: the windows' rows, or, under a sequence split, their inputs and
        targets (each ``(rows, seq_len)``) with the sequence over ``context`` (and the MoE LM's
        positions, for its RoPE); packed, those and the segment ids and loss weights
        (:func:`~fsdp_tp.recipe.data.packed`)."""
        if self.sequence is None and self.packed is None:
            return P(self.batch_axes)
        token = P(self.batch_axes, self.sequence.axis) if self.sequence is not None else P(self.batch_axes)
        windows = jax.ShapeDtypeStruct((1, self.model.seq_len + 1), jnp.int32)
        return jax.tree.map(lambda _: token, jax.eval_shape(lambda w: split_windows(self, w), windows))

    def optimizer(self) -> optax.GradientTransformation:
        """The optimizer on a warmup-cosine schedule, after global-norm clipping. Both run
        on global arrays (shard_step), so the norm is the whole gradient's."""
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, self.lr, max(self.warmup, 1), max(self.steps, self.warmup + 2)
        )
        tx = OPTIMIZERS[self.optimizer_name](schedule)
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), tx) if self.clip_norm else tx


@dataclass(frozen=True)
class ShardedGPT:
    """The GPT of one API on one mesh: ``init_fn(rng, ids)`` builds a device's state (for
    ``init_sharded``, specs ``(P(), BATCH)``), ``logits(params, ids[, segments])`` is a device's forward
    (logits split on the vocabulary over ``tensor``), ``twin_init_fn`` the unsharded state,
    ``objective(out, targets)`` the mean loss of what ``logits`` returns (the MoE LM's: its
    whole logits and auxiliary losses, :func:`~fsdp_tp.recipe.moe_lm.moe_loss`)."""

    init_fn: Callable
    logits: Callable
    twin_init_fn: Callable | None
    objective: Callable = lambda logits, targets: vocab_parallel_cross_entropy(logits, targets).mean()


def nnx_schedule(settings: Settings, sizes: dict) -> tuple[bool, str | None]:
    """An ``--api nnx`` run's sequence parallelism and rings: sequence parallelism needs
    check_vma (the roles refuse it unchecked); on one tensor device the sequence is whole
    anyway, so unchecked it is simply off there."""
    layout = settings.layout
    return layout.sequence_split and (settings.check_vma or sizes.get("tensor", 1) > 1), layout.ring


def sharded_gpt(settings: Settings, sizes: dict, tx: optax.GradientTransformation) -> ShardedGPT:
    """The GPT ``settings`` describe on a mesh of axis ``sizes``: Linen's split by its layout,
    or NNX's by rules (:mod:`fsdp_tp.recipe.nnx_gpt`), from the same init."""
    config = settings.model
    if config.experts:
        policy = settings.layout.mixed_precision
        parts = sharded_moe_parts(config, settings.api, sizes, settings.step_axes, tx, policy)
        return ShardedGPT(*parts, objective=moe_loss)
    if settings.api == "nnx":
        from .nnx_gpt import sharded_gpt as sharded_nnx_gpt

        layout, (sequence, ring) = settings.layout, nnx_schedule(settings, sizes)
        sharded = sharded_nnx_gpt(
            config, sizes, layout.min_weight_size, settings.step_axes, sequence, ring, layout.mixed_precision
        )
        init = sharded.state_init_fn(tx)
        logits = lambda p, ids, segments=None: sharded.merge(p)(ids, segments)
        return ShardedGPT(lambda rng, _ids: init(rng), logits, None)
    model = config.model(settings.layout)
    logits = lambda p, ids, segments=None: model.apply({"params": p}, ids, segments)
    return ShardedGPT(state_init_fn(model, tx), logits, state_init_fn(config.model(), tx))


def step_fn(settings: Settings, model: ShardedGPT) -> Callable:
    """The per-device step for ``shard_step``: this device's windows (or inputs and targets)
    -> synced gradients, loss."""
    axes = settings.step_axes

    def step(state, windows):
        # (packed: each microbatch's tokens over the whole batch's count, so that their mean is
        # the batch's token-weighted loss)
        count = windows[3].sum() / settings.microbatches if settings.packed is not None else None

        def loss_fn(params, microbatch, _rng):
            return batch_loss(model, params, microbatch, axes, count), None

        (loss, _), grads = accumulate_gradients(loss_fn, state.params, windows, settings.microbatches)
        return sync_gradients(grads, axes), jax.lax.pmean(loss, axes)

    return step


def _finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _guarded(step: Callable) -> Callable:
    """``step`` that keeps the state it was given when the loss or the updated parameters are
    not finite (a nan or inf gradient makes them so), and says whether it did.

    Returns ``(state, loss, finite)``. Selecting in the same program costs one pass over the
    state; it lets ``--nonfinite stop`` end the run on the last good state (nothing bad is
    checkpointed) and ``--nonfinite skip`` go on as if the batch had not been drawn.
    """

    def guarded(state, windows):
        new, loss = step(state, windows)
        finite = jnp.isfinite(loss) & _finite(unbox(new.params))
        kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        return kept, loss, finite

    return guarded


def _eval_fn(model: ShardedGPT, settings: Settings, laid: LaidOut | None) -> Callable:
    """The held-out loss on a device's batch, under a sequence split as the step computes it
    (attention across ``context``: :func:`~fsdp_tp.train.as_a_step`)."""
    axes, specs = settings.step_axes, settings.batch_specs()

    def evaluate(state, batch):
        if laid is None:  # (the windows whole on each device: no step's scope, as ever)
            return jax.lax.pmean(batch_loss(model, state.params, batch, axes), axes)
        with as_a_step(specs, settings.sequence, laid.tokens(batch)):
            return jax.lax.pmean(batch_loss(model, state.params, batch, axes), axes)

    return evaluate


def init_arguments(settings: Settings, mesh, model: ShardedGPT) -> tuple:
    """``init_sharded``'s arguments for the run's state: ``model``'s per-device init, the mesh,
    the specs of its arguments, the seed's key and example ids."""
    ids = np.zeros((settings.batch, settings.model.seq_len), np.int32)
    return model.init_fn, mesh, (P(), P(settings.batch_axes)), jax.random.key(settings.seed), ids


class Trainer:
    """The sharded model, its state (initialized straight into its shardings) and step."""

    def __init__(self, settings: Settings, mesh):
        self.settings, self.mesh = settings, mesh
        config = settings.model
        self.twin = config.model()  # the Linen twin: both APIs start from its init and equal it
        self.tx = settings.optimizer()
        self.model = sharded_gpt(settings, dict(mesh.shape), self.tx)
        batch = settings.batch_specs()
        self.state, self.specs = init_sharded(
            *init_arguments(settings, mesh, self.model),
            twin_init_fn=self.model.twin_init_fn,
            check_vma=settings.check_vma,
        )
        step = step_fn(settings, self.model)
        split = settings.sequence
        step = shard_step(step, mesh, self.specs, batch, check_vma=settings.check_vma, sequence=split)
        windowed = lambda state, windows: step(state, split_windows(settings, windows))
        self.step = jax.jit(_guarded(windowed), donate_argnums=0)
        laid = LaidOut(split, mesh.shape[split.axis], batch) if split is not None else None
        evaluate = jax.shard_map(
            _eval_fn(self.model, settings, laid),
            mesh=mesh,
            in_specs=(self.specs, batch),
            out_specs=P(),
            check_vma=settings.check_vma,
        )
        laid_out = (lambda b: laid.batch(b)) if laid is not None else (lambda b: b)
        self._eval = jax.jit(
            lambda state, windows: evaluate(state, laid_out(split_windows(settings, windows)))
        )
        self._batch_sharding = NamedSharding(mesh, P(settings.batch_axes))  # (the windows' rows)
        self.completed = 0  # steps the state has taken (run() counts them)

    def windows(self, tokens: Tokens, step: int) -> jax.Array:
        """Step ``step``'s global batch of windows, each process reading only the rows its
        devices hold (``jax.make_array_from_callback`` asks for one row block per device)."""
        s, seq_len = self.settings, self.settings.model.seq_len
        read: dict = {}  # devices that hold the same rows (the tensor axis) share one read

        def rows(index) -> np.ndarray:
            key = index[0].indices(s.batch)
            if key not in read:
                read[key] = windows_at(tokens, step, s.batch, seq_len, s.seed, index[0])
            return read[key]

        return jax.make_array_from_callback((s.batch, seq_len + 1), self._batch_sharding, rows)

    def run(self, tokens: Tokens, start: int, stop: int) -> Iterator[tuple[int, float, float, bool]]:
        """Trains steps ``start .. stop - 1``; yields ``(step, loss, seconds, finite)`` after
        each. A step whose loss or update is not finite leaves the state as it was.
        ``completed``: the steps the state has taken so far."""
        self.completed = start
        for step in range(start, stop):
            windows = self.windows(tokens, step)
            began = time.perf_counter()
            self.state, loss, finite = self.step(self.state, windows)
            loss = float(loss)  # waits for the step
            self.completed = step + 1
            yield step, loss, time.perf_counter() - began, bool(finite)

    def evaluate(self, tokens: Tokens, batches: int) -> float:
        """Mean loss over ``batches`` fixed batches of held-out ``tokens`` (the same ones each time)."""
        return float(
            np.mean([float(self._eval(self.state, self.windows(tokens, i))) for i in range(batches)])
        )

    def params(self) -> dict:
        """The parameters as full numpy arrays (gathered from the devices)."""
        return jax.tree.map(np.asarray, unbox(self.state.params))

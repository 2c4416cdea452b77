"""A downloaded checkpoint fine-tuned on a mesh: the decoder its ``config.json`` describes, laid
out by :mod:`fsdp_tp.hub.layout` (FSDP over ``fsdp``, and ``context`` where the sequence is
split; Megatron's plan over ``tensor``; a mixture's experts over ``expert``), its parameters read
straight into that layout (:func:`~fsdp_tp.hub.load.load`), and its step: next-token
cross-entropy, the mean over every token of the global batch, AdamW after warmup and clipping,
the update on the global parameters (:func:`~fsdp_tp.shard_step`).

The targets are the next tokens, cut with the batch on the host (a window of ``seq_len + 1``
tokens: the first ``seq_len`` in, the last ``seq_len`` out), so a sequence split over
``context`` gives each device its tokens' own targets, and each token its position. What
``fsdp-tp finetune`` runs (:mod:`fsdp_tp.cli.finetune`); :meth:`FineTune.twin` is its
``--check``: the same run on one device, unsharded.

>>> import numpy as np
>>> tune = FineTune("examples/hub_checkpoints/llama", {"fsdp": 4, "tensor": 2}, batch=4, seq_len=8)
>>> batch = tune.batch_at(np.arange(200) % 64, step=0)
>>> batch["tokens"].shape, batch["targets"].sharding.spec
((4, 8), P(('data', 'fsdp', 'expert'),))
>>> loss = tune.step(batch)
>>> bool(np.isfinite(loss))
True
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core.meta import unbox
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._types import PyTree
from ..gradients import sync_gradients
from ..linen.rule_transform import shard_by_rules as linen_shard_by_rules
from ..mesh import make_mesh
from ..nnx import shard_by_rules as nnx_shard_by_rules
from ..recipe.data import Tokens, windows_at
from ..sharded_init import abstract_init
from ..tp.pieces import vocab_parallel_cross_entropy
from ..train import TrainState, shard_step
from .config import DecoderConfig
from .decoder import Decoder, NNXDecoder
from .directory import Checkpoint
from .export import export
from .families import mapping
from .layout import fsdp_rules, tp_rules
from .load import load, train_state

__all__ = ["BATCH_AXES", "FineTune", "Schedule"]

BATCH_AXES = ("data", "fsdp", "expert")  # (the rows' axes; ``context`` splits each row)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The optimizer: AdamW at ``lr`` after ``warmup`` steps (cosine decay to 0 at ``steps``),
    the gradient's global norm clipped to ``clip_norm`` (0: not clipped)."""

    lr: float = 1e-5
    warmup: int = 0
    steps: int = 100
    clip_norm: float = 1.0
    weight_decay: float = 0.0

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0 if self.warmup else self.lr, self.lr, max(self.warmup, 1), max(self.steps, self.warmup + 2)
        )
        tx = optax.adamw(schedule, weight_decay=self.weight_decay)
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), tx) if self.clip_norm else tx


class FineTune:
    """The checkpoint in ``directory`` on a mesh of axis ``sizes`` (``data``, ``fsdp``,
    ``expert``, ``context``, ``tensor``; those left out are 1), ready to train on batches of
    ``batch`` windows of ``seq_len`` tokens. ``api``: the decoder's Flax API, ``"linen"`` or
    ``"nnx"``; ``dtype``: the parameters' (default the decoder's, float32; ``"float64"`` under
    ``jax.enable_x64`` for a proof); ``scan``: the blocks in one scan
    (:class:`~fsdp_tp.hub.config.DecoderConfig`'s); ``devices``: the mesh's (default: all)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        sizes: Mapping[str, int],
        *,
        batch: int,
        seq_len: int,
        api: str = "linen",
        schedule: Schedule = Schedule(),
        seed: int = 0,
        dtype=None,
        scan: bool = False,
        devices=None,
    ):
        self.directory, self.api, self.schedule, self.seed = directory, api, schedule, seed
        self.batch_size, self.seq_len = batch, seq_len
        self.checkpoint = Checkpoint(directory)
        config = dataclasses.replace(DecoderConfig.from_hub(self.checkpoint.config), scan=scan)
        self.config = config
        sizes = {**{"data": 1, "fsdp": 1, "expert": 1}, **sizes, "tensor": sizes.get("tensor", 1)}
        self.sizes = sizes
        self.mesh = make_mesh(sizes, devices=devices)
        split = "context" in sizes
        self.axes = (*BATCH_AXES, "context") if split else BATCH_AXES  # (what the loss averages over)
        self.spec = P(BATCH_AXES, "context") if split else P(BATCH_AXES)
        storage = fsdp_rules(config, ("fsdp", "context") if split else "fsdp")
        init, self._apply = _front_end(api, config, storage, tp_rules(config, sizes=sizes), self.axes)
        tx = schedule.optimizer()
        state_fn = lambda key, b: TrainState.create(apply_fn=None, params=init(key, b), tx=tx, rng=key)
        key = jax.random.key(seed)
        shapes, self.specs = abstract_init(state_fn, self.mesh, (P(), self.spec), key, self._example())
        if dtype is not None:  # (the parameters, and so the computation, in dtype: float64 for a proof)
            recast = lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=s.sharding)
            shapes = shapes.replace(params=jax.tree.map(recast, shapes.params))
        self.dtype = dtype
        self.rules, self.ignore = mapping(config)
        # (report: what this process read of the checkpoint)
        params, self.report = load(self.checkpoint, shapes.params, self.rules, self.ignore)
        self.state = train_state(shapes, params, self.mesh, jax.random.key(seed))
        step = shard_step(self._step_fn, self.mesh, self.specs, self.spec)
        self._step = jax.jit(step, donate_argnums=0)

    def _example(self) -> dict:
        shape = (self.batch_size, self.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("tokens", "positions", "targets")}

    def _step_fn(self, state, batch):
        def loss_fn(params):
            logits = self._apply(params, {"tokens": batch["tokens"], "positions": batch["positions"]})
            if self.config.tied:  # (the vocabulary-parallel embedding's logits come out whole)
                wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
                losses = optax.softmax_cross_entropy_with_integer_labels(wide, batch["targets"])
            else:  # (the column-parallel head's are split on the vocabulary over tensor)
                losses = vocab_parallel_cross_entropy(logits, batch["targets"])
            return losses.mean()  # (this device's: every device holds as many tokens)

        # (the per-device loss differentiated, then synced: a pmean inside loss_fn would be
        # synced twice, every gradient 1/N of the unsharded one, which AdamW all but hides)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return sync_gradients(grads, self.axes), jax.lax.pmean(loss, self.axes)

    def batch_at(self, tokens: Tokens, step: int) -> dict:
        """Step ``step``'s batch from ``tokens`` (windows drawn by the step's index, as ``fsdp-tp
        train`` draws them: a resumed run sees the same batches): each window's first
        ``seq_len`` tokens, their positions and next tokens, laid out over the mesh."""
        windows = windows_at(tokens, step, self.batch_size, self.seq_len, self.seed)
        windows = np.asarray(windows, np.int32)
        positions = np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), (len(windows), self.seq_len))
        host = {"tokens": windows[:, :-1], "positions": positions, "targets": windows[:, 1:]}
        sharding = NamedSharding(self.mesh, self.spec)
        put = lambda v: jax.make_array_from_callback(v.shape, sharding, lambda index: v[index])
        return {k: put(v) for k, v in host.items()}

    def step(self, batch: dict) -> float:
        """One step on ``batch``; its loss (the mean over the batch's tokens, before the update)."""
        self.state, loss = self._step(self.state, batch)
        return float(loss)

    def params(self) -> PyTree:
        """The parameters, gathered to host arrays."""
        return jax.tree.map(np.asarray, unbox(self.state.params))

    def export(self, directory: str | os.PathLike, dtype: str | None = None) -> None:
        """The model, as now trained, written as the checkpoint it came from (names, files,
        ``config.json``; each tensor in its stored dtype, or ``dtype``): ``transformers`` loads it."""
        params, like = self.state.params, self.checkpoint
        export(params, self.rules, like=like, directory=directory, ignore=self.ignore, dtype=dtype)

    def twin(self) -> FineTune:
        """The same fine-tune on one device, unsharded: ``--check``'s reference."""
        return FineTune(
            self.directory, {}, batch=self.batch_size, seq_len=self.seq_len, api=self.api,
            schedule=self.schedule, seed=self.seed, dtype=self.dtype, scan=self.config.scan,
            devices=jax.devices()[:1],
        )  # fmt: skip


def _front_end(api: str, config: DecoderConfig, storage: list, tp: list, axes: tuple):
    """``(init(key, batch), apply(params, batch))`` of the decoder in ``api``, laid out by rules."""
    if api == "linen":
        model = linen_shard_by_rules(Decoder, storage, batch_axes=axes, tp_rules=tp)(config)
        return (lambda key, b: model.init(key, b)["params"]), (lambda p, b: model.apply({"params": p}, b))
    if api == "nnx":
        make = functools.partial(NNXDecoder, config)
        sharded = nnx_shard_by_rules(make, storage, batch_axes=axes, tp_rules=tp)
        return (lambda key, b: sharded.init(key)[0]), (lambda p, b: sharded.merge(p)(b))
    raise ValueError(f"FineTune(api={api!r}): the decoder is written in 'linen' and 'nnx'; pass one of them.")

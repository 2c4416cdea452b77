"""What ``fsdp-tp train`` and ``fsdp-tp plan`` print: the summary, progress and the result."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from ..checkpoint import Checkpoints
from ..mesh import make_mesh
from ..plan import make_plan
from ..train import state_init_fn
from .trainer import BATCH, Settings, Trainer, compare_with_twin

__all__ = ["print_plan", "train"]

# (rtol, atol) of sharded vs unsharded: f32 over a whole transformer (DESIGN.md: 1e-4 for
# full blocks); bf16 compute: one bf16 ulp (2^-8) relative. Measured on the default run,
# 5 steps: f32 2.4e-6 loss / 1.2e-7 params; bf16 2.1e-4 loss / 1.8e-4 params.
CHECK_TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (4e-3, 4e-4)}


def _plan(settings: Settings, mesh):
    config = settings.model
    model = config.model(settings.layout)
    ids = jax.ShapeDtypeStruct((settings.batch, config.seq_len), np.int32)
    return make_plan(
        state_init_fn(model, settings.optimizer()),
        mesh,
        (P(), BATCH),
        jax.random.key(0),
        ids,
        check_vma=settings.check_vma,
    )


def print_plan(settings: Settings, sizes: dict, out: TextIO) -> None:
    """The plan on an abstract mesh of ``sizes``: no devices needed, any size."""
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    print(_plan(settings, mesh), file=out)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


class _Output:
    """Progress and logs, written by process 0 only (every process trains; one speaks)."""

    def __init__(self, out: TextIO, log_file: str | None):
        self.primary = jax.process_index() == 0
        self.out = out
        self.log = open(log_file, "a") if log_file and self.primary else None

    def say(self, text: str) -> None:
        if self.primary:
            print(text, file=self.out, flush=True)

    def record(self, **fields) -> None:
        if self.log:
            self.log.write(json.dumps(fields) + "\n")
            self.log.flush()

    def close(self) -> None:
        if self.log:
            self.log.close()


def _summary(settings: Settings, sizes: dict, mesh, preset: str) -> str:
    plan = _plan(settings, mesh)
    params = sum(math.prod(r.shape) for r in plan.rows)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return (
        f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} on {jax.device_count()} "
        f"{jax.default_backend()} devices{processes}; model {preset} ({settings.model.dtype} compute): "
        f"{params:,} params; per device: params {_mib(plan.param_bytes)}, "
        f"optimizer {_mib(plan.optimizer_bytes)} ({settings.optimizer_name}, "
        f"{f'clip {settings.clip_norm:g}' if settings.clip_norm else 'no clipping'})"
    )


def _check(trainer: Trainer, tokens: np.ndarray, steps: int, dtype: str, say) -> bool:
    """``--check``: ``steps`` steps sharded and unsharded; leaves the trainer at its initial state."""
    initial = jax.tree.map(jnp.copy, trainer.state)  # the step donates the state it is given
    loss_diff, param_diff, losses, twin_losses = compare_with_twin(trainer, tokens, steps)
    rtol, atol = CHECK_TOLERANCE[dtype]
    ok = np.allclose(losses, twin_losses, rtol=rtol, atol=atol) and param_diff <= atol + rtol
    say(
        f"check: {steps} steps sharded vs unsharded: largest loss difference {loss_diff:.3g}, "
        f"largest parameter difference {param_diff:.3g} -> {'ok' if ok else 'FAILED'}"
    )
    trainer.state = initial  # train from the same init as without --check
    return ok


def _meta(settings: Settings, tokens: np.ndarray) -> dict:
    """What a checkpoint records besides the arrays: the data position and what to check on resume."""
    return {
        "seed": settings.seed,
        "batch": settings.batch,
        "data_tokens": len(tokens),
        "model": asdict(settings.model),
    }


def _resume(trainer: Trainer, checkpoints: Checkpoints, say) -> int:
    """Loads the newest checkpoint into the trainer (resharding it onto this mesh); its step."""
    state, meta = checkpoints.restore(trainer.state)
    trainer.state = state
    if meta["seed"] != trainer.settings.seed or meta["batch"] != trainer.settings.batch:
        say(
            f"note: the checkpoint was written with --seed {meta['seed']} --batch {meta['batch']}; "
            f"batches from here differ from the run that wrote it."
        )
    say(f"resumed from {checkpoints.path(meta['step'])} at step {meta['step']}")
    return int(meta["step"])


def train(
    settings: Settings, sizes: dict, args, tokens: np.ndarray, eval_tokens: np.ndarray | None, out: TextIO
) -> int:
    """The ``train`` command after its options and data were checked; the process's exit status.
    ``eval_tokens``: the held-out part for ``--eval-every`` (``None``: no eval)."""
    mesh = make_mesh(sizes)
    output = _Output(out, None)
    output.say(_summary(settings, sizes, mesh, args.preset))
    trainer = Trainer(settings, mesh)
    if not args.checkpoint_dir:
        return _train(trainer, args, tokens, eval_tokens, output, out, None)
    with Checkpoints(args.checkpoint_dir, keep=args.keep, every=args.checkpoint_every) as checkpoints:
        return _train(trainer, args, tokens, eval_tokens, output, out, checkpoints)  # closing waits


def _train(
    trainer: Trainer, args, train_tokens, eval_tokens, output: _Output, out: TextIO, checkpoints
) -> int:
    settings = trainer.settings
    if args.check and not _check(trainer, train_tokens, args.check, settings.model.dtype, output.say):
        return 1
    start = 0
    if checkpoints and args.resume and checkpoints.latest() is not None:
        start = _resume(trainer, checkpoints, output.say)
    if start >= settings.steps:
        output.say(f"checkpoint step {start} already reached --steps {settings.steps}; pass more steps.")
        return 0
    output = _Output(out, args.log_file)  # nothing is written before the inputs are known good
    try:
        first, last, rate = _loop(trainer, train_tokens, eval_tokens, start, args, output, checkpoints)
    finally:
        output.close()
    saved = ""
    if checkpoints:
        checkpoints.wait()
        saved = f"; last checkpoint {checkpoints.path(checkpoints.latest() or 0)}"
    output.say(f"done: loss {first:.4f} -> {last:.4f}, {rate:,.0f} tokens/s{saved}")
    return 0


def _loop(trainer, tokens, eval_tokens, start: int, args, output: _Output, checkpoints) -> tuple:
    settings = trainer.settings
    steps, tokens_per_step = settings.steps, settings.batch * settings.model.seq_len
    meta = _meta(settings, tokens)
    first = last = float("nan")
    timed, counted = 0.0, 0
    for step, loss, seconds in trainer.run(tokens, start, steps):
        first = loss if step == start else first
        last = loss
        if step > start:  # the first step includes compilation
            timed, counted = timed + seconds, counted + 1
        rate = tokens_per_step * counted / timed if timed else 0.0
        output.record(step=step, loss=loss, tokens_per_s=rate)
        if checkpoints:
            checkpoints.save(step + 1, trainer.state, meta, force=step + 1 == steps)
        if step % args.log_every == 0 or step == steps - 1:
            eta = (steps - step - 1) * (timed / counted if counted else 0.0)
            bar = "#" * (20 * (step + 1) // steps)
            output.say(
                f"[{bar:<20}] step {step + 1}/{steps} loss {loss:.4f} {rate:,.0f} tokens/s eta {eta:.0f}s"
            )
        if eval_tokens is not None and ((step + 1) % args.eval_every == 0 or step == steps - 1):
            eval_loss = trainer.evaluate(eval_tokens, args.eval_batches)
            output.record(step=step, eval_loss=eval_loss)
            output.say(f"eval at step {step + 1}: held-out loss {eval_loss:.4f}")
    return first, last, tokens_per_step * counted / max(timed, 1e-9)

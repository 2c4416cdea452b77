"""What ``fsdp-tp train`` and ``fsdp-tp plan`` print: the summary, progress and the result."""

from __future__ import annotations

import math
import sys
from contextlib import ExitStack
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import resolved_implementation
from ..checkpoint import Checkpoints
from ..context import ring_or_all_to_all
from ..mesh import make_mesh
from ..recipe.data import Tokens
from ..recipe.throughput import peak_tflops
from ..recipe.trainer import Settings, Trainer
from ..recipe.twin import compare_with_twin
from .distributed import coordination_client
from .experts import experts_text
from .fit import check_fits, choose_remat, mib, plan_of
from .output import Output, model_name, run_header, what_achieved
from .resume import data_identity, data_name, precision_of, record, resume
from .stopping import AgreedStopping, Stopped, Stopping, stop_on_signals
from .workdir import clear, locked, resuming

__all__ = ["train"]

MAX_SKIPPED = 10  # --nonfinite skip: this many non-finite steps in a row end the run


class NonFiniteStepError(RuntimeError):
    """A step whose loss or update was not finite, under ``--nonfinite stop``."""


# (rtol, atol) of sharded vs unsharded over K steps of the whole transformer; why, and what
# the default run measures: docs/design.md, "The CLI's --check K tolerance".
CHECK_TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (4e-3, 4e-4)}


def _summary(settings: Settings, sizes: dict, plan, name: str) -> str:
    params = sum(math.prod(r.shape) for r in plan.rows)
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    name += " (NNX)" if settings.api == "nnx" else ""
    name += experts_text(settings.model)
    return (
        f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} on {jax.device_count()} "
        f"{jax.default_backend()} devices{processes}; model {name}, vocab {settings.model.vocab_size} "
        f"({settings.model.dtype} compute): {params:,} params; per device: params {mib(plan.param_bytes)}, "
        f"optimizer {mib(plan.optimizer_bytes)} ({settings.optimizer_name}, "
        f"{f'clip {settings.clip_norm:g}' if settings.clip_norm else 'no clipping'}), "
        f"activations {mib(plan.activation_bytes or 0)} (remat {settings.model.remat}, "
        f"{_attention_text(settings)} attention)"
        + _sequence_text(settings, sizes)
        + _precision_text(settings)
    )


def _sequence_text(settings: Settings, sizes: dict) -> str:
    """The sequence split, as the step lays it out: a device's tokens, the layout, the strategy."""
    split = settings.sequence
    if split is None:
        return ""
    size, config, tensor = sizes[split.axis], settings.model, sizes.get("tensor", 1)
    layout = "balanced: 2 chunks a device" if split.balanced else "contiguous"
    strategy = split.strategy
    if strategy == "auto":  # (the one it takes: the fewer bytes for a device's heads)
        strategy = (
            f"auto: {ring_or_all_to_all(config.num_heads // tensor, config.num_kv_heads // tensor, size)}"
        )
    return (
        f"; sequence over {split.axis}={size}: {config.seq_len // size} tokens a device "
        f"({layout}), attention across it by {strategy.replace('_', '-')}"
    )


def _attention_text(settings: Settings) -> str:
    config = settings.model
    return "einsum" if config.experts else resolved_implementation(config.attention, config.dtype)


def _precision_text(settings: Settings) -> str:
    if settings.layout.mixed_precision is None:
        return ""
    precision = precision_of(settings)
    return f"; FSDP gathers in {precision['gather']}, reduces in {precision['reduce']}"


def _check(trainer: Trainer, tokens: Tokens, steps: int, dtype: str, say) -> bool:
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


def train(
    settings: Settings, sizes: dict, args, tokens: Tokens, eval_tokens: Tokens | None, out: TextIO
) -> int:
    """The ``train`` command after its options and data were checked; the process's exit status.
    ``eval_tokens``: the held-out part for ``--eval-every`` (``None``: no eval)."""
    mesh = make_mesh(sizes)
    output = Output(out, None)
    if settings.model.remat == "auto":
        settings, plan = choose_remat(settings, mesh)
    else:
        plan = plan_of(settings, mesh)
    if getattr(args, "mesh_chosen", False):
        output.say(f"no --mesh given: chose {args.mesh}, every {jax.default_backend()} device on fsdp")
    output.say(_summary(settings, sizes, plan, model_name(args)))
    check_fits(plan)
    with ExitStack() as stack:
        checkpoints = None
        if args.checkpoint_dir:
            if jax.process_index() == 0:
                stack.enter_context(locked(args.checkpoint_dir))
                if args.overwrite and (gone := clear(args.checkpoint_dir)):
                    output.say(f"--overwrite: deleted checkpoints {gone} in {args.checkpoint_dir}")
            checkpoints = Checkpoints(args.checkpoint_dir, keep=args.keep, every=args.checkpoint_every)
            stack.enter_context(checkpoints)  # closing waits for the last save and verifies it
        trainer = Trainer(settings, mesh)
        meta = record(settings, data_identity(tokens, data_name(args)))
        code = _train(trainer, args, tokens, eval_tokens, output, out, checkpoints, meta)
    return code


def _train(
    trainer: Trainer, args, train_tokens, eval_tokens, output: Output, out: TextIO, checkpoints, meta: dict
) -> int:
    settings = trainer.settings
    if args.check and not _check(trainer, train_tokens, args.check, settings.model.dtype, output.say):
        return 1
    start = 0
    if checkpoints and resuming(args) and checkpoints.latest() is not None:
        start = resume(trainer, checkpoints, args, meta, output.say)
    if start >= settings.steps:
        output.say(f"checkpoint step {start} already reached --steps {settings.steps}; pass more steps.")
        return 0
    output = Output(out, args.log_file)  # nothing is written before the inputs are known good
    output.record(**run_header(settings, args, start))
    try:
        with stop_on_signals(coordination_client(), jax.process_index()) as stopping:
            first, last, rate = _loop(
                trainer, train_tokens, eval_tokens, start, args, output, checkpoints, meta, stopping
            )
    except NonFiniteStepError as err:
        output.record(event="stopped", reason=str(err))
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        return _stopped(stop, trainer, checkpoints, output)
    finally:
        output.close()
    saved = ""
    if checkpoints:
        checkpoints.wait()
        saved = f"; last checkpoint {checkpoints.path(checkpoints.latest() or 0)}"
    # A run of one step (or one left to a resume) timed nothing: that step compiled.
    speed = f", {rate:,.0f} tokens/s" if rate is not None else " (one step, which compiled: no tokens/s)"
    output.say(f"done: loss {first:.4f} -> {last:.4f}{speed}{saved}")
    return 0


def _stopped(stop: Stopped, trainer: Trainer, checkpoints, output: Output) -> int:
    """SIGINT / SIGTERM: one line with the step reached and what ``--resume`` continues from."""
    reached = f"after step {trainer.completed} of {trainer.settings.steps}"
    output.record(event="stopped", reason=f"{stop.cause} {reached}")
    kept = "no checkpoint (pass --checkpoint-dir to keep them)"
    if checkpoints:
        checkpoints.wait()  # a save under way is finished and verified, not lost
        newest = checkpoints.latest()
        kept = (
            f"last checkpoint {checkpoints.path(newest)}; --resume continues from it"
            if newest is not None
            else f"no checkpoint in {checkpoints.directory} yet"
        )
    print(f"fsdp-tp: stopped by {stop.cause} {reached}; {kept}.", file=sys.stderr)
    return stop.exit_code


def _nonfinite(step: int, loss: float, args, skipped_in_a_row: int, output: Output) -> None:
    """A step whose loss or update was not finite (its update was not applied): stop, or skip."""
    what = f"step {step + 1}: loss {loss} or its update is not finite"
    if args.nonfinite == "stop":
        raise NonFiniteStepError(
            f"{what}; stopped before saving it (the state is step {step}'s). Lower --lr, keep "
            f"--clip-norm on, or pass --nonfinite skip to skip such steps."
        )
    output.say(f"{what}; skipped it ({skipped_in_a_row} in a row)")
    if skipped_in_a_row >= MAX_SKIPPED:
        raise NonFiniteStepError(f"{MAX_SKIPPED} steps in a row were not finite (the last: {what}); stopped.")


def _peak(settings: Settings, args) -> float | None:
    """``--peak-tflops``, or the table's figure for this device and compute dtype."""
    return args.peak_tflops or peak_tflops(jax.devices()[0].device_kind, settings.model.dtype)


def _loop(
    trainer,
    tokens,
    eval_tokens,
    start: int,
    args,
    output: Output,
    checkpoints,
    meta: dict,
    stopping: Stopping | AgreedStopping,
) -> tuple:
    settings = trainer.settings
    steps, tokens_per_step = settings.steps, settings.batch * settings.model.seq_len
    peak = _peak(settings, args)
    first = last = float("nan")
    timed, counted, in_a_row = 0.0, 0, 0
    for step, loss, seconds, finite in trainer.run(tokens, start, steps):
        in_a_row = 0 if finite else in_a_row + 1
        if not finite:
            output.record(step=step + 1, loss=None, finite=False, seconds=seconds)
            _nonfinite(step, loss, args, in_a_row, output)
            continue
        first = loss if math.isnan(first) else first
        last = loss
        if step > start:  # the first step includes compilation
            timed, counted = timed + seconds, counted + 1
        rate = tokens_per_step * counted / timed if counted else None
        fields, achieved = what_achieved(settings, rate, peak)
        output.record(step=step + 1, loss=loss, seconds=seconds, tokens_per_s=rate, **fields)
        saved = False
        if checkpoints:
            checkpoints.check()  # a background save that failed ends the run now, not at the next save
            saved = checkpoints.save(step + 1, trainer.state, meta, force=step + 1 == steps)
        if step % args.log_every == 0 or step == steps - 1:
            checked = bool(args.check) and step == start  # --check compiled the step before
            output.progress(step, steps, loss, seconds, timed, counted, tokens_per_step, achieved, checked)
        if eval_tokens is not None and ((step + 1) % args.eval_every == 0 or step == steps - 1):
            eval_loss = trainer.evaluate(eval_tokens, args.eval_batches)
            output.record(step=step + 1, eval_loss=eval_loss)
            output.say(f"eval at step {step + 1}: held-out loss {eval_loss:.4f}")
        try:
            stopping.check(step + 1)  # SIGINT / SIGTERM: between two steps
        except Stopped:
            if checkpoints and not saved:  # the step it stops at is saved, between checkpoint steps too
                checkpoints.save(step + 1, trainer.state, meta, force=True)
            raise
    if math.isnan(first) and in_a_row:  # fewer than MAX_SKIPPED steps, every one skipped
        raise NonFiniteStepError(
            f"none of the {in_a_row} steps was finite (each was skipped under --nonfinite skip), so "
            f"nothing was trained; lower --lr (it is {args.lr}) or keep --clip-norm on."
        )
    return first, last, tokens_per_step * counted / timed if counted else None

"""What ``fsdp-tp train`` and ``fsdp-tp plan`` print: the summary, progress and the result."""

from __future__ import annotations

import json
import math
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from ..mesh import make_mesh
from ..plan import make_plan
from .data import load_tokens
from .trainer import BATCH, Settings, Trainer, _state_fn, compare_with_twin

__all__ = ["print_plan", "train"]

CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5  # f32, a whole transformer (DESIGN.md: 1e-4 for full blocks)


def _plan(settings: Settings, mesh):
    config = settings.model
    model = config.sharded(settings.sequence_parallel, settings.collective_matmul, settings.min_weight_size)
    ids = jax.ShapeDtypeStruct((settings.batch, config.seq_len), np.int32)
    return make_plan(
        _state_fn(model, settings.optimizer()),
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


def train(settings: Settings, sizes: dict, args, out: TextIO) -> int:
    tokens = load_tokens(args.data)
    mesh = make_mesh(sizes)
    config = settings.model
    plan = _plan(settings, mesh)
    plan_params = sum(math.prod(r.shape) for r in plan.rows)
    print(
        f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} on {jax.device_count()} "
        f"{jax.default_backend()} devices; model {args.preset}: {plan_params:,} params; "
        f"per device: params {_mib(plan.param_bytes)}, optimizer {_mib(plan.optimizer_bytes)}",
        file=out,
    )
    trainer = Trainer(settings, mesh)
    if args.check:
        initial = jax.tree.map(jnp.copy, trainer.state)  # the step donates the state it is given
        loss_diff, param_diff, losses, twin_losses = compare_with_twin(trainer, tokens, args.check)
        ok = (
            np.allclose(losses, twin_losses, rtol=CHECK_RTOL, atol=CHECK_ATOL)
            and param_diff <= CHECK_ATOL + CHECK_RTOL
        )
        print(
            f"check: {args.check} steps sharded vs unsharded: largest loss difference {loss_diff:.3g}, "
            f"largest parameter difference {param_diff:.3g} -> {'ok' if ok else 'FAILED'}",
            file=out,
        )
        if not ok:
            return 1
        trainer.state = initial  # train from the same init as without --check
    log = open(args.log_file, "a") if args.log_file else None
    tokens_per_step = settings.batch * config.seq_len
    first = last = None
    timed = 0.0
    try:
        for step, loss, seconds in trainer.run(tokens, 0, settings.steps):
            first = loss if first is None else first
            last = loss
            timed += seconds if step else 0.0  # step 0 includes compilation
            rate = tokens_per_step * step / timed if timed else 0.0
            if log:
                log.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": rate}) + "\n")
            if step % args.log_every == 0 or step == settings.steps - 1:
                eta = (settings.steps - step - 1) * (timed / step if step else 0.0)
                bar = "#" * (20 * (step + 1) // settings.steps)
                print(
                    f"[{bar:<20}] step {step + 1}/{settings.steps} loss {loss:.4f} "
                    f"{rate:,.0f} tokens/s eta {eta:.0f}s",
                    file=out,
                    flush=True,
                )
    finally:
        if log:
            log.close()
    rate = tokens_per_step * (settings.steps - 1) / max(timed, 1e-9)
    print(f"done: loss {first:.4f} -> {last:.4f}, {rate:,.0f} tokens/s", file=out)
    return 0

"""``fsdp-tp``: train the library's GPT-style model end to end, or print its sharding plan.

    fsdp-tp train                        # 8 simulated CPU devices, mesh 2x2x2, embedded data
    fsdp-tp train --check 3              # and first compare 3 steps with the unsharded twin
    fsdp-tp train --checkpoint-dir ckpt --resume   # save every 100 steps; continue the newest
    fsdp-tp plan --preset base --mesh data=8,fsdp=64,tensor=8
    fsdp-tp bench                        # every strategy vs the baselines -> docs/benchmarks.md

Bad input exits with status 2 and one line saying what to change.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import numpy as np

from ..errors import CheckpointMismatchError, IndivisibleShapeError, MeshShapeError
from ..mesh import parse_mesh
from ..models import Layout
from .config import PRESETS, preset
from .data import (
    EVAL_FRACTION,
    DataError,
    check_tokens,
    check_vocab,
    load_tokens,
    split_held_out,
    vocab_for,
)
from .distributed import DistributedError

__all__ = ["main"]

DEFAULT_MESH = "data=2,fsdp=2,tensor=2"
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


class UsageError(ValueError):
    """Options that cannot work together (batch not divisible, ...)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-tp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=False)
    train = sub.add_parser("train", help="train the model (the default command)")
    plan = sub.add_parser("plan", help="print what each device would hold, on any mesh")
    for p in (train, plan):
        p.add_argument("--mesh", default=DEFAULT_MESH, help=f"axis sizes, e.g. {DEFAULT_MESH}")
        p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
        p.add_argument("--d-model", type=int)
        p.add_argument("--layers", type=int, dest="num_layers")
        p.add_argument("--heads", type=int, dest="num_heads")
        p.add_argument("--kv-heads", type=int, dest="num_kv_heads")
        p.add_argument("--mlp-hidden", type=int)
        p.add_argument("--seq-len", type=int)
        p.add_argument("--vocab-size", type=int, help="default: 256 (bytes), or fitted to a token file")
        p.add_argument(
            "--dtype", choices=["f32", "bf16"], default="f32", help="compute dtype (params stay f32)"
        )
        p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
        p.add_argument("--min-weight-size", type=int, default=2**10, help="smaller params stay whole")
        p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument(
            "--scan-layers",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="nn.scan over the layers (one compiled block); --no-scan-layers unrolls them",
        )
        p.add_argument("--async-tp", choices=["off", "unidirectional", "bidirectional"], default="off")
        p.add_argument("--check-vma", action=argparse.BooleanOptionalAction, default=True)
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--microbatches", type=int, default=1)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=20)
    train.add_argument("--optimizer", choices=["adamw", "adafactor", "lamb", "lion", "sgd"], default="adamw")
    train.add_argument(
        "--clip-norm", type=float, default=1.0, help="clip the gradient's global norm to this (0: off)"
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", help="a UTF-8 text file (bytes as tokens), .npy or uint16 .bin tokens")
    train.add_argument("--log-file", help="append JSON lines of step, loss, tokens/s")
    train.add_argument("--log-every", type=int, default=25)
    train.add_argument(
        "--check", type=int, default=0, metavar="K", help="compare K steps with the twin first"
    )
    train.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (0: off)")
    train.add_argument("--eval-batches", type=int, default=4)
    train.add_argument("--checkpoint-dir", help="save sharded checkpoints here (orbax, async, atomic)")
    train.add_argument("--checkpoint-every", type=int, default=100)
    train.add_argument("--keep", type=int, default=3, help="how many checkpoints to keep")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument(
        "--cpu-devices", type=int, help="simulate this many CPU devices per process (default: the mesh's)"
    )
    bench = sub.add_parser("bench", help="measure every strategy against the baselines; write docs")
    bench.add_argument("--out", default="docs", help="where benchmarks.md and the plots go")
    bench.add_argument("--workloads", default="mlp,block,gpt")
    bench.add_argument("--blocks", type=int, default=3, help="interleaved timing blocks (median taken)")
    bench.add_argument("--steps", type=int, default=3, help="steps per timing block")
    bench.add_argument("--depths", default="2,8,32", help="GPT layers for the compile-time figure")
    bench.add_argument("--max-unrolled", type=int, default=32, help="deepest unrolled GPT to compile")
    bench.add_argument(
        "--build-depths", default="8,32", help="unrolled GPT depths whose whole build is timed vs plain flax"
    )
    bench.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    bench.add_argument("--readme", default="README.md", help="rewrite its headline table (if marked)")
    hosts = train.add_argument_group(
        "multi-process (also JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
    )
    hosts.add_argument("--coordinator", help="process 0's host:port")
    hosts.add_argument("--num-processes", type=int)
    hosts.add_argument("--process-id", type=int)
    hosts.add_argument(
        "--distributed", action="store_true", help="let JAX detect the cluster (SLURM, Open MPI)"
    )
    return parser


def _settings(args, mesh: dict, vocab_size: int | None = None):
    from .trainer import Settings

    overrides = {
        k: getattr(args, k)
        for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "seq_len")
    }
    config = preset(
        args.preset,
        **overrides,
        vocab_size=args.vocab_size or vocab_size,
        dtype=DTYPES[args.dtype],
        scan_layers=args.scan_layers,
    )
    shards = mesh.get("data", 1) * mesh.get("fsdp", 1)
    if args.batch % shards:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the batch shards data x fsdp = {shards}; "
            f"use a multiple of {shards}."
        )
    microbatches = getattr(args, "microbatches", 1)
    if (args.batch // shards) % microbatches:
        raise UsageError(
            f"--microbatches {microbatches} does not divide the per-device batch {args.batch // shards} "
            f"(--batch {args.batch} / {shards} shards); choose a divisor of it."
        )
    clip_norm = getattr(args, "clip_norm", 0.0)
    if not clip_norm >= 0:  # also refuses nan
        raise UsageError(f"--clip-norm {clip_norm} must be a norm >= 0 (0 turns clipping off).")
    return Settings(
        model=config,
        steps=getattr(args, "steps", 1),
        batch=args.batch,
        microbatches=microbatches,
        lr=getattr(args, "lr", 0.0),
        warmup=getattr(args, "warmup", 0),
        seed=getattr(args, "seed", 0),
        layout=Layout(
            tensor="tensor",
            fsdp="fsdp",
            sequence_parallel=args.sequence_parallel,
            collective_matmul=None if args.async_tp == "off" else args.async_tp,
            min_weight_size=args.min_weight_size,
        ),
        check_vma=args.check_vma,
        optimizer_name=getattr(args, "optimizer", "adamw"),
        clip_norm=clip_norm,
    )


def _mesh(text: str) -> dict:
    sizes = parse_mesh(text)
    unknown = set(sizes) - {"data", "fsdp", "tensor"}
    if unknown:
        raise MeshShapeError(f"--mesh {text!r}: unknown axes {sorted(unknown)}; use data, fsdp and tensor.")
    return {axis: sizes.get(axis, 1) for axis in ("data", "fsdp", "tensor")}


def _has_accelerator_plugin() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def _tokens(args, mesh: dict):
    """The train and held-out tokens (``None`` without ``--eval-every``) and the settings that
    fit them, checked before anything starts or is written."""
    tokens = load_tokens(args.data)
    top = int(np.max(tokens))  # the one pass over a (memory-mapped) token file
    # A token file's ids may exceed the bytes' 256: fit the vocabulary unless it was given.
    settings = _settings(args, mesh, None if tokens.dtype == np.uint8 else vocab_for(top))
    name = args.data or "the embedded corpus"
    check_vocab(top, settings.model.vocab_size, name)
    if not args.eval_every:
        check_tokens(tokens, settings.model.seq_len, name)
        train, held_out = tokens, None
    else:
        train, held_out = split_held_out(tokens, EVAL_FRACTION)
        check_tokens(train, settings.model.seq_len, f"{name} (train part)")
        check_tokens(held_out, settings.model.seq_len, f"{name} (held-out part for --eval-every)")
    for flag in ("steps", "eval_batches", "checkpoint_every", "keep", "log_every"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be positive.")
    return train, held_out, settings


def _devices(args, sizes: dict) -> None:
    """Joins the multi-process run if asked, then picks the devices: before JAX starts."""
    from ..mesh import simulate_cpu_devices
    from .distributed import join, requested

    processes = requested(args.coordinator, args.num_processes, args.process_id, args.distributed)
    if args.cpu_devices or not _has_accelerator_plugin():
        per_process = args.cpu_devices or math.prod(sizes.values()) // max(processes, 1)
        simulate_cpu_devices(per_process)
    if processes != 1:
        join(args.coordinator, args.num_processes, args.process_id, args.distributed)


def _bench(args, argv: list[str], out) -> int:
    from pathlib import Path

    from ..mesh import simulate_cpu_devices

    workloads, known = args.workloads.split(","), {"mlp", "block", "gpt"}
    if not set(workloads) <= known or args.blocks < 3 or args.steps < 1:
        print(
            f"fsdp-tp: error: --workloads {args.workloads!r} must name some of {sorted(known)}, "
            f"--blocks at least 3 (a median of blocks), --steps at least 1.",
            file=sys.stderr,
        )
        return 2
    if not _has_accelerator_plugin():
        simulate_cpu_devices(8)
    from ..bench.run import run_benchmarks

    readme = Path(args.readme) if args.readme and Path(args.readme).is_file() else None
    depths = [int(d) for d in args.depths.split(",") if d]
    run_benchmarks(
        argv,
        Path(args.out),
        workloads,
        args.blocks,
        args.steps,
        depths,
        args.plots,
        readme,
        out,
        args.max_unrolled,
        tuple(int(d) for d in args.build_depths.split(",") if d),
    )
    return 0


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args, argv[1:], out)
    try:
        sizes = _mesh(args.mesh)
        if args.command == "plan":
            from .run import print_plan

            print_plan(_settings(args, sizes), sizes, out)
            return 0
        train_tokens, eval_tokens, settings = _tokens(args, sizes)
        _devices(args, sizes)
        from .run import train

        return train(settings, sizes, args, train_tokens, eval_tokens, out)
    except (
        MeshShapeError,
        IndivisibleShapeError,
        DataError,
        UsageError,
        DistributedError,
        CheckpointMismatchError,
    ) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader stopped reading (`fsdp-tp plan | head`): not an error. Point stdout at
        # /dev/null so the interpreter's last flush does not raise it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fsdp-tp``: train the library's GPT-style model end to end, or print its sharding plan.

    fsdp-tp train                        # 8 simulated CPU devices, mesh 2x2x2, embedded data
    fsdp-tp train --check 3              # and first compare 3 steps with the unsharded twin
    fsdp-tp train --checkpoint-dir ckpt --resume   # save every 100 steps; continue the newest
    fsdp-tp plan --preset base --mesh data=8,fsdp=64,tensor=8 --batch 512
    fsdp-tp bench                        # every strategy vs the baselines -> docs/benchmarks.md

Bad input exits with status 2 and one line saying what to change.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
from jax.errors import JaxRuntimeError

from ..errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    IndivisibleShapeError,
    MeshShapeError,
)
from ..mesh import parse_mesh
from ..models import Layout
from ..precision import MixedPrecision
from ..recipe.config import preset
from ..recipe.data import (
    EVAL_FRACTION,
    DataChangedError,
    DataError,
    check_tokens,
    check_vocab,
    load_tokens,
    split_held_out,
    vocab_for,
)
from .agreement import check_agreement, run_settings
from .checks import UsageError, check_nnx, check_paths, check_ranges, check_schedule, resuming
from .distributed import DistributedError
from .machine import (
    check_cpu_devices,
    check_mesh_fits,
    check_platforms,
    requested_cpu_devices,
    select_devices,
    uses_accelerator,
)
from .options import DEFAULT_MESH, DEFAULT_WARMUP, DTYPES, parser
from .output import LogWriteError
from .stdout_filter import restore_stdout
from .supervise import adopt, supervisable, supervise, wait_for_verdict
from .workdir import check_contents

__all__ = ["console", "main"]


def _settings(args, mesh: dict, vocab_size: int | None = None):
    from ..recipe.trainer import Settings

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
        attention=args.attention,
        remat=args.remat,
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
    if config.num_heads % config.num_kv_heads:
        given = f" (the {args.preset} preset's)"
        kv = f"--kv-heads {config.num_kv_heads}" + ("" if args.num_kv_heads else given)
        heads = f"--heads {config.num_heads}" + ("" if args.num_heads else given)
        raise UsageError(
            f"{kv} does not divide {heads}; each key/value head serves a whole group of query heads: "
            f"pass --kv-heads with a divisor of {config.num_heads}."
        )
    check_schedule(args)
    if args.api == "nnx":
        check_nnx(args, config, mesh.get("tensor", 1))
    return Settings(
        model=config,
        steps=getattr(args, "steps", 1),
        batch=args.batch,
        microbatches=microbatches,
        lr=getattr(args, "lr", 0.0),
        warmup=DEFAULT_WARMUP if getattr(args, "warmup", None) is None else args.warmup,
        seed=getattr(args, "seed", 0),
        layout=Layout(
            tensor="tensor",
            fsdp="fsdp",
            sequence_parallel=_sequence_parallel(args),
            collective_matmul=None if args.async_tp == "off" else args.async_tp,
            min_weight_size=args.min_weight_size,
            mixed_precision=_mixed_precision(args),
        ),
        check_vma=args.check_vma,
        optimizer_name=getattr(args, "optimizer", "adamw"),
        clip_norm=clip_norm,
        api=args.api,
    )


def _sequence_parallel(args) -> bool:
    """``--sequence-parallel``, or its default: on for Linen, off for NNX (which has none)."""
    return args.api == "linen" if args.sequence_parallel is None else args.sequence_parallel


def _mixed_precision(args) -> MixedPrecision | None:
    """``--gather-dtype`` / ``--reduce-dtype``: a policy where either is narrower than f32."""
    if args.gather_dtype == args.reduce_dtype == "f32":
        return None
    return MixedPrecision(DTYPES[args.gather_dtype], DTYPES[args.reduce_dtype])


def _mesh(text: str) -> dict:
    sizes = parse_mesh(text)
    unknown = set(sizes) - {"data", "fsdp", "tensor"}
    if unknown:
        raise MeshShapeError(f"--mesh {text!r}: unknown axes {sorted(unknown)}; use data, fsdp and tensor.")
    bad = {axis: size for axis, size in sizes.items() if size < 1}
    if bad:
        raise MeshShapeError(f"--mesh {text!r}: axis sizes must be >= 1, got {bad}; e.g. {DEFAULT_MESH}.")
    return {axis: sizes.get(axis, 1) for axis in ("data", "fsdp", "tensor")}


def _tokens(args, mesh: dict):
    """The train and held-out tokens (``None`` without ``--eval-every``) and the settings that
    fit them, checked before anything starts or is written."""
    tokens = load_tokens(args.data)
    low, top = int(np.min(tokens)), int(np.max(tokens))  # one pass each over a (memory-mapped) file
    # A token file's ids may exceed the bytes' 256: fit the vocabulary unless it was given.
    settings = _settings(args, mesh, None if tokens.dtype == np.uint8 else vocab_for(top))
    name = args.data or "the embedded corpus"
    check_vocab(low, top, settings.model.vocab_size, name)
    if not args.eval_every:
        check_tokens(tokens, settings.model.seq_len, name)
        train, held_out = tokens, None
    else:
        train, held_out = split_held_out(tokens, EVAL_FRACTION)
        check_tokens(train, settings.model.seq_len, f"{name} (train part)")
        check_tokens(held_out, settings.model.seq_len, f"{name} (held-out part for --eval-every)")
    return train, held_out, settings


def _accelerator_bench(args, argv: list[str], out) -> int:
    from pathlib import Path

    from ..bench.accelerator import accelerator_section, parse_presets, write_accelerator_page

    try:
        presets = parse_presets(args.presets)
    except ValueError as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2
    overrides = dict(
        vocab_size=args.vocab_size,
        dtype=DTYPES[args.dtype],
        attention=args.attention,
        remat=args.remat,
        scan_layers=args.scan_layers,
    )
    text = accelerator_section(presets, overrides, args.blocks, args.steps, argv, out)
    print(f"wrote {write_accelerator_page(text, Path(args.out))}", file=out)
    return 0


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
    if not uses_accelerator(args):
        simulate_cpu_devices(8)
    if args.accelerator:
        return _accelerator_bench(args, argv, out)
    from ..bench.run import run_benchmarks

    readme = Path(args.readme) if args.readme and Path(args.readme).is_file() else None
    given = {"--depths": args.depths, "--build-depths": args.build_depths}
    for flag, text in given.items():
        if not all(d.strip().isdigit() and int(d) > 0 for d in text.split(",") if d):
            print(
                f"fsdp-tp: error: {flag} {text!r}: give layer counts >= 1, comma-separated (e.g. 2,8,32).",
                file=sys.stderr,
            )
            return 2
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


def _checked_train(args, out) -> int:
    """``train``: every input checked (flags, paths, data, processes), then devices, then the run.
    Without ``--mesh`` on accelerators or with ``--cpu-devices N``, the devices come first: the
    mesh is all of them on fsdp."""
    import jax

    check_paths(args)
    check_platforms()
    if args.checkpoint_dir:
        check_contents(args.checkpoint_dir, resuming(args), args.overwrite, args.resume_from)
    if args.mesh is None and (uses_accelerator(args) or args.cpu_devices):
        check_cpu_devices(args)
        select_devices(args, None)  # checks the multi-process flags first
        sizes = {"data": 1, "fsdp": jax.device_count(), "tensor": 1}
        args.mesh, args.mesh_chosen = f"fsdp={jax.device_count()}", True
        train_tokens, eval_tokens, settings = _tokens(args, sizes)
    else:
        sizes = _mesh(args.mesh or DEFAULT_MESH)
        train_tokens, eval_tokens, settings = _tokens(args, sizes)
        if (total := requested_cpu_devices(args)) is not None:
            check_mesh_fits(sizes, total, settings)  # before the devices are made
        select_devices(args, sizes)
    from .resume import data_identity, data_name

    # Before the mesh check and any device work: a process started otherwise would hang there.
    same = run_settings(args, data_identity(train_tokens, data_name(args)))
    check_agreement(same, args.coordinator_timeout)
    check_mesh_fits(sizes, jax.device_count(), settings)
    from .output import library_logs
    from .run import train

    with library_logs(args.verbose):
        return train(settings, sizes, args, train_tokens, eval_tokens, out)


def _with_command(argv: list[str]) -> list[str]:
    """``train`` is the default command: ``fsdp-tp --steps 3`` is ``fsdp-tp train --steps 3``."""
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    return argv


def _parse(argv: list[str]):
    return parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    """Runs ``fsdp-tp`` with ``argv``; returns the exit status: 0, 1 when the run failed (a save,
    a non-finite step, ``--check``), 2 for bad input (one line on stderr, nothing started)."""
    argv = _with_command(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.command == "bench":
        return _bench(args, argv[1:], out)
    try:
        check_ranges(args)
        if args.command == "plan":
            from .fit import print_plan

            sizes = _mesh(args.mesh or DEFAULT_MESH)
            print_plan(_settings(args, sizes), sizes, out)
            return 0
        return _checked_train(args, out)
    except (CheckpointSaveError, LogWriteError, DataChangedError) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 1
    except (
        MeshShapeError,
        IndivisibleShapeError,
        DataError,
        UsageError,
        DistributedError,
        CheckpointMismatchError,
        CheckpointCorruptError,
    ) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2
    except JaxRuntimeError as err:
        wait_for_verdict(err, getattr(args, "peer_timeout", 0))
        raise
    except BrokenPipeError:
        # The reader stopped reading (`fsdp-tp plan | head`): not an error. Point stdout at
        # /dev/null so the interpreter's last flush does not raise it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console() -> None:
    """The ``fsdp-tp`` executable: ``main``, then exit even if a failed save left orbax threads
    waiting for signals that will never come (they would hold the interpreter for 20 minutes).
    A multi-process run trains in a child process that a parent watches (``supervise.py``);
    such a child that failed leaves at once too: JAX's clean shutdown would wait at a barrier
    the other processes, stuck in the next step's collectives, never reach. Gone, it is a lost
    process: they stop within --peer-timeout, naming it."""
    if supervised := adopt():
        code = main()
    elif (args := supervisable(argv := _with_command(sys.argv[1:]), _parse)) is not None:
        sys.exit(supervise(argv, args))
    else:
        code = main()
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if (code and stuck) or (supervised and code in (1, 2)):
        restore_stdout()  # flushes stdout, and passes on what the gloo-line filter holds
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()

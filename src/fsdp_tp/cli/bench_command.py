"""``fsdp-tp bench``: its flags checked, then the CPU benchmark or the accelerator's."""

from __future__ import annotations

import sys

from .checks import UsageError, check_attention
from .machine import uses_accelerator
from .options import DTYPES
from .workdir import writable_directory

__all__ = ["bench"]


def _check_presets_fit(presets: list[tuple[str, int]], overrides: dict, precisions: int) -> None:
    """Each preset's plan (one abstract trace, no device work) against one device's memory:
    on a CPU machine with jax 0.10 the default presets plan 100 GB (jax 0.12's compiler, 16 GB)
    and ended in an allocator's traceback. ``precisions``: the library's states alive beside plain
    flax's, one per gather precision."""
    import dataclasses

    from ..bench.accelerator import bench_settings
    from ..recipe.config import PRESETS
    from .fit import abstract_mesh, check_fits, plan_of

    one_device = abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    fix = "measure smaller presets or batches (e.g. --presets tiny:8), or with --remat full"
    for name, batch in presets:
        settings = bench_settings(dataclasses.replace(PRESETS[name], **overrides), batch)
        plan = plan_of(settings, one_device)
        check_fits(plan, f"--presets {name}:{batch}", states=precisions + 1, sharing=1, fix=fix)


def _accelerator_bench(args, argv: list[str], out) -> int:
    from pathlib import Path

    from ..bench.accelerator import accelerator_section, parse_presets, policies_of, write_accelerator_page
    from .options import GATHER_DTYPES

    overrides = dict(
        vocab_size=args.vocab_size,
        dtype=DTYPES[args.dtype],
        attention=args.attention,
        remat=args.remat,
        scan_layers=args.scan_layers,
    )
    try:
        presets = parse_presets(args.presets)
        policies = policies_of(args.precisions, GATHER_DTYPES, DTYPES)
        _check_presets_fit(presets, overrides, len(policies))
    except (ValueError, UsageError) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2
    text = accelerator_section(presets, overrides, args.blocks, args.steps, argv, out, policies)
    print(f"wrote {write_accelerator_page(text, Path(args.out))}", file=out)
    return 0


def _check_machine_flags(args) -> None:
    """Where the pages go, and what --accelerator's attention needs of this machine. (On a CPU
    machine --accelerator runs the presets on one CPU device, which small presets fit.)"""
    writable_directory(args.out, "--out")
    if args.accelerator:
        check_attention(args.attention, args.dtype, uses_accelerator(args))


def bench(args, argv: list[str], out) -> int:
    """``fsdp-tp bench``: every strategy against the baselines on 8 simulated CPU devices, or
    with ``--accelerator`` the model on this machine's accelerators; its page written. Bad
    ``--workloads``, ``--blocks``, ``--steps`` or depths: one line, status 2."""
    from pathlib import Path

    from ..mesh import simulate_cpu_devices

    try:  # every flag before any work: a bench run takes minutes
        _check_machine_flags(args)
    except UsageError as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2
    workloads, known = args.workloads.split(","), {"mlp", "block", "gpt"}
    refusals = [
        (
            not set(workloads) <= known,
            f"--workloads {args.workloads!r} names {sorted(set(workloads) - known)}: give some of "
            f"{sorted(known)}, comma-separated",
        ),
        (
            args.blocks < 3,
            f"--blocks {args.blocks} is out of range: expected an integer >= 3 (a median of blocks)",
        ),
        (
            args.steps < 1,
            f"--steps {args.steps} is out of range: expected an integer >= 1 (timed steps per block)",
        ),
    ]
    if said := next((text for bad, text in refusals if bad), None):
        print(f"fsdp-tp: error: {said}.", file=sys.stderr)
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

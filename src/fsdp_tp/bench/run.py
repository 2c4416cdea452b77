"""``fsdp-tp bench``: every strategy against the baselines, in one process and one run.

Writes ``docs/benchmarks.md`` (tables, the command, when and where it ran), PNG plots
beside it, and the README's headline table between its markers.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import TextIO

import jax

from .auto_rows import auto_costs, auto_section
from .context_rows import context_costs, context_section
from .figures import Figures, build_seconds, compile_seconds, exact_figures, median, step_seconds
from .hub_rows import hub_costs, hub_section
from .llama_rows import llama_costs, llama_section
from .moe_rows import moe_costs, moe_section
from .nnx_rows import nnx_costs, nnx_section
from .optimizer import optimizer_costs, optimizer_section
from .precision_rows import (
    POLICIES,
    held_out_loss,
    precision_section,
    timed_steps,
    training_section,
    wire,
)
from .report import headline, markdown, replace_headline, spread, suite_section
from .variants import IMPLEMENTATIONS, STRATEGIES, Strategy, Variant, build_variant
from .workloads import WORKLOADS, bench_layout, gpt

__all__ = ["overhead_at_one_device", "run_benchmarks", "workload_variants"]

ONE_DEVICE_LIBRARY = Strategy(
    "fsdp_tp_1x1x1",
    {"data": 1, "fsdp": 1, "tensor": 1},
    bench_layout(tensor="tensor", fsdp="fsdp", sequence_parallel=True),
)


def workload_variants(
    name: str, implementations: tuple[str, ...] = IMPLEMENTATIONS
) -> list[tuple[Variant, Variant]]:
    """Every (variant, the library variant of its strategy) of a workload, one device first;
    ``implementations`` beyond ``"fsdp_tp"`` (always built) pick the baselines."""
    workload = WORKLOADS[name]
    pairs = []
    for strategy in STRATEGIES.values():
        if strategy.layout.sequence_parallel and not workload.supports_sequence_parallel:
            continue
        library = build_variant(workload, strategy, "fsdp_tp")
        pairs.append((library, library))
        if strategy.name != "single":
            pairs += [
                (build_variant(workload, strategy, impl), library)
                for impl in implementations
                if impl != "fsdp_tp"
            ]
    return pairs


def overhead_at_one_device(blocks: int, steps: int) -> dict[str, list[float]]:
    """The GPT-style model on one device: through the library at mesh 1x1x1 vs plain flax."""
    workload = WORKLOADS["gpt"]
    library = build_variant(workload, ONE_DEVICE_LIBRARY, "fsdp_tp")
    plain = build_variant(workload, STRATEGIES["single"], "fsdp_tp")
    return step_seconds([library, plain], blocks, steps)


def _header(argv: list[str]) -> list[str]:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores"
    return [
        "# Benchmarks",
        "",
        "Regenerate (tables, plots and the README's headline) with:",
        "",
        f"    fsdp-tp bench {' '.join(argv)}".rstrip(),
        "",
        f"Ran {when} on {machine}, jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} "
        f"devices; global batch 64, AdamW. Bytes are per device and exact (state: the arrays' shards; "
        f"memory: `memory_analysis()`; wire: the compiled HLO's collectives, ring model, docs/design.md "
        f'"How we measure"). Times are medians of interleaved blocks (min-max in brackets), noisy on a '
        f'shared CPU; read them as ratios. "minimum": dp 2(N-1)/N·P; fsdp W_min = 2(N-1)/N·(S_p+R), '
        f"3(N-1)/N on params re-gathered by remat; tp on the classifier and the block: Megatron's "
        f'all-reduces of the activations; — where no closed form is given. "full-grad all-reduces": '
        f"all-reduces shaped like a whole sharded parameter (a gradient synced unsharded). "
        f"MB = 10⁶ bytes.",
    ]


# Each policy of the wire table as fsdp-tp train's flags, and the main job's runs per policy.
_FLAGS = {
    label: (gather.strip(), reduce.strip()) for label in POLICIES for gather, reduce in [label.split("/")]
}
_SEEDS, _STEPS = 5, 300


def run_benchmarks(
    argv: list[str],
    out_dir: Path,
    workloads: list[str],
    blocks: int,
    steps: int,
    depths: list[int],
    plots: bool,
    readme: Path | None,
    out: TextIO = sys.stdout,
    max_unrolled: int = 32,
    build_depths: tuple[int, ...] = (8, 32),
) -> dict[str, list[Figures]]:
    """Measures everything, writes ``out_dir/benchmarks.md``, the plots and the README's headline.

    ``max_unrolled``: the deepest unrolled (no ``nn.scan``) GPT whose compile time is taken.
    ``build_depths``: the unrolled depths whose whole build (init + specs + first step
    compiled) is timed against plain flax.
    """
    results: dict[str, list[Figures]] = {}
    times: dict[str, dict[str, list[float]]] = {}
    for name in workloads:
        pairs = workload_variants(name)
        results[name] = []
        for variant, library in pairs:
            results[name].append(exact_figures(variant, library.state))
            print(f"{name}: {variant.label} measured", file=out, flush=True)
        times[name] = step_seconds([v for v, _ in pairs], blocks, steps)
        del pairs  # free the states before the next workload
    overhead = overhead_at_one_device(blocks, steps)
    costs = optimizer_costs(blocks, steps)
    print("optimizer: per device vs global arrays measured", file=out, flush=True)
    nnx = nnx_costs(blocks, steps)
    print("nnx: the GPT in NNX vs in Linen measured", file=out, flush=True)
    llama = llama_costs(blocks, steps)
    print("llama: Megatron by tp rules vs storage splits measured", file=out, flush=True)
    found = auto_costs()
    print("auto: the plan found on 32-layer models", file=out, flush=True)
    moe = moe_costs(blocks, steps)
    print("moe: expert parallelism vs experts stored split measured", file=out, flush=True)
    context = context_costs(blocks, steps)
    print("context: ring attention vs all-gathered k, v measured", file=out, flush=True)
    loaded = hub_costs()
    print("hub: a 1.25 GB checkpoint loaded to shards vs orbax's layout vs read whole", file=out, flush=True)
    wires = [wire(label) for label in POLICIES]
    wire_times = timed_steps(wires, blocks, steps)
    losses = {
        label: [held_out_loss(*_FLAGS[label], seed, _STEPS) for seed in range(_SEEDS)] for label in POLICIES
    }
    print("precision: the wire per element and the main job's loss per policy", file=out, flush=True)
    compile_times = {}
    for layers in depths:
        for scan in (True, False) if layers <= max_unrolled else (True,):
            variant = build_variant(
                WORKLOADS["gpt"], STRATEGIES["fsdp_tp"], "fsdp_tp", gpt(layers, scan), abstract=True
            )  # shapes and shardings only: compile time without the init's
            compile_times[(layers, scan)] = compile_seconds(variant)
            print(f"compile: {layers} layers, scan={scan}: {compile_times[(layers, scan)]:.2f} s", file=out)
    build_times = {}
    for layers in build_depths:
        build_times[layers] = build_seconds(layers, blocks)
        print(
            f"build: {layers} unrolled layers: {build_times[layers][0]:.2f} s (plain flax "
            f"{build_times[layers][1]:.2f} s, ratio {build_times[layers][2]:.2f}; medians of {blocks})",
            file=out,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if plots:
        from .plots import plot_all, plot_training_effect

        paths = [
            *plot_all(results, times, compile_times, out_dir),
            plot_training_effect(losses, _STEPS, out_dir),
        ]
    titles = {name: WORKLOADS[name].title for name in workloads}
    text = markdown(results, titles, times, compile_times, _header(argv), paths, build_times)
    text += _overhead_section(overhead) + optimizer_section(costs) + nnx_section(nnx) + llama_section(llama)
    text += auto_section(found) + precision_section(wires, wire_times) + training_section(losses, _STEPS)
    text += moe_section(moe) + context_section(context) + hub_section(loaded)
    page = out_dir / "benchmarks.md"
    text += suite_section(page.read_text() if page.exists() else None)
    page.write_text(text)
    if readme is not None and "gpt" in results:
        replace_headline(readme, headline(results, times))
    print(f"wrote {out_dir / 'benchmarks.md'}" + "".join(f", {p}" for p in paths), file=out)
    return results


def _overhead_section(overhead: dict[str, list[float]]) -> str:
    library, plain = (overhead[k] for k in sorted(overhead, key=lambda k: "single" in k))
    backend = jax.default_backend()
    gpu = (
        ""
        if backend == "gpu"
        else "\nNo GPU was lent to the session that produced this file: the one-device figures above "
        "are on CPU. On a GPU machine the same command measures them there.\n"
    )
    return (
        f"\n### The library's overhead on one device ({backend})\n\n"
        "The GPT-style model at mesh 1x1x1 through the library (FSDP + TP + SP wrappers, "
        "`shard_map`) against the same model in plain flax under `jax.jit`:\n\n"
        "| | step ms median (min-max) | ÷ plain flax |\n|---|---:|---:|\n"
        f"| fsdp_tp at 1x1x1 | {spread(library)} | {median(library) / median(plain):.3f} |\n"
        f"| plain flax | {spread(plain)} | 1 |\n" + gpu
    )

"""The main job's GPT in NNX against the same GPT in Linen (``fsdp-tp train --api nnx`` vs
``--api linen``): state and wire bytes per device, exact, and step time as a ratio in one run.

Both compute Megatron's TP, with sequence parallelism or without, with the collective-matmul
rings or without, and kv heads kept whole where
the tensor axis does not divide them (Linen's layers, NNX's roles: ``tp_rules``); FSDP splits
what Linen's ``shard_module_params`` splits (:func:`fsdp_tp.models.nnx_transformer.storage_rules`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..analysis import collective_summary, parse_collectives, state_bytes_per_device
from ..mesh import make_mesh
from ..models import Layout
from ..recipe.config import ModelConfig, preset
from ..recipe.trainer import BATCH, Settings, init_arguments, sharded_gpt, step_fn
from ..sharded_init import abstract_init, init_sharded
from ..train import shard_step
from .figures import BuiltWhenTimed, median, step_seconds
from .report import spread

__all__ = ["MESHES", "Built", "against_linen", "build", "nnx_costs", "nnx_section"]

# name: (mesh sizes, sequence parallelism, rings). On tensor 8 the preset's 4 kv heads are kept
# whole.
MESHES = {
    "fsdp": ({"data": 1, "fsdp": 8, "tensor": 1}, True, None),
    "fsdp_tp": ({"data": 1, "fsdp": 4, "tensor": 2}, True, None),
    "fsdp_tp, no SP": ({"data": 1, "fsdp": 4, "tensor": 2}, False, None),
    "fsdp_tp, async": ({"data": 1, "fsdp": 4, "tensor": 2}, True, "bidirectional"),
    "dp_fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, True, None),
    "tp8, kv kept": ({"data": 1, "fsdp": 1, "tensor": 8}, True, None),
}
PRESET, BATCH_SIZE, MIN_WEIGHT_SIZE = "small", 16, 2**10  # the CLI's defaults but the preset


@dataclass
class Built(BuiltWhenTimed):
    """One API's GPT on one mesh: what :func:`~fsdp_tp.bench.figures.step_seconds` times, and
    its exact figures (state bytes on each device, the compiled step's collectives)."""

    label: str
    init: Callable[[], Any]  # builds its state (BuiltWhenTimed)
    step: Any  # the compiled step: (state, batch) -> (state, loss)
    batch: Any
    state_bytes: dict
    collectives: dict


def build(
    api: str,
    sizes: dict,
    config: ModelConfig,
    batch: int,
    min_weight_size: int,
    sequence_parallel: bool,
    collective_matmul: str | None = None,
) -> Built:
    """The CLI's GPT of ``config`` in ``api`` on a mesh of ``sizes``: its step compiled against
    the state's shapes, its bytes and collectives read; the state is built (as the CLI's
    ``Trainer`` builds it) only when the step is timed."""
    layout = Layout("tensor", "fsdp", sequence_parallel, collective_matmul, min_weight_size)
    settings = Settings(config, 100, batch, 1, 1e-3, 1, 0, layout, True, api=api)
    mesh = make_mesh(sizes)
    model = sharded_gpt(settings, sizes, settings.optimizer())  # the CLI's model
    arguments = init_arguments(settings, mesh, model)
    shapes, specs = abstract_init(*arguments, check_vma=settings.check_vma)
    init = lambda: init_sharded(*arguments, twin_init_fn=model.twin_init_fn, check_vma=settings.check_vma)[0]
    step = shard_step(step_fn(settings, model), mesh, specs, BATCH)
    windows = np.random.default_rng(0).integers(0, config.vocab_size, (batch, config.seq_len + 1))
    windows = jax.device_put(windows.astype(np.int32), NamedSharding(mesh, BATCH))
    # Compiled once: the executable whose collectives are read is the one timed.
    compiled = jax.jit(step, donate_argnums=0).lower(shapes, windows).compile()
    summary = collective_summary(parse_collectives(compiled.as_text() or ""))
    label = f"{'x'.join(str(n) for n in sizes.values())}/{api}"
    return Built(label, init, compiled, windows, state_bytes_per_device(shapes), summary)


Costs = list[tuple[str, Built, Built, list[float], list[float]]]


def against_linen(linen: Built, ours: Built) -> str:
    """``"equal"``: the same state bytes on every device and the same collectives (ops and wire
    bytes of each kind); ``"all-reduce +K ops, -N B"``: the same but for the all-reduces, whose
    wire bytes are no more than Linen's, which sequence parallelism gives NNX (JAX's
    ``check_vma`` sums a norm's gradient over tensor and the batch axes in one all-reduce;
    Linen's layers take two, their explicit *f* over tensor, then the batch sync; the ops
    group otherwise); ``"NO"``: anything else."""
    if ours.state_bytes != linen.state_bytes:
        return "NO"
    if ours.collectives == linen.collectives:
        return "equal"
    others = lambda built: {k: v for k, v in built.collectives.items() if k != "all-reduce"}
    ours_reduce, linen_reduce = ours.collectives["all-reduce"], linen.collectives["all-reduce"]
    fewer = linen_reduce["wire_bytes"] - ours_reduce["wire_bytes"]
    if others(ours) != others(linen) or fewer < 0:
        return "NO"
    return f"all-reduce {int(ours_reduce['ops'] - linen_reduce['ops']):+d} ops, -{fewer:,.0f} B"


def nnx_costs(blocks: int, steps: int) -> Costs:
    """Per mesh of :data:`MESHES`: ``(name, linen, nnx, linen seconds, nnx seconds)``, the two
    APIs' steps timed interleaved."""
    config = preset(PRESET)
    out = []
    for name, (sizes, sp, ring) in MESHES.items():
        linen, ours = (
            build(api, sizes, config, BATCH_SIZE, MIN_WEIGHT_SIZE, sp, ring) for api in ("linen", "nnx")
        )
        times = step_seconds([linen, ours], blocks, steps)
        out.append((name, linen, ours, times[linen.label], times[ours.label]))
    return out


def nnx_section(costs: Costs) -> str:
    """The benchmark page's section for :func:`nnx_costs`."""
    rows = []
    for name, linen, ours, linen_times, nnx_times in costs:
        for api, built, times in (("linen", linen, linen_times), ("nnx", ours, nnx_times)):
            collectives = ", ".join(
                f"{kind} {int(c['ops'])} ({int(c['wire_bytes']):,} B)"
                for kind, c in sorted(built.collectives.items())
            )
            ratio = median(times) / median(linen_times)
            rows.append(
                f"| {name} | {api} | {max(built.state_bytes.values()):,} | {collectives} | "
                f"{against_linen(linen, built)} | {spread(times)} | {ratio:.3f} |"
            )
    return (
        f"\n### The GPT in NNX against the GPT in Linen (`--api nnx`, preset {PRESET}, "
        f"batch {BATCH_SIZE})\n\n"
        "The same model written in each API, from the same init, with sequence parallelism (the "
        "CLI's default) but where the mesh name says *no SP*, the collective-matmul rings where it "
        "says *async* (`--async-tp bidirectional`); on tensor 8 the preset's 4 kv heads are kept "
        "whole. State bytes on the fullest device, the compiled step's collectives "
        "(per device: ops, wire bytes), against Linen's on every device (*equal*, or other "
        "all-reduces of no more bytes: under sequence parallelism JAX's `check_vma` sums a norm's "
        "gradient over tensor and the batch axes in one all-reduce, where Linen's layers take "
        "two), and step time, interleaved:\n\n"
        "| mesh | API | state B/device | collectives | vs Linen | step ms median (min-max) | ÷ Linen |\n"
        "|---|---|---:|---|---|---:|---:|\n" + "\n".join(rows) + "\n"
    )

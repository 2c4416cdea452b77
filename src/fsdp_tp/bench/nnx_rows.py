"""The main job's GPT in NNX against the same GPT in Linen (``fsdp-tp train --api nnx`` vs
``--api linen``): state and wire bytes per device, exact, and step time as a ratio in one run.

Linen runs without sequence parallelism, which the NNX GPT does not have, so both compute
Megatron's TP with the same collectives; FSDP splits what Linen's ``shard_module_params``
splits (:func:`fsdp_tp.models.nnx_transformer.storage_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..analysis import collective_summary, parse_collectives, state_bytes_per_device
from ..mesh import make_mesh
from ..models import Layout
from ..recipe.config import ModelConfig, preset
from ..recipe.trainer import BATCH, Settings, sharded_gpt, step_fn
from ..sharded_init import init_sharded
from ..train import shard_step
from .figures import median, step_seconds
from .report import spread

__all__ = ["MESHES", "Built", "build", "nnx_costs", "nnx_section"]

MESHES = {
    "fsdp": {"data": 1, "fsdp": 8, "tensor": 1},
    "fsdp_tp": {"data": 1, "fsdp": 4, "tensor": 2},
    "dp_fsdp_tp": {"data": 2, "fsdp": 2, "tensor": 2},
}
PRESET, BATCH_SIZE, MIN_WEIGHT_SIZE = "small", 16, 2**10  # the CLI's defaults but the preset


@dataclass
class Built:
    """One API's GPT on one mesh: what :func:`~fsdp_tp.bench.figures.step_seconds` times, and
    its exact figures (state bytes on each device, the compiled step's collectives)."""

    label: str
    state: Any
    step: Any  # a jitted function of (state, batch)
    batch: Any
    state_bytes: dict
    collectives: dict


def build(api: str, sizes: dict, config: ModelConfig, batch: int, min_weight_size: int) -> Built:
    """The CLI's GPT of ``config`` in ``api`` on a mesh of ``sizes``: initialized, its step
    compiled, and its bytes and collectives read."""
    layout = Layout("tensor", "fsdp", sequence_parallel=False, min_weight_size=min_weight_size)
    settings = Settings(config, 100, batch, 1, 1e-3, 1, 0, layout, True, api=api)
    mesh = make_mesh(sizes)
    model = sharded_gpt(settings, dict(mesh.shape), settings.optimizer())
    ids = np.zeros((batch, config.seq_len), np.int32)
    state, specs = init_sharded(model.init_fn, mesh, (P(), BATCH), jax.random.key(0), ids)
    step = jax.jit(shard_step(step_fn(settings, model.logits), mesh, specs, BATCH), donate_argnums=0)
    windows = np.random.default_rng(0).integers(0, config.vocab_size, (batch, config.seq_len + 1))
    windows = jax.device_put(windows.astype(np.int32), NamedSharding(mesh, BATCH))
    hlo = step.lower(state, windows).compile().as_text() or ""
    summary = collective_summary(parse_collectives(hlo))
    label = f"{'x'.join(str(n) for n in sizes.values())}/{api}"
    return Built(label, state, step, windows, state_bytes_per_device(state), summary)


Costs = list[tuple[str, Built, Built, list[float], list[float]]]


def nnx_costs(blocks: int, steps: int) -> Costs:
    """Per mesh of :data:`MESHES`: ``(name, linen, nnx, linen seconds, nnx seconds)``, the two
    APIs' steps timed interleaved."""
    config = preset(PRESET)
    out = []
    for name, sizes in MESHES.items():
        linen, ours = (build(api, sizes, config, BATCH_SIZE, MIN_WEIGHT_SIZE) for api in ("linen", "nnx"))
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
            same = built.state_bytes == linen.state_bytes and built.collectives == linen.collectives
            rows.append(
                f"| {name} | {api} | {max(built.state_bytes.values()):,} | {collectives} | "
                f"{'yes' if same else 'NO'} | {spread(times)} | {median(times) / median(linen_times):.3f} |"
            )
    return (
        f"\n### The GPT in NNX against the GPT in Linen (`--api nnx`, preset {PRESET}, "
        f"batch {BATCH_SIZE})\n\n"
        "The same model written in each API, from the same init; Linen without sequence parallelism "
        "(NNX has none). State bytes on the fullest device, the compiled step's collectives "
        "(per device: ops, wire bytes), whether both equal Linen's on every device, and step "
        "time, interleaved:\n\n"
        "| mesh | API | state B/device | collectives | = Linen | step ms median (min-max) | ÷ Linen |\n"
        "|---|---|---:|---|---|---:|---:|\n" + "\n".join(rows) + "\n"
    )

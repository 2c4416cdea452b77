"""Expert parallelism against what a user gets without it (issue 59 point 5): the MoE language
model (:mod:`fsdp_tp.models.moe`) on meshes with an ``expert`` axis, its experts split over
it by :class:`~fsdp_tp.tp.ExpertParallel` (the tokens sent to them by ``all_to_all``), or
stored split over it and gathered whole on every device before each layer (storage rules:
FSDP over ``expert``); on a mesh with a ``tensor`` axis too, expert parallelism with each
expert's hidden dim split over ``tensor`` on its devices (``ExpertParallel(within=...)``),
against expert parallelism alone (whose ``tensor`` devices compute the same experts).

Per variant, from its compiled step: state bytes on the fullest device, the all_to_alls'
operand bytes against the minimum (one device's buffers ``(groups, E, capacity, d)`` sent to
the experts and back, forward and backward: four a MoE layer), the bytes all-gathered over
``expert`` (0: no expert's weights are gathered), matmul FLOPs per device, and the step's
time as a ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..analysis import compiled_memory, dot_flops, parse_collectives, state_bytes_per_device
from ..linen.rule_transform import shard_by_rules
from ..mesh import make_mesh
from ..models.moe import MoELM
from ..routing import capacity
from ..tp import ColumnParallel, ExpertParallel, RowParallel
from .figures import BuiltWhenTimed, median, step_seconds
from .lm_step import lowered_lm_step
from .report import spread

__all__ = ["MOE_MESHES", "MOE_SIZES", "MoEMeasured", "measure_moe", "moe_costs", "moe_section", "plans_of"]

MOE_SIZES = dict(
    vocab=256, d=64, heads=4, kv_heads=2, head_dim=16, hidden=128, layers=2, experts=8, top_k=2,
    capacity_factor=1.25, group_rows=1,
)  # fmt: skip
BATCH, SEQ = 16, 32
MOE_MESHES = {
    "data2_expert4": {"data": 2, "expert": 4},
    "fsdp2_expert4": {"fsdp": 2, "expert": 4},
    "expert4_tensor2": {"expert": 4, "tensor": 2},
}
PLANS = ("expert parallel", "stored split")
WITHIN = "expert parallel, tensor within"  # (a plan of the meshes with a tensor axis)

_EP = [(r"experts/(gate|up)$", ExpertParallel()), (r"experts/down$", ExpertParallel(returns=True))]
_EP_WITHIN = [
    (r"experts/(gate|up)$", ExpertParallel(within=ColumnParallel())),
    (r"experts/down$", ExpertParallel(returns=True, within=RowParallel())),
]
_FSDP = [  # on the model dim the expert split leaves, where the mesh has fsdp
    (r"experts/(gate|up)/kernel$", P(None, "fsdp")),
    (r"experts/down/kernel$", P(None, None, "fsdp")),
    (r"embedding$", P(None, "fsdp")),
]
_STORED = [  # what a user gets without expert parallelism: the expert dim stored split, gathered
    (r"experts/(gate|up)/kernel$", P("expert", "fsdp")),
    (r"experts/down/kernel$", P("expert", None, "fsdp")),
    (r"embedding$", P(None, "fsdp")),
]


@dataclass
class MoEMeasured(BuiltWhenTimed):
    """One mesh and plan: its compiled step, state and exact figures."""

    label: str
    step: Any
    init: Callable[[], Any]  # builds its state (BuiltWhenTimed)
    batch: Any
    state_bytes: int
    all_to_all_bytes: int  # operand bytes, every execution
    minimum: int  # four of one device's buffers a MoE layer
    expert_gathered: int  # bytes all-gathered over `expert`
    expert_wire: float  # ring-model bytes a device sends over `expert`, every collective
    temp_bytes: int  # the compiled step's temporaries
    flops: int


def _rules(mesh: dict, plan: str) -> tuple[list, list]:
    fsdp = "fsdp" in mesh
    if (tp := {"expert parallel": _EP, WITHIN: _EP_WITHIN}.get(plan)) is not None:
        return (_FSDP if fsdp else []), tp
    stored = [(pattern, P(*(a if a != "fsdp" or fsdp else None for a in spec))) for pattern, spec in _STORED]
    return stored, []


def measure_moe(
    mesh_name: str, plan: str, sizes: dict = MOE_SIZES, batch: int = BATCH, seq: int = SEQ
) -> MoEMeasured:
    """The MoE LM of ``sizes`` on ``MOE_MESHES[mesh_name]`` under ``plan``: its AdamW step
    compiled once (what is timed is what is read) and its figures."""
    axes = MOE_MESHES[mesh_name]
    batch_axes = tuple(a for a in ("data", "fsdp", "expert") if a in axes)
    storage, tp = _rules(axes, plan)
    model = shard_by_rules(MoELM, storage, batch_axes=batch_axes, tp_rules=tp)(sizes)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, sizes["vocab"], jnp.int32)
    lowered, state, init = lowered_lm_step(model, make_mesh(axes), batch_axes, tokens, with_aux=True)
    compiled = lowered.compile()
    found = parse_collectives(compiled.as_text() or "")
    expert = axes["expert"]
    rows = batch // math.prod(axes[a] for a in batch_axes)
    slots = capacity(sizes["group_rows"] * seq, sizes["top_k"], sizes["experts"], sizes["capacity_factor"])
    buffer = (rows // sizes["group_rows"]) * sizes["experts"] * slots * sizes["d"] * 4  # f32
    return MoEMeasured(
        f"{mesh_name}/{plan}",
        compiled,
        init,
        tokens,
        max(state_bytes_per_device(state).values()),
        sum(c.operand_bytes * c.executions for c in found if c.kind == "all-to-all"),
        4 * buffer * sizes["layers"],
        sum(
            c.operand_bytes * c.group_size * c.executions
            for c in found
            if c.kind == "all-gather" and c.group_size == expert
        ),
        sum(c.wire_bytes for c in found if c.group_size == expert),
        compiled_memory(compiled)["temp"],
        dot_flops(lowered.as_text(dialect="hlo")),
    )


def plans_of(mesh_name: str) -> tuple[str, ...]:
    """The plans measured on a mesh: with a ``tensor`` axis, the experts' hidden dim over it too."""
    return (PLANS[0], WITHIN, PLANS[1]) if "tensor" in MOE_MESHES[mesh_name] else PLANS


def moe_costs(blocks: int, steps: int) -> list[tuple[MoEMeasured, list[float]]]:
    """Every mesh under its plans, each mesh's steps timed interleaved."""
    out = []
    for mesh_name in MOE_MESHES:
        built = [measure_moe(mesh_name, plan) for plan in plans_of(mesh_name)]
        times = step_seconds(built, blocks, steps)
        out += [(m, times[m.label]) for m in built]
    return out


def moe_section(costs: list[tuple[MoEMeasured, list[float]]]) -> str:
    """The markdown section of the expert-parallel rows."""
    s = MOE_SIZES
    lines = [
        "### Mixture of experts: expert parallelism against experts stored split\n",
        f"`fsdp_tp.models.moe.MoELM` (Linen): {s['layers']} layers, every MLP a mixture of {s['experts']} "
        f"gated experts (d {s['d']}, hidden {s['hidden']}), top-{s['top_k']} at capacity "
        f"{s['capacity_factor']}, a group one sequence of {SEQ}; batch {BATCH}, AdamW. *Expert parallel*: "
        "the experts' einsums under `ExpertParallel` over `expert`, the tokens sent to them by "
        "`all_to_all` (with fsdp: FSDP on their model dim). *Stored split*: storage rules split the "
        "expert dim over `expert` and each layer gathers every expert on every device (what a user "
        f"gets without the role). *{WITHIN.capitalize()}* (on a mesh with `tensor`): expert parallel, "
        "each expert's hidden dim split over `tensor` on its devices, gate and up "
        "`ExpertParallel(within=ColumnParallel())`, down `within=RowParallel()` (expert parallel alone "
        "has every `tensor` device compute the same experts). All-to-all bytes: operand bytes of every "
        "all_to_all in the compiled step, against the minimum, four of one device's buffers (groups, E, "
        "capacity, d) a layer (there and back, forward and backward). Gathered over expert: the bytes "
        "all-gathers over `expert` bring a device; wire over expert: ring-model bytes a device sends over"
        " `expert` a step, every collective. Temp: the compiled step's temporaries (`memory_analysis()`)."
        " FLOPs: matmul FLOPs a device, ÷ the stored-split plan's.\n",
        "| mesh | plan | state B/device | temp B | all-to-all B (minimum) | gathered over expert B "
        "| wire over expert B | FLOPs ÷ stored | step ms median (min-max) | ÷ expert parallel |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_label = {m.label: (m, t) for m, t in costs}
    for m, times in costs:
        mesh_name, _ = m.label.split("/")
        stored, _ = by_label[f"{mesh_name}/stored split"]
        _, ep_times = by_label[f"{mesh_name}/expert parallel"]
        lines.append(
            f"| {mesh_name} | {m.label.split('/')[1]} | {m.state_bytes:,} | {m.temp_bytes:,} | "
            f"{m.all_to_all_bytes:,} ({m.minimum:,}) | {m.expert_gathered:,} | {round(m.expert_wire):,} | "
            f"{m.flops / stored.flops:.3f} | {spread(times)} | "
            f"{median(times) / median(ep_times):.3f} |"
        )
    for mesh_name in dict.fromkeys(m.label.split("/")[0] for m, _ in costs):
        (ep, ep_times), (stored, _) = (
            by_label[f"{mesh_name}/expert parallel"],
            by_label[f"{mesh_name}/stored split"],
        )
        lines.append(
            f"\nOn {mesh_name} expert parallelism sends {stored.expert_wire / ep.expert_wire:.1f} times "
            "fewer bytes over `expert` than gathering the experts (its all_to_alls: the minimum "
            f"exactly), and its step holds {stored.temp_bytes / ep.temp_bytes:.2f} times fewer "
            "temporary bytes, at the same state and FLOPs."
        )
        if (found := by_label.get(f"{mesh_name}/{WITHIN}")) is not None:
            within, times = found
            lines[-1] += (
                f" With each expert's hidden dim over `tensor` within, a device holds "
                f"{ep.state_bytes / within.state_bytes:.2f} times fewer state bytes and computes "
                f"{ep.flops / within.flops:.2f} times fewer matmul FLOPs than expert parallelism alone, "
                f"at the same all_to_alls, its step {median(times) / median(ep_times):.2f} of the time."
            )
    return "\n".join(lines) + "\n"

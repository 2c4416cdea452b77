"""FSDP's wire per parameter element under each precision policy (issue 60): the Gemma/Llama-style
model under Megatron's rules, its FSDP gathers and reduce-scatters read off its lowered step.

Per policy (gather dtype / reduce-scatter dtype): ring-model bytes each device sends per step for
the FSDP-split parameters, per element of them (the elements one ``fsdp`` group gathers: a
tensor-split parameter's slice), split into the parameters' all-gathers, the 8-bit policies'
scales (an f32 a row, gathered with its row or maxed over the axes that split it) and the
gradients' reduce-scatters. Over ``fsdp`` of size N a ring moves ``(N - 1) / N`` of an array a
device, so f32 / f32 is ``8 (N - 1) / N`` bytes an element and fp8 / bf16 ``3 (N - 1) / N`` plus
the scales.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ..analysis import parse_collectives, type_bytes
from ..linen.rule_transform import shard_by_rules
from ..mesh import make_mesh
from ..models.llama import LlamaLM
from ..precision import MixedPrecision
from .figures import median, step_seconds
from .llama_rows import BATCH, MESHES, SEQ, SIZES, plan_rules
from .lm_step import lowered_lm_step
from .report import spread

__all__ = [
    "POLICIES",
    "Wire",
    "held_out_loss",
    "precision_section",
    "timed_steps",
    "training_section",
    "wire",
]

POLICIES = {
    "f32 / f32": None,
    "bf16 / f32": MixedPrecision(jnp.bfloat16, jnp.float32),
    "bf16 / bf16": MixedPrecision(jnp.bfloat16, jnp.bfloat16),
    "fp8 / f32": MixedPrecision(jnp.float8_e4m3fn, jnp.float32),
    "fp8 / bf16": MixedPrecision(jnp.float8_e4m3fn, jnp.bfloat16),
    "fp8-e5m2 / bf16": MixedPrecision(jnp.float8_e5m2, jnp.bfloat16),
}
"""The policies measured, by the names ``fsdp-tp train --gather-dtype / --reduce-dtype`` take."""

_SCALE = re.compile(r"^f32\[[\d,]*,1\]")  # an 8-bit policy's scales: one f32 a row


@dataclass(frozen=True)
class Wire:
    """One policy's FSDP traffic per device per step, in ring-model bytes."""

    label: str
    fsdp: int  # the axis size
    elements: int  # FSDP-split parameter elements one fsdp group gathers
    gathers: float  # the parameters' all-gathers over fsdp
    scales: float  # their scales (8 bits only)
    reduce_scatters: float  # the gradients' reduce-scatters over fsdp
    # The step the figures are read off, lowered, what builds its state, and its batch: timed
    # by :func:`timed_steps` (compiled and built there: reading the bytes compiles nothing).
    lowered: Any = field(default=None, repr=False, compare=False)
    init: Any = field(default=None, repr=False, compare=False)
    batch: Any = field(default=None, repr=False, compare=False)

    @property
    def per_element(self) -> float:
        return (self.gathers + self.scales + self.reduce_scatters) / self.elements


def wire(label: str, sizes: dict = SIZES, mesh_name: str = "fsdp4_tensor2", batch: int = BATCH) -> Wire:
    """The Linen Llama of ``sizes`` under Megatron's rules on ``MESHES[mesh_name]`` with the
    policy ``POLICIES[label]``: its AdamW step lowered, its FSDP traffic read off it."""
    axes = MESHES[mesh_name]
    storage, tp = plan_rules("megatron", axes["tensor"], sizes)
    model = shard_by_rules(
        LlamaLM, storage, batch_axes=("fsdp",), tp_rules=tp, mixed_precision=POLICIES[label]
    )
    tokens = jax.random.randint(jax.random.key(1), (batch, SEQ), 0, sizes["vocab"], jnp.int32)
    lowered, state, init = lowered_lm_step(model(**sizes), make_mesh(axes), ("fsdp",), tokens)
    # The collectives as the step asks for them: compiling for the CPU widens a bf16 gather or
    # reduce-scatter to f32 (a GPU moves bf16); the 8-bit bits are u8 either way.
    found = parse_collectives(lowered.as_text(dialect="hlo"))
    fsdp, tensor = axes["fsdp"], axes["tensor"]
    traffic = {"gathers": 0.0, "scales": 0.0, "reduce_scatters": 0.0}
    for c in found:
        for operand in c.operand_types:  # (XLA may combine several gathers into one op)
            share = c.wire_bytes * type_bytes(operand) / c.operand_bytes
            if _SCALE.match(operand) and c.kind in ("all-gather", "all-reduce"):
                traffic["scales"] += share
            elif c.kind == "all-gather" and c.group_size == fsdp:
                traffic["gathers"] += share
            elif c.kind == "reduce-scatter" and c.group_size == fsdp:
                traffic["reduce_scatters"] += share
    split = [leaf for leaf in jax.tree.leaves(state.params) if "fsdp" in leaf.sharding.spec]
    elements = sum(leaf.size // (tensor if "tensor" in leaf.sharding.spec else 1) for leaf in split)
    return Wire(label, fsdp, elements, **traffic, lowered=lowered, init=init, batch=tokens)


@dataclass
class _Compiled:  # (what step_seconds times: its state replaced as it steps)
    label: str
    step: Any
    state: Any
    batch: Any


def timed_steps(rows: list[Wire], blocks: int, steps: int) -> dict[str, list[float]]:
    """Each policy's step compiled and timed, interleaved (:func:`~fsdp_tp.bench.figures.step_seconds`)."""
    return step_seconds(
        [_Compiled(w.label, w.lowered.compile(), w.init(), w.batch) for w in rows], blocks, steps
    )


def held_out_loss(gather: str, reduce: str, seed: int, steps: int = 300) -> float:
    """The held-out loss at the end of the main job (``fsdp-tp train``, its defaults but for
    ``--gather-dtype``, ``--reduce-dtype``, ``--seed`` and ``--steps``), run as the user runs
    it: a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        flags = [
            "--gather-dtype",
            gather,
            "--reduce-dtype",
            reduce,
            "--seed",
            str(seed),
            "--steps",
            str(steps),
        ]
        argv = [
            sys.executable,
            "-m",
            "fsdp_tp",
            "train",
            *flags,
            "--eval-every",
            str(steps),
            "--log-file",
            str(log),
        ]
        subprocess.run(argv, check=True, capture_output=True)
        evals = [
            json.loads(line)["eval_loss"] for line in log.read_text().splitlines() if "eval_loss" in line
        ]
    return evals[-1]


def training_section(losses: dict[str, list[float]], steps: int) -> str:
    """The markdown of the held-out losses per policy (``{label: [loss per seed]}``), against
    bf16 / f32's spread over the seeds."""
    base = losses["bf16 / f32"]
    spread = max(base) - min(base)
    lines = [
        f"\nThe training effect: the main job (`fsdp-tp train`, {steps} steps, its defaults) per policy, "
        f"held-out loss at the end for seeds {', '.join(str(s) for s in range(len(base)))}; bf16 gathers' "
        f"own seed-to-seed spread is {spread:.4f}.\n",
        "| gather / reduce-scatter | held-out loss per seed | mean | mean - bf16's |",
        "|---|---|---:|---:|",
    ]
    for label, values in losses.items():
        mean = statistics.fmean(values)
        each = ", ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {label} | {each} | {mean:.4f} | {mean - statistics.fmean(base):+.4f} |")
    return "\n".join(lines) + "\n"


def precision_section(rows: list[Wire], times: dict[str, list[float]]) -> str:
    """The markdown section of the per-element wire table, with each policy's step time
    (``times``: seconds per step by label, from :func:`timed_steps`)."""
    fsdp = rows[0].fsdp
    lines = [
        "### FSDP's wire per parameter element: f32, bf16 and 8-bit gathers\n",
        "`fsdp_tp.models.llama` (as in the Megatron section above) under Megatron's rules on "
        f"fsdp {fsdp} x tensor {MESHES['fsdp4_tensor2']['tensor']}, AdamW, by "
        "`shard_by_rules(mixed_precision=...)`. Per "
        "policy (gather / reduce-scatter dtype), ring-model bytes each device sends per step over "
        "`fsdp` for the FSDP-split parameters, per element of them, as the step asks for them (XLA "
        "compiles a bf16 collective to f32 on the CPU, not on a GPU; the 8 bits cross as u8 on both): the "
        "parameters' all-gathers, the 8-bit policies' scales (an f32 a row) and the gradients' "
        f"reduce-scatters. A ring over {fsdp} devices moves {fsdp - 1}/{fsdp} of an array a device. "
        "The same step timed (interleaved blocks; on this page's CPU devices, where the wire is "
        "memory, not a network, and quantizing is vector work), as a ratio to f32's:\n",
        "| gather / reduce-scatter | all-gathers | scales | reduce-scatters | in all | ÷ f32 "
        "| step ms median (min-max) | ÷ f32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    f32, f32_time = rows[0].per_element, median(times[rows[0].label])
    for w in rows:
        cells = (w.gathers / w.elements, w.scales / w.elements, w.reduce_scatters / w.elements)
        figures = " | ".join(f"{c:.3f}" for c in (*cells, w.per_element, w.per_element / f32))
        step = f"{spread(times[w.label])} | {median(times[w.label]) / f32_time:.3f}"
        lines.append(f"| {w.label} | {figures} | {step} |")
    return "\n".join(lines) + "\n"

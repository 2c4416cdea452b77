"""The Gemma/Llama-style model (:mod:`fsdp_tp.models.llama`: einsum attention with grouped kv
heads and RoPE, a gated einsum MLP, tied logits) under Megatron's tp rules against the same
model with the tensor axis splitting storage only, in Linen and in NNX.

Per mesh, API and plan: state bytes on the fullest device, the compiled step's all-reduce and
all-gather operands over ``tensor`` against Megatron's minimum, the FSDP gathers' bytes over
W_min, reduce-scatters per FSDP-split parameter, per-device matmul FLOPs, and step time as a
ratio in one run. The meshes give ``fsdp`` and ``tensor`` different sizes, so the compiled
program's group sizes tell the two axes apart.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..analysis import (
    Collective,
    array_bytes,
    dot_flops,
    operand_count,
    parse_collectives,
    state_bytes_per_device,
)
from ..linen.rule_transform import shard_by_rules
from ..mesh import make_mesh
from ..models.llama import FSDP_RULES, RULES, LlamaLM, NNXLlamaLM
from ..nnx import tp_splits
from ..testing import NNXSharded
from ..tp import ColumnParallel
from .figures import BuiltWhenTimed, median, step_seconds
from .lm_step import lowered_lm_step
from .report import spread

__all__ = [
    "MESHES",
    "SIZES",
    "Measured",
    "llama_costs",
    "llama_section",
    "measure",
]

MESHES = {"fsdp4_tensor2": {"fsdp": 4, "tensor": 2}, "fsdp2_tensor4": {"fsdp": 2, "tensor": 4}}
SIZES = dict(vocab=256, d=256, heads=8, kv_heads=2, head_dim=32, hidden=768, layers=4)
BATCH, SEQ = 16, 64
PLANS = ("megatron", "storage")


def _megatron_split(pattern: str, spec: P, splits: dict, shapes: dict, head_dim_instead: bool) -> P:
    """``spec`` of the parameters ``pattern`` names with "tensor" added on the dim the roles of
    :data:`~fsdp_tp.models.llama.RULES` split (read off the roles: :func:`fsdp_tp.nnx.tp_splits`),
    or on the last, the kv kernel's head dim 'H', where ``tensor`` does not divide the kv heads."""
    path = next(path for path in splits if re.search(pattern, path))
    ((dim, _),) = ((-1, None),) if head_dim_instead else splits[path]  # (RULES: one split each)
    entries = [*spec, *[None] * (len(shapes[path]) - len(spec))]
    entries[dim] = "tensor"
    return P(*entries)


def plan_rules(plan: str, tensor: int, sizes: dict) -> tuple[list, list]:
    """``(storage rules, tp rules)`` of a plan for the model of ``sizes``. ``"megatron"``: FSDP
    storage (:data:`~fsdp_tp.models.llama.FSDP_RULES`) and :data:`~fsdp_tp.models.llama.RULES`
    (the kv heads kept whole, each device keeping those its query heads read, where ``tensor``
    does not divide them). ``"storage"``: no tp rules; the tensor axis splits each parameter
    where Megatron's roles would, so its weights are gathered for use and every tensor device
    computes the whole model.

    >>> storage, tp = plan_rules("storage", 4, SIZES)
    >>> tuple(dict(storage)[r"attn/kv/kernel$"]), tp   # 2 kv heads: tensor 4 splits the head dim
    ((None, 'fsdp', None, 'tensor'), [])
    """
    split_kv = sizes["kv_heads"] % tensor == 0
    if plan == "megatron":
        kv = (r"attn/kv$", ColumnParallel(letter="K", replicated=not split_kv))
        return FSDP_RULES, [kv if pattern == kv[0] else (pattern, role) for pattern, role in RULES]
    model = nnx.eval_shape(lambda: NNXLlamaLM(nnx.Rngs(0), **sizes))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    shapes = {"/".join(map(str, path)): variable.get_raw_value().shape for path, variable in flat}
    splits = tp_splits(model, RULES)
    return [
        (pattern, _megatron_split(pattern, spec, splits, shapes, "kv" in pattern and not split_kv))
        for pattern, spec in FSDP_RULES
    ], []


@dataclass
class Measured(BuiltWhenTimed):
    """One API and plan on one mesh: its compiled step, state and exact figures."""

    label: str
    step: Any  # the compiled step, (state, tokens) -> (state, metrics), what is timed
    init: Callable[[], Any]  # builds its state (BuiltWhenTimed)
    batch: Any
    state_bytes: int  # on the fullest device
    tensor_all_reduces: int  # operands over `tensor`
    megatron_all_reduces: int  # Megatron's minimum for this model and mesh
    tensor_all_gathers: int
    fsdp_gathered: int  # bytes the FSDP all-gathers bring to each device
    w_min: int  # bytes of the FSDP-split parameters' tensor slices: what FSDP must gather
    reduce_scatters: int  # operands over `fsdp`
    fsdp_split: int  # parameters FSDP splits
    flops: int  # matmul FLOPs per device
    collectives: list[Collective]  # of the compiled step


def measure(
    api: str, mesh_name: str, plan: str, sizes: dict = SIZES, batch: int = BATCH, seq: int = SEQ
) -> Measured:
    """The model of ``sizes`` in ``api`` under ``plan`` on ``MESHES[mesh_name]``: its AdamW step
    compiled once (what is timed is what is read) and its figures."""
    axes = MESHES[mesh_name]
    storage, tp = plan_rules(plan, axes["tensor"], sizes)
    if api == "nnx":
        model = NNXSharded(functools.partial(NNXLlamaLM, **sizes), storage, batch_axes=("fsdp",), tp_rules=tp)
    else:
        model = shard_by_rules(LlamaLM, storage, batch_axes=("fsdp",), tp_rules=tp)(**sizes)
    mesh = make_mesh(axes)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, sizes["vocab"], jnp.int32)
    lowered, state, init = lowered_lm_step(model, mesh, ("fsdp",), tokens)
    compiled = lowered.compile()
    found = parse_collectives(compiled.as_text() or "")
    split = [leaf for leaf in jax.tree.leaves(state.params) if "fsdp" in leaf.sharding.spec]
    fsdp, tensor = axes["fsdp"], axes["tensor"]
    gathers = [c for c in found if c.kind == "all-gather" and c.group_size == fsdp]
    return Measured(
        f"{mesh_name}/{api}/{plan}",
        compiled,
        init,
        tokens,
        max(state_bytes_per_device(state).values()),
        operand_count(found, "all-reduce", tensor),
        # per block one forward and one backward for the attention and for the MLP, and with kv
        # heads kept whole the gradient of the kv kernel and of its bias, each device having read
        # its block; the embedding's sum and the tied logits' gradient
        (4 if sizes["kv_heads"] % tensor == 0 else 6) * sizes["layers"] + 2,
        operand_count(found, "all-gather", tensor),
        sum(c.operand_bytes * c.group_size * c.executions for c in gathers),
        sum(array_bytes(leaf) // (tensor if "tensor" in leaf.sharding.spec else 1) for leaf in split),
        operand_count(found, "reduce-scatter", fsdp),
        len(split),
        dot_flops(lowered.as_text(dialect="hlo")),
        found,
    )


Costs = list[tuple[Measured, list[float]]]


def llama_costs(blocks: int, steps: int) -> Costs:
    """Every mesh, API and plan measured, each mesh's four steps timed interleaved."""
    out: Costs = []
    for mesh_name in MESHES:
        built = [measure(api, mesh_name, plan) for api in ("linen", "nnx") for plan in PLANS]
        times = step_seconds(built, blocks, steps)
        out += [(m, times[m.label]) for m in built]
    return out


def _row(m: Measured, storage: Measured, times: list[float], megatron_times: list[float]) -> str:
    mesh_name, api, plan = m.label.split("/")
    minimum = f" ({m.megatron_all_reduces})" if plan == "megatron" else ""
    # The storage plan gathers its weights over both axes, so its FSDP bytes measure no W_min.
    fsdp = f"{m.fsdp_gathered / m.w_min:.3f}" if plan == "megatron" else "—"
    return (
        f"| {mesh_name} | {api} | {plan} | {m.state_bytes:,} | {m.tensor_all_reduces}{minimum} | "
        f"{m.tensor_all_gathers} | {fsdp} | {m.reduce_scatters} / {m.fsdp_split} | "
        f"{m.flops / storage.flops:.3f} | {spread(times)} | {median(times) / median(megatron_times):.3f} |"
    )


def llama_section(costs: Costs) -> str:
    """The benchmark page's section for :func:`llama_costs`."""
    by_label = {m.label: (m, times) for m, times in costs}
    rows = []
    for m, times in costs:
        mesh_api = m.label.rsplit("/", 1)[0]
        storage, megatron_times = by_label[f"{mesh_api}/storage"][0], by_label[f"{mesh_api}/megatron"][1]
        rows.append(_row(m, storage, times, megatron_times))
    s = SIZES
    return (
        "\n### A Gemma/Llama-style model: Megatron by tp rules against storage splits\n\n"
        f"`fsdp_tp.models.llama`: {s['layers']} layers, d {s['d']}, {s['heads']} query heads over "
        f"{s['kv_heads']} kv heads (einsum projections, RoPE), a gated einsum MLP of {s['hidden']}, "
        f"RMSNorm, logits tied to a {s['vocab']}-word embedding; batch {BATCH} over `fsdp`, "
        f"sequence {SEQ}, AdamW. *megatron*: `models.llama.RULES` (on tensor 4 the 2 kv heads are "
        'kept whole: `ColumnParallel(letter="K", replicated=True)`); *storage*: no tp rules, the '
        "tensor axis splits each parameter where Megatron would, so weights are gathered over it "
        "and every tensor device computes the whole model. Per device: all-reduce operands over "
        "`tensor` (in brackets Megatron's minimum: 4 x layers + 2, and with kv heads kept whole the "
        "kv kernel's and bias's gradients, 2 a block), all-gather operands over `tensor` "
        "(Megatron's one: the tied logits), FSDP gather bytes ÷ W_min, reduce-scatter operands "
        "over `fsdp` / FSDP-split parameters (the tied embedding's gradient once), matmul FLOPs "
        "÷ the storage plan's, and step time, each mesh's four steps interleaved. On tensor 4 the "
        "megatron plan's matmul FLOPs are above 1/4 of the storage plan's, and its state larger: "
        "each device projects the kv head its query heads read, 1/2 of the kv heads, from its "
        "block of the kv kernel kept whole (the kernel and its AdamW moments are split over "
        "`fsdp` only).\n\n"
        "| mesh | API | plan | state B/device | all-reduces over tensor | all-gathers over tensor "
        "| FSDP gather ÷ W_min | reduce-scatters / FSDP params | matmul FLOPs ÷ storage "
        "| step ms median (min-max) | ÷ megatron |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )

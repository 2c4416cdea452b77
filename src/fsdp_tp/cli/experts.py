"""``--experts``: the MoE LM's flags against the mesh and the other flags, each mismatch one
line naming the values and the fix, before anything starts; and the mesh's ``expert`` axis.

>>> from fsdp_tp.cli.options import parser
>>> args = parser("").parse_args(["train", "--experts", "6", "--mesh", "expert=4"])
>>> from fsdp_tp.recipe.config import PRESETS
>>> try:
...     check_experts(args, {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}, PRESETS["tiny"])
... except UsageError as err:
...     print(str(err).split(": ", 1)[1])
each device holds whole experts; pass --experts 8, or --mesh data=2,expert=2.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from ..routing import capacity
from .checks import UsageError

__all__ = [
    "MOE_DEFAULTS",
    "add_expert_flags",
    "check_experts",
    "expert_fields",
    "experts_text",
    "moe_plan_text",
    "with_expert_axis",
]

MOE_DEFAULTS = {"top_k": 2, "moe_every": 1}  # what --top-k and --moe-every mean when not given


def add_expert_flags(p: argparse.ArgumentParser) -> None:
    """The mixture of experts: ``--experts N`` trains the MoE LM (fsdp_tp.models.moe) instead
    of the GPT; the mesh may then name an ``expert`` axis."""
    moe = p.add_argument_group("mixture of experts: --experts N trains the MoE LM (fsdp_tp.models.moe)")
    moe.add_argument(
        "--experts",
        type=int,
        help="experts per MoE layer (default: none, the GPT); --mesh may name expert=N, which splits "
        "the experts and the batch (expert parallelism: tokens reach their experts by all_to_all)",
    )
    moe.add_argument("--top-k", type=int, help="experts each token is routed to (default: 2)")
    modes = moe.add_mutually_exclusive_group()
    modes.add_argument(
        "--capacity-factor",
        type=float,
        help="each expert takes at most ceil(factor x top-k x tokens / experts) tokens of a sequence, "
        "the rest dropped (default: --dropless)",
    )
    modes.add_argument(
        "--dropless", action="store_true", help="every token reaches its top-k experts (the default)"
    )
    moe.add_argument(
        "--moe-every", type=int, help="every Nth layer holds experts, the others a dense MLP (default: 1)"
    )


def with_expert_axis(sizes: dict, experts: int | None) -> dict:
    """The mesh of ``sizes`` with an ``expert`` axis (size 1 unless named) before ``tensor``
    when the run has experts: their step splits the batch over it too."""
    if not experts:
        return sizes
    order = ("data", "fsdp", "expert", "tensor")
    return {axis: sizes.get(axis, 1) for axis in order}


def expert_fields(args) -> dict:
    """The :class:`~fsdp_tp.recipe.config.ModelConfig` fields of ``--experts`` and its flags
    (none without it); the MoE LM computes unrolled, its blocks under ``--remat`` as the GPT's
    (``auto``: the fastest policy whose measured step fits a device, :mod:`fsdp_tp.cli.fit`)."""
    if not args.experts:
        return {}
    given = {key: getattr(args, key) for key in MOE_DEFAULTS}
    return dict(
        experts=args.experts,
        capacity_factor=args.capacity_factor,
        **{key: MOE_DEFAULTS[key] if value is None else value for key, value in given.items()},
        remat=args.remat,
        scan_layers=False,
    )


def experts_text(config) -> str:
    """What the run's summary adds to the model's name for a mixture of experts.

    >>> from fsdp_tp.recipe.config import preset
    >>> experts_text(preset("tiny", experts=8, capacity_factor=1.25, moe_every=2))
    ' MoE, 8 experts (top-2, capacity factor 1.25, every 2nd layer)'
    """
    if not config.experts:
        return ""
    mode = "dropless" if config.capacity_factor is None else f"capacity factor {config.capacity_factor:g}"
    every = {1: "", 2: ", every 2nd layer", 3: ", every 3rd layer"}.get(
        config.moe_every, f", every {config.moe_every}th layer"
    )
    return f" MoE, {config.experts} experts (top-{config.top_k}, {mode}{every})"


def _without_experts(args, mesh: dict) -> None:
    named = [flag for flag, value in _moe_flags(args).items() if value]
    if named:
        raise UsageError(f"{' '.join(named)} configures experts, but this run has none: pass --experts N.")
    if mesh.get("expert", 1) > 1:
        raise UsageError(
            f"--mesh names expert={mesh['expert']}, which splits experts, but this run has none: pass "
            f"--experts N (a multiple of {mesh['expert']}) or drop expert={mesh['expert']}."
        )


def _moe_flags(args) -> dict:
    return {
        f"--top-k {args.top_k}": args.top_k is not None,
        f"--capacity-factor {args.capacity_factor}": args.capacity_factor is not None,
        "--dropless": args.dropless,
        f"--moe-every {args.moe_every}": args.moe_every is not None,
    }


def _unsupported(args) -> list[tuple[bool, str]]:
    """The GPT's flags the MoE LM has no use for, with why."""
    why = "the MoE LM (--experts)"
    return [
        (
            args.attention != "auto",
            f"--attention {args.attention}: {why} computes its attention with its own einsums; "
            "drop --attention",
        ),
        (
            bool(args.sequence_parallel),
            f"--sequence-parallel: {why} keeps the sequence whole between layers; drop it",
        ),
        (args.async_tp != "off", f"--async-tp {args.async_tp}: not for {why}; drop it"),
    ]


def _divisors(n: int) -> str:
    found = [str(d) for d in range(2, n + 1) if n % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def _meshes_for(experts: int, mesh: dict) -> str:
    """The meshes of the same devices, the other axes kept, whose expert axis divides
    ``experts`` (the data axis takes the rest): ", or --mesh ..." for each, or "" where none
    forms (3 experts beside tensor 2 on 8 devices)."""
    devices = math.prod(mesh.values())
    kept = {axis: size for axis, size in mesh.items() if axis not in ("data", "expert")}
    others = math.prod(kept.values())
    found = []
    for d in (n for n in range(2, experts + 1) if experts % n == 0):
        if devices % (d * others) == 0:
            sizes = {"data": devices // (d * others), **kept, "expert": d}
            order = [a for a in ("data", "fsdp", "expert", "tensor") if a in sizes]
            found.append(",".join(f"{a}={sizes[a]}" for a in order if sizes[a] > 1 or a == "expert"))
    return "".join(f", or --mesh {text}" for text in found)


def check_experts(args, mesh: dict, config) -> None:
    """Raises ``UsageError`` for the first ``--experts`` mismatch: MoE flags or an ``expert``
    axis without experts, experts the axis does not divide, a top-k above the experts, a
    ``--moe-every`` past the layers of ``config`` (the run's ``ModelConfig``), kv heads
    ``tensor`` does not divide (the MoE LM's attention splits them), or a GPT-only flag."""
    if not args.experts:
        _without_experts(args, mesh)
        return
    experts, expert = args.experts, mesh.get("expert", 1)
    k = MOE_DEFAULTS["top_k"] if args.top_k is None else args.top_k
    if experts % expert:
        raise UsageError(
            f"--experts {experts} is not divisible by the mesh's expert={expert}: each device holds whole "
            f"experts; pass --experts {-(-experts // expert) * expert}{_meshes_for(experts, mesh)}."
        )
    if k > experts:
        raise UsageError(
            f"--top-k {k} routes each token to more experts than the {experts} of --experts: pass "
            f"--top-k {experts} or less, or --experts {k} or more."
        )
    layers = config.num_layers
    if args.moe_every is not None and args.moe_every > layers:
        raise UsageError(
            f"--moe-every {args.moe_every} is more than the model's {layers} layers: no layer would hold "
            f"experts; pass --moe-every {layers} or less."
        )
    for bad, said in _unsupported(args):
        if bad:
            raise UsageError(said + ".")
    kv, tensor = config.num_kv_heads, mesh.get("tensor", 1)
    if tensor > 1 and kv % tensor:  # (the GPT keeps kv heads whole there; the MoE LM's attention cannot)
        raise UsageError(
            f"--kv-heads {kv} is not divisible by the mesh's tensor={tensor}: the MoE LM's attention "
            f"splits its key/value heads over tensor; pass --kv-heads {-(-kv // tensor) * tensor} "
            f"(dividing --heads), or a smaller tensor axis."
        )


def moe_plan_text(settings, sizes: dict, plan) -> str:
    """What ``fsdp-tp plan`` adds for a mixture of experts: the expert weights a device holds,
    its dispatch buffers, and the tp rules the run computes with (where an axis splits)."""
    from ..recipe.moe_lm import moe_rules
    from ..tp.auto import TPPlan

    config, expert, tensor = settings.model, sizes.get("expert", 1), sizes.get("tensor", 1)
    rows = [r for r in plan.rows if "/experts/" in r.path]
    held = sum(r.bytes_per_device for r in rows)
    whole = sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize for r in rows)
    moe_layers = config.num_layers // config.moe_every
    per_device = settings.batch // math.prod(sizes.get(a, 1) for a in settings.batch_axes)
    slots = capacity(config.seq_len, config.top_k, config.experts, config.capacity_factor)
    slots = config.seq_len if slots is None else slots  # (dropless: room for every token)
    buffer = per_device * config.experts * slots * config.d_model * 4  # f32, one sequence a group
    lines = [
        f"experts: {config.experts} in each of {moe_layers} MoE layers, {config.experts // expert} per "
        f"device over expert={expert}"
        + (f", each one's hidden dim split over tensor={tensor}" if tensor > 1 else "")
        + f": expert weights {whole / expert / tensor / 2**20:,.2f} MiB per device before FSDP, "
        f"{held / 2**20:,.2f} MiB stored (of {whole / 2**20:,.2f} MiB)",
        f"dispatch buffers (groups, experts, capacity, d) = ({per_device}, {config.experts}, {slots}, "
        f"{config.d_model}) per MoE layer per device: {buffer / 2**20:,.2f} MiB"
        + (", sent to their experts and back by all_to_all over expert" if expert > 1 else ""),
    ]
    _, tp = moe_rules(sizes, dense=config.moe_every > 1)
    if tp:
        axes = ", ".join(f"{a}={sizes[a]}" for a in ("expert", "tensor") if sizes.get(a, 1) > 1)
        plan_text = str(TPPlan(tuple(tp), {}, (), ()))
        lines.append(f"{axes}: the tp rules this run computes with (recipe.moe_lm.moe_rules):\n{plan_text}")
    return "\n".join(lines)

"""What running the optimizer on global arrays costs: collectives and step time.

The library's step applies the optax update on global arrays (so every transform gives
the unsharded update); the first version applied it per device inside ``shard_map``.
For the GPT-style workload on FSDP x TP x SP this compares, in one run:

- AdamW per device (the first version's step; element-wise, so still right),
- AdamW on global arrays (the library's step),
- ``clip_by_global_norm(1.0)`` then AdamW on global arrays (wrong per device, right here),

by the collectives each compiled step runs (count and wire bytes per device) and by
step time, interleaved (:func:`~fsdp_tp.bench.figures.step_seconds`).
"""

from __future__ import annotations

import optax

from ..analysis import collective_summary, parse_collectives
from .figures import median, step_seconds
from .report import spread
from .variants import STRATEGIES, build_variant
from .workloads import WORKLOADS

__all__ = ["optimizer_costs", "optimizer_section"]

STRATEGY = "fsdp_tp_sp"


def optimizer_costs(blocks: int, steps: int) -> list[tuple[str, dict, list[float]]]:
    """``(label, collective summary, step seconds per block)`` for the three steps."""
    adamw = lambda: optax.adamw(1e-3)
    cases = [
        ("AdamW, per device (first version)", "per_device_update", adamw()),
        ("AdamW, global arrays", "fsdp_tp", adamw()),
        ("clip 1.0 + AdamW, global arrays", "fsdp_tp", optax.chain(optax.clip_by_global_norm(1.0), adamw())),
    ]
    variants = [
        build_variant(WORKLOADS["gpt"], STRATEGIES[STRATEGY], implementation, tx=tx)
        for _, implementation, tx in cases
    ]
    for (label, _, _), variant in zip(cases, variants, strict=True):
        variant.implementation = label  # step_seconds keys its times by label
    summaries = [collective_summary(parse_collectives(v.lowered().compile().as_text())) for v in variants]
    times = step_seconds(variants, blocks, steps)
    return [
        (label, summary, times[variant.label])
        for (label, _, _), summary, variant in zip(cases, summaries, variants, strict=True)
    ]


def optimizer_section(costs: list[tuple[str, dict, list[float]]]) -> str:
    """The benchmark page's section for :func:`optimizer_costs`."""
    kinds = sorted({kind for _, summary, _ in costs for kind in summary})
    base = median(costs[0][2])
    head = " | ".join(f"{k} ops (bytes)" for k in kinds)
    rows = [
        f"| {label} | "
        + " | ".join(
            f"{int(summary.get(k, {}).get('ops', 0))} ({int(summary.get(k, {}).get('wire_bytes', 0)):,})"
            for k in kinds
        )
        + f" | {spread(times)} | {median(times) / base:.3f} |"
        for label, summary, times in costs
    ]
    return (
        f"\n### The optimizer on global arrays (GPT, {STRATEGY}, data=1 x fsdp=4 x tensor=2)\n\n"
        "The update runs outside `shard_map`, on global arrays, so every optax transform gives "
        "the unsharded update (`docs/tutorials/optimizers.md`). Collectives of each compiled step "
        "(per device) and step time, interleaved:\n\n"
        f"| step | {head} | step ms median (min-max) | ÷ per device |\n"
        f"|---|{'---:|' * len(kinds)}---:|---:|\n" + "\n".join(rows) + "\n"
    )

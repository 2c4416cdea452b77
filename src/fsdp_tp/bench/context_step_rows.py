"""Long sequences (issue 84), a model's train step: the GPT preset (``tiny``: 2 layers, d 64, 4
query heads, 2 kv heads) trained with its sequence split over ``cp`` devices of a ``context``
axis, as ``fsdp-tp train --mesh context=cp`` runs it (the ring, balanced), one sequence a step.

From each compiled step (``memory_analysis()``): the temporary bytes a device holds against the
sequence length and ``cp``, and the longest sequence (a power of two) whose step fits a budget a
device: the headline, what splitting the sequence buys.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ..gradients import sync_gradients
from ..mesh import make_mesh
from ..models import Layout
from ..recipe.config import preset
from ..sharded_init import abstract_init
from ..train import TrainState, shard_step

__all__ = ["STEP_BUDGET", "step_longest", "step_section", "step_temp_bytes"]

STEP_BUDGET = 256 * 2**20  # per-device temporaries of the step, for the longest sequence that fits
LONGEST = 2**16  # (the search stops there)


@functools.cache  # (the table and the longest search read the same programs)
def step_temp_bytes(cp: int, length: int) -> int:
    """The temporary bytes a device holds in the compiled train step of the tiny GPT on one
    sequence of ``length`` tokens, split over ``cp`` devices of ``context``."""
    model = preset("tiny", seq_len=length).model(Layout())
    mesh = make_mesh({"context": cp}, devices=jax.devices()[:cp])
    ids = jax.ShapeDtypeStruct((1, length), np.int32)

    def init_fn(rng, ids):
        params = model.init(rng, ids)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3), rng=rng)

    def step_fn(state, batch):
        ids, targets = batch

        def loss(params):
            logits = model.apply({"params": params}, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        value, grads = jax.value_and_grad(loss)(state.params)
        return sync_gradients(grads, "context"), jax.lax.pmean(value, "context")

    state, specs = abstract_init(init_fn, mesh, (P(), P()), jax.random.key(0), ids)
    token = P(None, "context")
    step = shard_step(step_fn, mesh, specs, (token, token), donate_state=False)
    lowered = step.lower(state, (ids, ids))  # type: ignore[attr-defined]  # (shard_step gives it)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def step_longest(cp: int, start: int = 1024, budget: int = STEP_BUDGET) -> int:
    """The longest sequence (a power of two from ``start``, up to 65,536) whose step's
    temporaries fit ``budget`` a device; 0 where none does."""
    length, fits = start, 0
    while length <= LONGEST and step_temp_bytes(cp, length) <= budget:
        fits, length = length, length * 2
    return fits


def step_section(temps: dict[tuple[int, int], int], longest: dict[int, int], start: int, budget: int) -> str:
    """The section's model-step part, from what was measured: temporaries (``(cp, length)``:
    bytes) against length and ``cp`` (with their ratio to the first ``cp``'s), then the longest
    sequence (from ``start``) whose step fits ``budget`` a device."""
    cps, lengths = sorted({cp for cp, _ in temps}), sorted({n for _, n in temps})
    mb = lambda b: f"{b / 2**20:,.2f}"
    head = "| sequence | " + " | ".join(f"cp {cp} MB (÷ cp {cps[0]})" for cp in cps) + " |\n|---|"
    rows = []
    for n in lengths:
        cells = [f"{mb(temps[cp, n])} ({temps[cp, n] / temps[cps[0], n]:.3f})" for cp in cps]
        rows.append(f"| {n:,} | " + " | ".join(cells) + " |")
    fits = lambda n: f"{n:,}" if n else f"< {start:,}"
    return (
        "The GPT preset's train step (`tiny`: 2 layers, d 64, 4 query heads, 2 kv heads; AdamW; one "
        "sequence a step), its sequence split over `cp` devices of `context` as `fsdp-tp train "
        "--mesh context=cp` runs it (ring, balanced); temporary bytes a device of the compiled "
        "step:\n\n"
        + head
        + "---:|" * len(cps)
        + "\n"
        + "\n".join(rows)
        + f"\n\nThe longest sequence (a power of two, up to {LONGEST:,}) whose step's temporaries fit "
        f"{budget // 2**20} MiB a device:\n\n| | "
        + " | ".join(f"cp {cp}" for cp in cps)
        + " |\n|---|"
        + "---:|" * len(cps)
        + "\n| longest sequence whose step fits | "
        + " | ".join(fits(longest[cp]) for cp in cps)
        + " |\n"
    )

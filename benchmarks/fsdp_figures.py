"""Exact memory and communication figures of one FSDP train step, library vs the tutorial style.

    python -m benchmarks.fsdp_figures

Prints, for a 3-layer MLP on 8 simulated CPU devices (meshes 1x8 and 2x4), the per-device
bytes of params + AdamW state against the ideal, and the collective wire bytes per device
per step against the minimum (DESIGN.md, "Measuring"). All figures are exact and
deterministic; no timings.
"""

from __future__ import annotations

import fsdp_tp

fsdp_tp.simulate_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fsdp_tp.bench.baselines import tutorial_sync_gradients  # noqa: E402
from fsdp_tp.analysis import (  # noqa: E402
    collective_summary,
    ideal_bytes_per_device,
    parse_collectives,
    state_bytes_per_device,
)

AXES = ("data", "fsdp")


def measure(shape, check_vma, sync):
    mesh = fsdp_tp.make_mesh({"data": shape[0], "fsdp": shape[1]})
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=1024)
    model = nn.Sequential([dense(1024), nn.gelu, dense(1024), nn.gelu, dense(256)])
    tx = optax.adamw(1e-3)
    x = jnp.ones((64, 512))

    def init_fn(rng, x):
        return fsdp_tp.TrainState.create(
            apply_fn=model.apply, params=model.init(rng, x)["params"], tx=tx, rng=rng
        )

    def step_fn(state, x):
        grads = jax.grad(lambda p: (model.apply({"params": p}, x) ** 2).mean())(state.params)
        return state.apply_gradients(grads=sync(grads, AXES)), ()

    state, specs = fsdp_tp.init_sharded(
        init_fn, mesh, (P(), P(AXES)), jax.random.key(0), x, check_vma=check_vma
    )
    tree = (state.params, state.opt_state)
    held, ideal = max(state_bytes_per_device(tree).values()), ideal_bytes_per_device(tree)
    step = fsdp_tp.shard_step(step_fn, mesh, specs, P(AXES), check_vma=check_vma)
    summary = collective_summary(parse_collectives(step.lower(state, x).compile().as_text()))
    wire = sum(v["wire_bytes"] for v in summary.values())
    leaves = jax.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, nn.Partitioned))
    sharded = sum(v.value.nbytes for v in leaves if isinstance(v, nn.Partitioned))
    replicated = sum(v.nbytes for v in leaves if not isinstance(v, nn.Partitioned))
    nd, nf = shape
    n = nd * nf
    minimum = 2 * (nf - 1) / nf * sharded + 2 * (nd - 1) / nd * sharded / nf + 2 * (n - 1) / n * replicated
    return held, ideal, wire, minimum


def main():
    print("| mesh | check_vma | sync | state bytes/device | / ideal | wire bytes/step | / minimum |")
    print("|---|---|---|---:|---:|---:|---:|")
    for shape in [(1, 8), (2, 4)]:
        for check_vma in (True, False):
            for name, sync in (("fsdp_tp", fsdp_tp.sync_gradients), ("tutorial", tutorial_sync_gradients)):
                held, ideal, wire, minimum = measure(shape, check_vma, sync)
                print(
                    f"| {shape[0]}x{shape[1]} | {check_vma} | {name} | {held:,} | {held / ideal:.3f} "
                    f"| {wire:,.0f} | {wire / minimum:.3f} |"
                )


if __name__ == "__main__":
    main()

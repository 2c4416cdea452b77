"""Whether a run fits a device: its plan (state, gradients, activations), the memory a device
has, and the fastest remat policy that fits.

The plan is one abstract trace of the init and of one device's step, that step compiled for
one local device with its collectives as stand-ins (``make_plan``), so it holds on meshes
of any size; remat changes what the step holds, so each policy has its own activation figure.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from ..context import all_to_all_bytes, ring_bytes, ring_or_all_to_all
from ..plan import Plan, make_plan
from ..recipe.batches import batch_loss, split_windows
from ..recipe.throughput import memory_stats
from ..recipe.trainer import Settings, sharded_gpt
from .checks import UsageError

__all__ = [
    "HEADROOM",
    "abstract_mesh",
    "check_fits",
    "choose_remat",
    "context_plan_text",
    "memory_per_device",
    "mib",
    "plan_of",
    "print_plan",
    "tp_plan_text",
]

# --remat auto keeps this fraction of a device's memory for what the plan does not count:
# the optimizer update's temporaries, the compiler's differences between the stand-in
# program and the real one, and the allocator's slack.
HEADROOM = 0.25
# Fastest first: recomputing nothing, then only what is not a weight matmul, then everything.
_FASTEST_FIRST = ("none", "dots", "full")


def plan_of(settings: Settings, mesh) -> Plan:
    """What each device of ``mesh`` (or an ``AbstractMesh``) holds: parameters, optimizer state,
    and the activations one step keeps for its backward pass."""
    config = settings.model
    model = sharded_gpt(settings, dict(mesh.shape), settings.optimizer())
    ids = jax.ShapeDtypeStruct((settings.batch, config.seq_len), np.int32)
    # One microbatch's activations are alive at a time (accumulate_gradients).
    rows = settings.batch // settings.microbatches
    windows = jax.ShapeDtypeStruct((rows, config.seq_len + 1), np.int32)
    steps_batch = jax.eval_shape(lambda w: split_windows(settings, w), windows)  # (as the step's)
    batch = settings.batch_specs()
    return make_plan(
        model.init_fn,
        mesh,
        (P(), P(settings.batch_axes)),
        jax.random.key(0),
        ids,
        check_vma=settings.check_vma,
        loss_fn=lambda params, batch: batch_loss(model, params, batch, settings.step_axes),
        batch=steps_batch,
        batch_specs=batch,
        sequence=settings.sequence,
    )


def abstract_mesh(sizes: dict) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def print_plan(settings: Settings, sizes: dict, out: TextIO) -> None:
    """The plan on an abstract mesh of ``sizes``: no devices needed, any size. Under
    ``--remat auto`` the table is ``full``'s, and each policy's activations follow it (which
    one ``train`` takes depends on the device's memory)."""
    mesh = abstract_mesh(sizes)
    if settings.model.remat != "auto":
        plan = plan_of(settings, mesh)
        print(plan, file=out)
    else:  # (the table is full's, and so is its wire: full re-gathers in the backward pass)
        plan, settings = _print_remat_plans(settings, mesh, out), _with_remat(settings, "full")
    if sizes.get("fsdp", 1) > 1:
        print(fsdp_wire_line(plan, settings), file=out)
    if settings.model.experts:
        from .experts import moe_plan_text

        print(moe_plan_text(settings, sizes, plan), file=out)
    elif sizes.get("tensor", 1) > 1:
        print(tp_plan_text(settings, sizes), file=out)
    if settings.sequence is not None:
        print(context_plan_text(plan, settings, sizes), file=out)


def context_plan_text(plan: Plan, settings: Settings, sizes: dict) -> str:
    """What attention across ``context`` sends a device per layer, by the formulas
    (:func:`~fsdp_tp.context.ring_bytes`, :func:`~fsdp_tp.context.all_to_all_bytes`), and the
    step's program's own collectives over the axis against them: a microbatch's, each layer's
    forward once, or twice where remat recomputes it."""
    config, split = settings.model, settings.sequence
    assert split is not None
    size, tensor = sizes[split.axis], sizes.get("tensor", 1)
    rows = (
        settings.batch
        // settings.microbatches
        // int(np.prod([sizes.get(a, 1) for a in settings.batch_axes]))
    )
    heads, kv_heads = config.num_heads // tensor, config.num_kv_heads // tensor
    strategy = ring_or_all_to_all(heads, kv_heads, size) if split.strategy == "auto" else split.strategy
    shape = (rows, config.seq_len)
    if strategy == "ring":
        forward, backward = ring_bytes(*shape, kv_heads, config.head_dim, size, config.dtype)
        kind, formula = "collective-permute", "2(n-1)/n·B·S·G·D·b, as all-gathering K and V"
        back = "K and V again, and their gradients' n hops home: + 2·B·S·G·D·b_acc"
    else:
        forward, backward = all_to_all_bytes(*shape, heads, kv_heads, config.head_dim, size, config.dtype)
        kind, formula = "all-to-all", "2(n-1)/n²·B·S·D·(H+G)·b: q, k, v and the output"
        back = "the same all-to-alls reversed"
    layers = config.num_layers
    sent = round((plan.wire or {}).get(split.axis, {}).get(kind, 0))
    runs = {n: layers * (n * forward + backward) for n in (1, 2)}
    said = next((n for n, total in runs.items() if total == sent), None)
    program = f"the step's program sends {sent:,} B of {kind} over {split.axis}" + (
        f" = {layers} layers x (forward{' twice: remat recomputes it' if said == 2 else ''} + backward)"
        if said
        else f"; {layers} layers x (forward + backward) are {runs[1]:,} B: it sends what the formula omits"
    )
    layout = "balanced" if split.balanced else "contiguous"
    return (
        f"{split.axis}={size}: attention across it by {strategy} ({layout} split), B={rows} sequences of "
        f"S={config.seq_len} tokens, H={heads} heads and G={kv_heads} kv heads of D={config.head_dim} a "
        f"device; per layer and device, forward {forward:,} B ({formula}), backward {backward:,} B ({back}); "
        f"{program}"
    )


def tp_plan_text(settings: Settings, sizes: dict) -> str:
    """Megatron's plan of the model over ``tensor``, found from what it computes, as the tp
    rules a user would write: the rules an ``--api nnx`` run computes with, the plan the Linen
    GPT's own layers compute."""
    tensor = sizes["tensor"]
    # (what a model computes is the same under every remat policy: auto's choice does not matter)
    config = _with_remat(settings, "full").model if settings.model.remat == "auto" else settings.model
    if settings.api == "nnx":
        from ..recipe.nnx_gpt import run_plan
        from ..recipe.trainer import nnx_schedule

        plan, found = run_plan(config, sizes, *nnx_schedule(settings, sizes))
        if not found:  # (the roles refuse it at init, with the sizes and the fix)
            return (
                f"tensor={tensor}: the rules this run computes with, the GPT's hand-written ones "
                f"(models.nnx_transformer.tp_rules): Megatron's plan found from what the model computes "
                f"leaves a block whole:\n{plan}"
            )
        where = "fsdp_tp.nnx.find_tp_rules: the rules this run computes with"
    else:
        from ..linen.auto_rules import find_tp_rules

        ids = jax.ShapeDtypeStruct((1, config.seq_len), np.int32)
        reference = dataclasses.replace(config, attention="reference")  # (as found_plan's)
        plan = find_tp_rules(reference.model(), ids, size=tensor, outputs_split=True)
        where = "fsdp_tp.linen.find_tp_rules: the plan the Linen GPT's layers compute"
    return f"tensor={tensor}: Megatron's plan, found from what the model computes ({where}):\n{plan}"


def fsdp_wire_line(plan: Plan, settings: Settings) -> str:
    """FSDP's wire per split parameter element, the figure of ``docs/benchmarks.md``'s table
    (there read off the lowered step, here off the plan's per-device program)."""
    policy = settings.layout.mixed_precision
    gather, reduce = (jnp.float32,) * 2 if policy is None else (policy.gather_dtype, policy.reduce_dtype)
    names = lambda dtype: jnp.dtype(dtype).name
    figure = plan.per_split_element("fsdp")
    return (
        f"FSDP over fsdp={plan.mesh['fsdp']}: "
        + ("not counted" if figure is None else f"{figure:.3f} B")
        + f" per split parameter element per step ({names(gather)} gathers, {names(reduce)} "
        f"reduce-scatters, remat {settings.model.remat}; a ring over N devices moves (N-1)/N of an array)"
    )


def _print_remat_plans(settings: Settings, mesh, out: TextIO) -> Plan:
    plans = {policy: plan_of(_with_remat(settings, policy), mesh) for policy in _FASTEST_FIRST}
    print(plans["full"], file=out)
    each = ", ".join(f"{policy} {plans[policy].activation_bytes:,} B" for policy in _FASTEST_FIRST)
    print(f"activations per device by --remat: {each}; train's auto takes the first that fits", file=out)
    return plans["full"]


def _with_remat(settings: Settings, policy: str) -> Settings:
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, remat=policy))


def mib(n: int) -> str:
    """``n`` bytes in MiB, for messages."""
    return f"{n / 2**20:,.2f} MiB"


def memory_per_device(sharing: int | None = None) -> tuple[int, str] | None:
    """Bytes one device may use, and where the figure comes from; ``None`` where nobody says.

    Accelerators report ``bytes_limit``; the CPU backend reports nothing, but its simulated
    devices share the host's memory, so each gets the host's RAM over ``sharing`` devices (the
    local device count unless given: the accelerator bench uses one).
    """
    device = jax.local_devices()[0]
    stats = memory_stats()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    if device.platform == "cpu":
        sharing = sharing or jax.local_device_count()
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram // sharing, "host RAM" + (f" / {sharing} devices" if sharing > 1 else "")
    return None


def needed_bytes(plan: Plan) -> int:
    """State, gradients (the parameters' size), activations and temporaries, per device."""
    return plan.total_bytes + plan.param_bytes + (plan.activation_bytes or 0)


_FIX = "use a smaller model or batch, --remat full, more --microbatches or more devices"


def check_fits(
    plan: Plan, what: str = "the run", states: int = 1, sharing: int | None = None, fix: str = _FIX
) -> None:
    """Refuses a run whose state, gradients and saved activations exceed a device's memory
    (before the init would allocate them and the kernel or the allocator kill the process).
    ``states``: how many states of this size are alive at once (the accelerator bench holds the
    library's, one per gather precision, and plain flax's); ``sharing``: see
    ``memory_per_device``; ``fix``: the flags that help."""
    limit = memory_per_device(sharing)
    needed = needed_bytes(plan) + (states - 1) * plan.total_bytes
    activations = f" + activations {mib(plan.activation_bytes)}" if plan.activation_bytes else ""
    state = f"state {mib(plan.total_bytes)}" + (
        f" x {states} (the library's and plain flax's)" if states > 1 else ""
    )
    if limit is not None and needed > limit[0]:
        raise UsageError(
            f"{what} needs at least {mib(needed)} per device ({state} + gradients "
            f"{mib(plan.param_bytes)}{activations}), more than the {mib(limit[0])} available "
            f"({limit[1]}); {fix}."
        )


def choose_remat(settings: Settings, mesh) -> tuple[Settings, Plan]:
    """``--remat auto``: the fastest policy whose plan leaves ``HEADROOM`` of a device's memory
    free (``full`` if none does; ``check_fits`` then judges it). Settings with it, and its plan."""
    limit = memory_per_device()
    for policy in _FASTEST_FIRST:
        chosen = _with_remat(settings, policy)
        plan = plan_of(chosen, mesh)
        if limit is None or needed_bytes(plan) <= (1 - HEADROOM) * limit[0]:
            break
    return chosen, plan

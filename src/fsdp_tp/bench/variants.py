"""Strategies and implementations: each variant is a compiled train step with its state.

A *strategy* fixes the mesh and the layout; an *implementation* fixes how the step is
written: ``fsdp_tp`` (this library: ``shard_map`` + ``sync_gradients``), ``gspmd``
(``jax.jit`` of the plain flax twin with ``NamedSharding``s of the same specs, what
MaxText-style code does), ``tutorial`` (the same sharded modules under
``check_vma=False`` with the well-known tutorial's blind pmean), ``single`` (one device),
and ``per_device_update`` (the library's step as the first version ran it: the optax
update inside ``shard_map`` on each device's shards; right only for element-wise
transforms, kept to measure what the update on global arrays costs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..gradients import sync_gradients
from ..mesh import make_mesh
from ..models import Layout
from ..partitioning import flat_specs_of, specs_of
from ..sharded_init import init_sharded
from ..train import shard_step, state_init_fn
from .baselines import tutorial_sync_gradients
from .workloads import Workload, bench_layout

__all__ = ["IMPLEMENTATIONS", "STRATEGIES", "Strategy", "Variant", "build_variant", "plain_flax_build"]

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
GLOBAL_BATCH = 64


@dataclass(frozen=True)
class Strategy:
    name: str
    mesh: dict  # axis sizes over 8 devices
    layout: Layout


STRATEGIES = {
    s.name: s
    for s in [
        Strategy("single", {"data": 1, "fsdp": 1, "tensor": 1}, Layout()),
        Strategy("dp", {"data": 8, "fsdp": 1, "tensor": 1}, Layout()),
        Strategy("fsdp", {"data": 1, "fsdp": 8, "tensor": 1}, bench_layout(fsdp="fsdp")),
        Strategy("tp", {"data": 1, "fsdp": 1, "tensor": 8}, bench_layout(tensor="tensor")),
        Strategy("fsdp_tp", {"data": 1, "fsdp": 4, "tensor": 2}, bench_layout(tensor="tensor", fsdp="fsdp")),
        Strategy(
            "fsdp_tp_sp",
            {"data": 1, "fsdp": 4, "tensor": 2},
            bench_layout(tensor="tensor", fsdp="fsdp", sequence_parallel=True),
        ),
        Strategy(
            "async_tp",
            {"data": 1, "fsdp": 4, "tensor": 2},
            bench_layout(
                tensor="tensor", fsdp="fsdp", sequence_parallel=True, collective_matmul="bidirectional"
            ),
        ),
    ]
}
IMPLEMENTATIONS = ("fsdp_tp", "gspmd", "tutorial")


@dataclass
class Variant:
    """One compiled step, ready to run: ``state, loss = step(state, batch)``."""

    workload: str
    strategy: Strategy
    implementation: str
    mesh: Mesh
    state: Any
    step: Any  # a jitted function: called, and lowered for its HLO and memory
    batch: tuple
    sharded_model: nn.Module  # the module whose tree (and boxes) the specs came from

    @property
    def label(self) -> str:
        return f"{self.strategy.name}/{self.implementation}"

    def lowered(self):
        return self.step.lower(self.state, self.batch)


def _mesh(strategy: Strategy) -> Mesh:
    if math.prod(strategy.mesh.values()) == 1:
        devices = np.array(jax.devices()[:1]).reshape(1, 1, 1)
        return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * 3)
    return make_mesh(strategy.mesh)


def _library_step(workload: Workload, layout: Layout, sync: Callable) -> Callable:
    def step(state, batch):
        x, y = batch

        def loss_fn(params):
            return workload.loss(state.apply_fn({"params": params}, x), y, layout.tensor)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return sync(grads, BATCH_AXES), jax.lax.pmean(loss, BATCH_AXES)

    return step


def _per_device_update_step(workload: Workload, layout: Layout) -> Callable:
    grads_of = _library_step(workload, layout, sync_gradients)

    def step(state, batch):
        grads, loss = grads_of(state, batch)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

    return step


def _twin_step(workload: Workload) -> Callable:
    def step(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: workload.loss(state.apply_fn({"params": p}, x), y, None))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    return step


def _leaf_shardings(state, mesh: Mesh) -> list[NamedSharding]:
    """The sharding of each array leaf of ``state``, from its spec, in ``jax.tree.leaves`` order."""
    return [NamedSharding(mesh, spec) for spec in flat_specs_of(state)]


def _placed(state, mesh: Mesh):
    """An abstract state whose leaves carry their specs' shardings, as a real state's do: the
    step then compiles for the layouts a run has (an unplaced leaf's layout is XLA's guess)
    and reuses the donated state's buffers."""
    placed = [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        for leaf, sharding in zip(jax.tree.leaves(state), _leaf_shardings(state, mesh), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(state), placed)


def build_variant(
    workload: Workload,
    strategy: Strategy,
    implementation: str,
    model=None,
    abstract: bool = False,
    tx: optax.GradientTransformation | None = None,
) -> Variant:
    """Initializes the state (directly into its shardings) and compiles-on-call the step.

    ``model`` replaces the workload's builder (e.g. a deeper GPT for compile-time figures);
    ``abstract=True`` (library only) keeps the state as shapes and shardings: enough to
    lower and compile the step, without running the init. ``tx``: the optimizer (AdamW
    by default).
    """
    build = model or workload.build
    mesh, layout = _mesh(strategy), strategy.layout
    twin, sharded = build(Layout()), build(layout)
    tx = optax.adamw(1e-3) if tx is None else tx
    x, y = workload.batch(GLOBAL_BATCH)
    batch_spec = P(BATCH_AXES)
    rng = jax.random.key(0)
    check_vma = implementation != "tutorial"
    init = functools.partial(
        init_sharded,
        state_init_fn(sharded, tx),
        mesh,
        (P(), batch_spec),
        twin_init_fn=state_init_fn(twin, tx),
        check_vma=check_vma,
    )
    # GSPMD and one device only need the library's specs: the library's state stays abstract.
    if abstract or implementation == "gspmd" or strategy.name == "single":
        state = jax.eval_shape(lambda r, x: init(r, x)[0], rng, x)
        specs = specs_of(state)
    else:
        state, specs = init(rng, x)
    if abstract:
        state = _placed(state, mesh)
    batch = jax.device_put((x, y), NamedSharding(mesh, batch_spec))
    if implementation == "gspmd" or strategy.name == "single":
        twin_state = jax.eval_shape(state_init_fn(twin, tx), rng, x)
        shardings = jax.tree.unflatten(jax.tree.structure(twin_state), _leaf_shardings(state, mesh))
        state = jax.jit(state_init_fn(twin, tx), out_shardings=shardings)(rng, x)
        jitted = jax.jit(
            _twin_step(workload),
            in_shardings=(shardings, NamedSharding(mesh, batch_spec)),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )
        name = "single" if strategy.name == "single" else implementation
        return Variant(workload.name, strategy, name, mesh, state, jitted, batch, sharded)
    if implementation == "per_device_update":
        per_device = jax.shard_map(
            _per_device_update_step(workload, layout),
            mesh=mesh,
            in_specs=(specs, (batch_spec, batch_spec)),
            out_specs=(specs, P()),
            check_vma=check_vma,
        )
        per_device_step = jax.jit(per_device, donate_argnums=0)
        return Variant(workload.name, strategy, implementation, mesh, state, per_device_step, batch, sharded)
    sync = tutorial_sync_gradients if implementation == "tutorial" else sync_gradients
    step = shard_step(
        _library_step(workload, layout, sync), mesh, specs, (batch_spec, batch_spec), check_vma=check_vma
    )
    return Variant(workload.name, strategy, implementation, mesh, state, step, batch, sharded)


def plain_flax_build(workload: Workload, model=None) -> Any:
    """What a plain flax script does on one device: the twin's init under ``jax.jit`` and its
    train step compiled. Returns the compiled step (the reference for build times)."""
    twin = (model or workload.build)(Layout())
    x, y = workload.batch(GLOBAL_BATCH)
    state = jax.jit(state_init_fn(twin, optax.adamw(1e-3)))(jax.random.key(0), x)
    return jax.jit(_twin_step(workload)).lower(state, (x, y)).compile()

"""The optimizer runs on global arrays, never on one device's shards.

Inside ``jax.shard_map`` an optax transform sees only this device's block of each leaf.
Any transform that reduces over a leaf (trust ratios: LAMB, LARS), across leaves
(``clip_by_global_norm``) or over rows and columns (Adafactor's factored moments) then
computes on the wrong numbers, with no error. So the library keeps only the forward and
backward pass per device; ``tx.init`` and ``tx.update`` run under ``jax.jit`` on global
arrays laid out by the state's specs, and XLA inserts exactly the reductions a transform
needs: none for an element-wise one, all-reduces of scalars for a global norm (one on an
FSDP mesh; ``tests/test_optimizers.py`` counts them).

This module holds the two halves of that rule:

- at init, every :class:`~flax.training.train_state.TrainState` built per device gets its
  optimizer state from ``tx.init`` on the *global* parameters (:func:`with_optimizer_state`;
  the per-device trace drops the one it built, :func:`without_optimizer_state`). Each
  optimizer leaf is split like its parameter where that fits (Adam's moments); a leaf whose
  shape is not the parameter's (a factored row or column) stays whole;
- in the step, an update asked for on shards is refused (:func:`refuse_on_shards`);
- in a plan, the bytes that global optimizer state holds on a device (:func:`optimizer_state_bytes`).

>>> import jax, jax.numpy as jnp, optax
>>> from fsdp_tp import TrainState, make_mesh
>>> from fsdp_tp.sharded_init import init_sharded
>>> from jax.sharding import PartitionSpec as P
>>> import flax.linen as nn
>>> def init_fn(rng):  # each device holds an (8, 8) block of a (64, 8) kernel split over fsdp
...     params = {"w": nn.Partitioned(jnp.ones((8, 8)), ("fsdp", None))}
...     return TrainState.create(apply_fn=None, params=params, rng=rng,
...                              tx=optax.adafactor(1e-2, min_dim_size_to_factor=4))
>>> state, specs = init_sharded(init_fn, make_mesh({"fsdp": 8}), P(), jax.random.key(0))
>>> factored = state.opt_state[0]      # statistics of the global (64, 8) kernel, kept whole
>>> factored.v_row["w"].value.shape, factored.v_col["w"].value.shape, specs.opt_state[0].v_col
((8,), (64,), {'w': P()})
"""

from __future__ import annotations

import math

import jax
from flax.core.meta import Partitioned, unbox
from flax.training import train_state
from jax.sharding import PartitionSpec

from ._axes import entry_axes, varying_axes
from ._context import STEP
from ._trace.per_device import specs_of
from ._tree import first_difference, named_shardings
from ._types import PyTree
from .analysis import array_bytes
from .errors import OptimizerOnShardsError

__all__ = [
    "block_counts",
    "checked_tx",
    "lower_optimizer_state",
    "optimizer_layout",
    "optimizer_state_bytes",
    "optimizer_state_shapes",
    "per_device_step",
    "refuse_on_shards",
    "with_optimizer_state",
    "without_optimizer_state",
]


def _is_state(x) -> bool:
    return isinstance(x, train_state.TrainState)


def without_optimizer_state(fn):
    """``fn`` with every train state's ``opt_state`` in its output set to ``None``: what a
    per-device trace builds of the optimizer is thrown away, to be built globally."""

    def stripped(*args):
        drop = lambda x: x.replace(opt_state=None) if _is_state(x) else x
        return jax.tree.map(drop, fn(*args), is_leaf=_is_state)

    return stripped


def checked_tx(tx, caller: str):
    """``tx`` if it is an optax transformation (``init`` and ``update``), else a TypeError that
    names what was passed; an ``nnx.Optimizer`` is told to pass the transformation it wraps."""
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return tx
    if type(tx).__module__.startswith("flax.nnx"):  # nnx.Optimizer (or a subclass): model and tx
        raise TypeError(
            f"{caller}: got an nnx.Optimizer; pass the optax transformation it wraps "
            f"(optimizer.tx, e.g. optax.adamw(1e-3)): the sharded step applies it to the global "
            f"parameters and keeps its state in TrainState.opt_state, as nnx.Optimizer does."
        )
    raise TypeError(
        f"{caller}: tx must be an optax transformation (with init and update), e.g. optax.adamw(1e-3); "
        f"got {type(tx).__name__}."
    )


def optimizer_layout(tx, params: PyTree, mesh) -> tuple[PyTree, PyTree]:
    """``(abstract, specs)`` of ``tx.init(params)`` on the global ``params`` (boxed arrays or
    shape structs): each leaf laid out as ``specs_of(..., mesh)`` says, like its parameter
    where that fits, else whole. The one answer the init builds and the plan counts."""
    abstract = jax.eval_shape(tx.init, params)
    return abstract, specs_of(abstract, mesh)


def _init_program(state, mesh):
    """``tx.init`` of the state's optimizer under ``jax.jit``, laid out by :func:`optimizer_layout`."""
    _, specs = optimizer_layout(state.tx, state.params, mesh)
    return jax.jit(state.tx.init, out_shardings=named_shardings(specs, mesh))


def with_optimizer_state(tree: PyTree, mesh) -> PyTree:
    """Every train state in ``tree`` with ``opt_state = tx.init(params)`` computed on the global
    parameters (see :func:`_init_program`)."""
    init = lambda s: s.replace(opt_state=_init_program(s, mesh)(s.params)) if _is_state(s) else s
    return jax.tree.map(init, tree, is_leaf=_is_state)


def optimizer_state_shapes(tree: PyTree, mesh) -> PyTree:
    """:func:`with_optimizer_state` of ``tree``'s shapes (shape structs with their shardings):
    each train state's ``opt_state`` as the shapes and shardings it would have, nothing run."""
    shaped = lambda s: s.replace(opt_state=jax.eval_shape(_init_program(s, mesh), s.params))
    return jax.tree.map(lambda s: shaped(s) if _is_state(s) else s, tree, is_leaf=_is_state)


def lower_optimizer_state(tree: PyTree, mesh) -> list[jax.stages.Lowered]:
    """The programs :func:`with_optimizer_state` runs for ``tree`` (arrays, or shape structs
    with their shardings), lowered, to measure them."""
    states = [s for s in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(s)]
    return [_init_program(s, mesh).lower(s.params) for s in states]


def per_device_step(step_fn, model_state: tuple[str, ...] = ()):
    """``step_fn(state, batch) -> (grads, metrics)`` checked, or ``(grads, metrics,
    model_state)`` where the state holds the collections ``model_state`` names: it runs with
    updates refused, and its grads must have the parameters' structure."""
    expected_out = "(grads, metrics, model_state)" if model_state else "(grads, metrics)"

    def run(state, batch):
        with STEP.scoped(per_device=True):
            out = step_fn(state, batch)
        if not (isinstance(out, tuple) and len(out) == (3 if model_state else 2)):
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            held = (
                f"The state holds model_state {list(model_state)}: return it as the model's apply gave "
                f"it back (mutable={list(model_state)}), the same on every device: averaged with "
                f"batch_mean(..., batch_axes) unless the model syncs it itself (BatchNorm(axis_name=...))."
                if model_state
                else "The state holds no model_state (TrainState.model_state is empty): return "
                "(grads, metrics), or create the state with the model's other collections."
            )
            raise TypeError(
                f"shard_step: step_fn must return {expected_out}, got {got}. {held} The gradients "
                f"are those of state.params, synced; the optimizer update then runs on global arrays."
            )
        grads = out[0]
        if where := first_difference(state.params, grads):
            got = f"a {type(grads).__name__}" if _is_state(grads) else "a tree that differs from it"
            raise TypeError(
                f"shard_step: step_fn's first output must be the gradients of state.params (same "
                f"tree, boxes included), got {got} ({where}). Return "
                f"(sync_gradients(grads, batch_axes), metrics), not a new state: shard_step applies "
                f"the optimizer on global arrays."
            )
        return out

    return run


def refuse_on_shards(params: PyTree) -> None:
    """Raises :class:`~fsdp_tp.errors.OptimizerOnShardsError` where an update would see only
    this device's shards: inside :func:`~fsdp_tp.shard_step`'s per-device function, or
    under ``jax.shard_map`` with a parameter that varies across devices."""
    varying = sorted({str(a) for leaf in jax.tree.leaves(params) for a in varying_axes(leaf)})
    reasons = ["inside shard_step's step_fn"] if STEP.get().per_device else []
    reasons += [f"its parameters vary over mesh axes {varying}"] if varying else []
    if not reasons:
        return
    where = "; ".join(reasons)
    raise OptimizerOnShardsError(
        f"apply_gradients was called on one device's shards ({where}): an optax transform that "
        f"reduces over a leaf, across leaves or over rows (clip_by_global_norm, LAMB, LARS, "
        f"Adafactor) would give a wrong update there, silently. Return (grads, metrics) from the "
        f"per-device step and let fsdp_tp.shard_step apply the optimizer on global arrays."
    )


def block_counts(spec: PartitionSpec, ndim: int, mesh: dict) -> list[int]:
    """Into how many blocks each of ``ndim`` dims is split."""
    return [int(math.prod(mesh[a] for a in entry_axes(e))) for e in spec] + [1] * (ndim - len(spec))


def _global(struct, spec: PartitionSpec, mesh: dict[str, int]):
    """The global leaf of a local one, boxed with its spec's names where it is split."""
    parts = block_counts(spec, len(struct.shape), mesh)
    full = jax.ShapeDtypeStruct(tuple(n * p for n, p in zip(struct.shape, parts, strict=True)), struct.dtype)
    return Partitioned(full, tuple(spec) + (None,) * (len(struct.shape) - len(spec))) if len(spec) else full


def optimizer_state_bytes(tx, params, pspecs, mesh: dict[str, int], abstract_mesh) -> int:
    """Per-device bytes of the optimizer state the init builds: ``tx.init`` on the *global*
    parameters, each leaf split as :func:`~fsdp_tp._optimizer.optimizer_layout` says (the
    per-device trace's own ``opt_state`` is the state of a block: a factored moment's rows
    would be a block's rows)."""
    is_spec = lambda x: isinstance(x, PartitionSpec)
    boxed = jax.tree.map(lambda s, spec: _global(s, spec, mesh), params, pspecs, is_leaf=is_spec)
    abstract, specs = optimizer_layout(tx, boxed, abstract_mesh)
    leaves = jax.tree.leaves(unbox(abstract))
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    return sum(
        array_bytes(x) // math.prod(block_counts(spec, len(x.shape), mesh))
        for x, spec in zip(leaves, flat_specs, strict=True)
    )

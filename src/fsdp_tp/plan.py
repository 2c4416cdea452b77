"""The sharding plan: what each device will hold, read off an abstract trace of the init.

Nothing is allocated and nothing runs: the init is traced per device under
``jax.shard_map`` with ``jax.eval_shape``, so the mesh may be an
``AbstractMesh`` far larger than the machine (64 x 8 devices planned on a laptop).
Given a loss, one device's step is also compiled, not run, for one local device
(:mod:`fsdp_tp.analysis._step_memory`), for the memory its activations and temporaries take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ._axes import entry_axes
from ._optimizer import block_counts, optimizer_state_bytes
from ._sequence_split import SequenceSplit
from ._trace.per_device import trace_per_device
from ._tree import path_of
from ._types import Specs
from .analysis import array_bytes
from .analysis._step_memory import temp_bytes
from .analysis._step_wire import step_wire, wire_lines
from .train import as_a_step
from .train._sequence_layout import LaidOut, step_split

__all__ = ["Plan", "PlanRow", "make_plan"]


@dataclass(frozen=True)
class PlanRow:
    path: str
    shape: tuple[int, ...]  # global
    dtype: str
    spec: PartitionSpec
    bytes_per_device: int
    note: str = ""  # why a large parameter stayed whole


@dataclass(frozen=True)
class Plan:
    mesh: dict[str, int]
    rows: tuple[PlanRow, ...]  # the parameters
    param_bytes: int  # per device
    optimizer_bytes: int  # per device
    other_bytes: int  # per device: step counter, rng, ...
    # Per device: what one step's forward and backward hold beyond the state and the gradients
    # (the activations kept for the backward pass, recomputation, XLA's temporaries); None
    # without a loss_fn, or where the backend reports no memory analysis.
    activation_bytes: int | None = None
    replicated: tuple[PlanRow, ...] = field(default=())
    # Per device, the bytes of one step's forward and backward (fsdp_tp.analysis._step_wire.step_wire):
    # {axes: {kind: bytes}}; None without a loss_fn or where uncounted (wire_note says why).
    wire: Mapping[str, Mapping[str, float]] | None = None
    wire_note: str = ""

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes + self.other_bytes

    def per_split_element(self, axis: str) -> float | None:
        """FSDP's wire per parameter element, for the axis FSDP splits over: the bytes a device
        sends over ``axis`` alone per step, per element of the parameters split over it as one
        ``axis`` group gathers them (a tensor-split parameter: its slice); else None."""
        elements = sum(
            r.bytes_per_device // jax.numpy.dtype(r.dtype).itemsize * self.mesh[axis]
            for r in self.rows
            if any(axis in entry_axes(e) for e in r.spec)
        )
        if self.wire is None or not elements:
            return None
        return sum(self.wire.get(axis, {}).values()) / elements

    def __str__(self) -> str:
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh.items())
        head = ("parameter", "global shape", "dtype", "spec", "bytes/device")
        body = [
            (r.path, str(r.shape), r.dtype, _spec_str(r.spec), f"{r.bytes_per_device:,}") for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        line = lambda row: "  ".join(
            c.rjust(w) if i == 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        out = [
            f"mesh {mesh} ({math.prod(self.mesh.values())} devices)",
            line(head),
            line(["-" * w for w in widths]),
        ]
        out += [line(row) for row in body]
        act = "not estimated" if self.activation_bytes is None else f"{self.activation_bytes:,}"
        out += [
            "",
            f"per device: params {self.param_bytes:,} B, optimizer state {self.optimizer_bytes:,} B, "
            f"other {self.other_bytes:,} B, total {self.total_bytes:,} B",
            f"activations and temporaries of one step, per device: {act}",
        ]
        out += wire_lines(self.wire, self.wire_note)
        if self.replicated:
            out.append(f"replicated on every device ({len(self.replicated)}):")
            out += [f"  {r.path} {r.shape}: {r.note}" for r in self.replicated]
        return "\n".join(out)


def _spec_str(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _leaves(local, specs):
    is_spec = lambda x: isinstance(x, PartitionSpec)
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    flat_local = jax.tree_util.tree_flatten_with_path(local)[0]
    return [(path_of(p), s, spec) for (p, s), spec in zip(flat_local, flat_specs, strict=True)]


def _why_whole(shape, mesh: dict[str, int]) -> str:
    sizes = sorted({s for s in mesh.values() if s > 1})
    if not any(n % s == 0 for n in shape for s in sizes):
        return f"no dim divisible by a mesh axis size {sizes}"
    return (
        "not split by the model: at most min_weight_size, outside any sharding transform, or no rule names it"
    )


def make_plan(
    init_fn: Callable,
    mesh,
    in_specs: Specs,
    *args,
    check_vma: bool = True,
    loss_fn: Callable | None = None,
    batch: Any = None,
    batch_specs: Specs = None,
    sequence: SequenceSplit | None = None,
) -> Plan:
    """The plan of ``init_fn``'s state on ``mesh`` (a ``Mesh`` or an ``AbstractMesh``).

    ``init_fn(*args)`` builds the state per device, as for
    :func:`~fsdp_tp.init_sharded`; a state with ``.params`` and ``.opt_state``
    (a :class:`~fsdp_tp.TrainState`) is split into parameters and optimizer
    state. With ``loss_fn(params, batch)`` (a per-device scalar loss), one device's forward
    and backward are compiled for one local device, each collective replaced by a stand-in
    of its shapes (:mod:`fsdp_tp.analysis._step_memory`): ``activation_bytes`` is XLA's own figure for
    what the step holds beyond the state and the gradients, on a mesh of any size.
    ``args`` and ``batch`` may be ``jax.ShapeDtypeStruct``s of global shape. ``batch_specs``
    naming ``context`` on a sequence dim split the step's sequence as
    :func:`~fsdp_tp.shard_step`'s do, by ``sequence`` (its strategy, its balance) where given.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
    >>> from fsdp_tp import shard_module_params
    >>> mesh = AbstractMesh((64, 8), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    >>> model = shard_module_params(nn.Dense, min_weight_size=0)(4096)
    >>> plan = make_plan(lambda r, x: model.init(r, x)["params"], mesh, (P(), P()),
    ...                  jax.random.key(0), jax.ShapeDtypeStruct((8, 1024), jnp.float32))
    >>> [(r.path, r.shape, r.bytes_per_device) for r in plan.rows]
    [('bias', (4096,), 2048), ('kernel', (1024, 4096), 2097152)]
    """
    if not callable(init_fn):
        raise TypeError(
            f"make_plan: init_fn must be a function that builds the state, e.g. "
            f"fsdp_tp.state_init_fn(model, tx); got {init_fn!r} ({type(init_fn).__name__})."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"make_plan: loss_fn must be a function (params, batch) -> loss; got {loss_fn!r}.")
    step: dict = {}
    if loss_fn is None:
        traced = trace_per_device(init_fn, mesh, in_specs, args, check_vma=check_vma)
    else:
        loss: Callable = loss_fn
        split = step_split(batch_specs, dict(mesh.shape), sequence, where="make_plan")

        def with_step(inner_args, inner_batch):
            # One trace: the state, and one device's forward and backward on it.
            state = init_fn(*inner_args)
            params = state.params if hasattr(state, "params") else state
            tokens = (
                LaidOut(split, mesh.shape[split.axis], batch_specs).tokens(inner_batch) if split else None
            )
            with as_a_step(batch_specs, split, tokens):  # (traced as shard_step traces it)
                step["jaxpr"] = jax.make_jaxpr(jax.value_and_grad(loss))(params, inner_batch)
            return state

        traced = trace_per_device(
            with_step, mesh, (in_specs, batch_specs), (args, batch), check_vma=check_vma
        )
    local, specs = traced.local, traced.specs
    mesh_sizes = dict(mesh.shape)
    params, opt = (local.params, local.opt_state) if hasattr(local, "opt_state") else (local, None)
    pspecs, ospecs = (specs.params, specs.opt_state) if hasattr(specs, "opt_state") else (specs, None)
    rows = []
    for path, struct, spec in _leaves(params, pspecs):
        parts = block_counts(spec, len(struct.shape), mesh_sizes)
        shape = tuple(n * p for n, p in zip(struct.shape, parts, strict=True))
        whole = not any(entry_axes(e) for e in spec) and math.prod(shape) > 1
        rows.append(
            PlanRow(
                path,
                shape,
                str(struct.dtype),
                spec,
                array_bytes(struct),
                _why_whole(shape, mesh_sizes) if whole else "",
            )
        )
    param_bytes = sum(r.bytes_per_device for r in rows)
    traced_opt = sum(array_bytes(s) for _, s, _ in _leaves(opt, ospecs)) if opt is not None else 0
    # The init builds a train state's optimizer state globally (fsdp_tp._optimizer): count that.
    global_opt = opt is not None and hasattr(local, "tx")
    optimizer_bytes = (
        optimizer_state_bytes(local.tx, params, pspecs, mesh_sizes, mesh) if global_opt else traced_opt
    )
    other_bytes = sum(array_bytes(s) for _, s, _ in _leaves(local, specs)) - param_bytes - traced_opt
    activations = temp_bytes(step["jaxpr"]) if step else None
    wire, note = step_wire(step["jaxpr"], mesh_sizes) if step else (None, "")
    return Plan(
        mesh=mesh_sizes,
        rows=tuple(rows),
        param_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        other_bytes=other_bytes,
        activation_bytes=activations,
        replicated=tuple(r for r in rows if r.note),
        wire=wire,
        wire_note=note,
    )

"""A checkpoint straight into a sharded model's arrays: each process reads only the blocks its
own devices hold, converts them to the parameter's dtype on the way, and writes nothing to disk.

The target is the model's parameters as the library lays them out — :func:`~fsdp_tp.sharded_init
.abstract_init`'s shapes (nothing allocated yet) or :func:`~fsdp_tp.init_sharded`'s arrays —
Linen boxes and NNX variables kept. Every tensor is matched and every shape checked
(:func:`~fsdp_tp.hub.mapping.match`) before any block is read: a checkpoint that does not fit
fails whole, with nothing on the devices.

Each array is built by ``jax.make_array_from_callback``: JAX asks each process for its own
devices' blocks only, so no host reads, or holds, what it does not own. A block that several of
a process's devices hold (replicas over ``data``) is read once. The host memory a load takes
beyond what the devices end up holding is one block (the stored box, then its views) at a time.

>>> import os, tempfile, numpy as np, jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> from fsdp_tp.hub.safetensors import write
>>> from fsdp_tp.hub.mapping import Rule, Transpose
>>> directory = tempfile.mkdtemp()
>>> write(os.path.join(directory, "model.safetensors"), {"w": np.arange(32, dtype=np.float32).reshape(4, 8)})
>>> mesh = make_mesh({"fsdp": 8})
>>> target = {"kernel": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))}
>>> params, report = load(directory, target, [Rule("w", "kernel", (Transpose(),))])
>>> params["kernel"].sharding.spec, np.asarray(params["kernel"])[1].tolist()
(P('fsdp',), [1.0, 9.0, 17.0, 25.0])

Each device's block is a column of the stored ``w``. This process holds all eight, which tile
the kernel: it reads their span once, the tensor's 128 bytes in one range, and gives each device
its column. A process holding only some columns reads only theirs, a range a row:

>>> report
LoadReport(bytes_read=128, bytes_stored=128, blocks=1)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._optimizer import with_optimizer_state
from .._tree import path_of
from .._types import PyTree
from ..errors import CheckpointMismatchError
from .directory import Checkpoint
from .mapping import Box, Rule, Source, box_of, match

__all__ = ["LoadReport", "load", "param_path", "train_state"]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one process read: ``bytes_read`` from the files, ``bytes_stored`` of the tensors
    it read from (their whole size, each once), ``blocks``: the boxes it read, a parameter's
    one where its devices' blocks tile a box, else one a distinct block."""

    bytes_read: int
    bytes_stored: int
    blocks: int


def param_path(key_path) -> str:
    """A leaf's parameter path as rules name it: its box (Linen's ``Partitioned``, an NNX
    variable) left out, ``"block_0/attn/q/kernel"``."""
    keys = tuple(key_path)
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
        keys = keys[:-1]
    return path_of(keys)


def load(
    checkpoint: str | os.PathLike | Checkpoint,
    target: PyTree,
    rules: Sequence[Rule],
    ignore: Sequence[str] = (),
) -> tuple[PyTree, LoadReport]:
    """``target``'s tree with each leaf read from ``checkpoint`` (a directory or a
    :class:`~fsdp_tp.hub.directory.Checkpoint`) by ``rules``, in the leaf's shape, dtype and
    sharding; and what this process read. Stored tensors that ``ignore``'s patterns match are
    left unread (a checkpoint's rotary tables, say)."""
    opened = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [param_path(key_path) for key_path, _ in leaves]
    shapes = {path: tuple(leaf.shape) for path, (_, leaf) in zip(paths, leaves, strict=True)}
    stored = {name: opened.shape(name) for name in opened.names()}
    plan = match(rules, stored, shapes, ignore, where=opened.file)
    _require_dtypes(opened, plan, {p: leaf.dtype for p, (_, leaf) in zip(paths, leaves, strict=True)})
    read_before, blocks = opened.bytes_read, 0
    arrays = []
    for path, (_, leaf) in zip(paths, leaves, strict=True):
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        boxes = {box_of(index, leaf.shape) for index in indices}
        held = _held(boxes, len(leaf.shape))
        blocks += 1 if held is not None else len(boxes)
        cache: dict[Box, np.ndarray] = {}

        def block(index, path=path, leaf=leaf, cache=cache, held=held):
            box = box_of(index, leaf.shape)
            if held is not None:  # (one read of all this process holds; each device's a view)
                if held not in cache:
                    cache[held] = _block(opened, plan[path], held, leaf.dtype)
                return cache[held][
                    tuple(slice(lo - h, hi - h) for (lo, hi), (h, _) in zip(box, held, strict=True))
                ]
            if box not in cache:
                cache[box] = _block(opened, plan[path], box, leaf.dtype)
            return cache[box]

        arrays.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, block))
    read_from = {s.name for sources in plan.values() for s in sources}  # (a fused tensor once)
    stored_bytes = sum(opened.entries[name][1].end - opened.entries[name][1].begin for name in read_from)
    report = LoadReport(opened.bytes_read - read_before, stored_bytes, blocks)
    return jax.tree_util.tree_unflatten(treedef, arrays), report


def train_state(shapes: PyTree, params: PyTree, mesh, rng: jax.Array | None = None) -> PyTree:
    """The train state a fine-tune starts from: ``shapes`` (a ``TrainState`` of shapes, as
    :func:`~fsdp_tp.sharded_init.abstract_init` gives it: nothing allocated) with the loaded
    ``params``, step 0, ``rng`` (default ``jax.random.key(0)``) and the optimizer's state built
    by its ``tx.init`` on the global parameters, each leaf laid out as
    :func:`~fsdp_tp.init_sharded` lays it, so the step takes it with ``abstract_init``'s specs."""
    step = jax.device_put(jnp.zeros(shapes.step.shape, shapes.step.dtype), shapes.step.sharding)
    fields = dict(step=step, params=params, opt_state=None)
    if hasattr(shapes, "rng"):  # (the library's TrainState; flax's has none)
        fields["rng"] = jax.device_put(jax.random.key(0) if rng is None else rng, shapes.rng.sharding)
    state = shapes.replace(**fields)
    return with_optimizer_state(state, mesh)


def _held(boxes: set[Box], ndim: int) -> Box | None:
    """The box spanning ``boxes`` (the distinct blocks this process holds), where they tile it
    (FSDP over a process's own devices: read once, in long ranges, and sliced), else ``None``
    (each block read on its own: reading the span would read bytes no device here holds)."""
    span = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(ndim))
    volume = lambda box: int(np.prod([hi - lo for lo, hi in box]))
    return span if sum(volume(b) for b in boxes) == volume(span) else None


def _block(opened: Checkpoint, sources: list[Source], box: Box, dtype) -> np.ndarray:
    """The parameter's ``box``, each stacked index's source read for its part only. One source
    in the parameter's dtype is given as read, its views not copied (the device copies it)."""
    stacked = len(sources[0].at)
    inner = box[stacked:]
    if not stacked:
        (source,) = sources
        part = source.block(opened.read(source.name, source.box(inner)), inner)
        return part if part.dtype == np.dtype(dtype) else part.astype(dtype)
    out = np.empty(tuple(hi - lo for lo, hi in box), dtype)
    for source in sources:
        if all(lo <= i < hi for i, (lo, hi) in zip(source.at, box, strict=False)):
            part = source.block(opened.read(source.name, source.box(inner)), inner)
            out[tuple(i - lo for i, (lo, _) in zip(source.at, box, strict=False))] = part
    return out


def _require_dtypes(opened: Checkpoint, plan: dict[str, list[Source]], dtypes: dict) -> None:
    """A float parameter takes any float tensor (converted); anything else only its own kind."""
    problems = []
    for path, sources in plan.items():
        want = np.dtype(dtypes[path])
        for source in sources:
            have = opened.dtype(source.name)
            if have != want and not (
                jnp.issubdtype(have, jnp.floating) and jnp.issubdtype(want, jnp.floating)
            ):
                problems.append(
                    f"tensor {source.name!r} ({opened.file(source.name)}) is {have}, but {path!r} is {want}: "
                    f"only floats convert to another float; fix the rule or the model's dtype"
                )
    if problems:
        raise CheckpointMismatchError(
            f"the checkpoint does not fit the model ({len(problems)} problems; nothing was loaded):\n  "
            + "\n  ".join(problems)
        )

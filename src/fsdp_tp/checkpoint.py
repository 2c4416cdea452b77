"""Sharded checkpoints that do not depend on the mesh they were written on.

A train state is saved as its *global* arrays (each device writes its own blocks,
through orbax-checkpoint) with the boxes (``nn.Partitioned``) stripped, so the tree on
disk is the unsharded model's tree (invariant 1). Restoring reads each block straight
into the shardings of the state you hand in as ``like``: the same mesh resumes, another
mesh reshards, and no device ever holds more than its own shards.

Saves are asynchronous (training goes on while the bytes are written) and atomic: orbax
writes into a temporary directory and renames it when complete, so a process killed in
the middle of a save leaves the previous checkpoint as the newest restorable one.

>>> import tempfile, jax.numpy as jnp
>>> with Checkpoints(tempfile.mkdtemp()) as checkpoints:
...     checkpoints.save(0, {"w": jnp.ones(4)}), checkpoints.restore({"w": jnp.zeros(4)})[0]["w"].tolist()
(True, [1.0, 1.0, 1.0, 1.0])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from flax import serialization

from ._types import PyTree
from .errors import CheckpointMismatchError

__all__ = ["Checkpoints", "global_tree"]


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _unboxed(tree: PyTree) -> PyTree:
    """``tree`` with every box replaced by its value (outside ``shard_map``: global arrays)."""
    return jax.tree.map(lambda x: x.unbox() if _is_box(x) else x, tree, is_leaf=_is_box)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def global_tree(state: PyTree) -> PyTree:
    """The mesh-independent form of ``state``: nested dicts of plain global arrays.

    Boxes are unboxed, flax structs and optax states become dicts
    (``flax.serialization.to_state_dict``), typed rng keys become their key data.
    Works on concrete arrays and on ``jax.ShapeDtypeStruct``s alike.

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> state = {"w": nn.Partitioned(jnp.ones((4, 2)), ("fsdp", None)), "rng": jax.random.key(0)}
    >>> jax.tree.map(lambda x: (x.shape, str(x.dtype)), global_tree(state))
    {'rng': ((2,), 'uint32'), 'w': ((4, 2), 'float32')}
    """
    plain = _unboxed(state)
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if _is_key(x) else x,
        serialization.to_state_dict(plain),
    )


def _abstract(tree: PyTree) -> PyTree:
    """What orbax should read: each leaf's global shape, dtype and *current* sharding."""

    def target(x):
        # Always this run's sharding: the saved one may name devices this run does not have.
        sharding = getattr(x, "sharding", None)
        if _is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    plain = _unboxed(tree)
    return serialization.to_state_dict(jax.tree.map(target, plain))


def _check_shapes(saved: PyTree, expected: PyTree, where: str) -> None:
    """Raises naming every leaf whose saved shape differs from the model's (or is missing)."""
    saved_leaves = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    problems = []
    for path, want in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        got = saved_leaves.get(path)
        if got is None:
            problems.append(f"{name}: missing (the model expects shape {tuple(want.shape)})")
        elif tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: saved shape {tuple(got.shape)}, the model expects {tuple(want.shape)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {where} was written by a different model:\n  "
            + "\n  ".join(problems)
            + "\nRestore with the model (preset and sizes) that wrote it, or use a new checkpoint directory."
        )


class Checkpoints:
    """Numbered checkpoints of a (sharded) train state in ``directory``, the last ``keep`` kept.

    ``every`` > 1 makes ``save`` skip steps that are not multiples of it (``force`` overrides).
    Every process of a multi-process run makes the same calls; orbax writes each array
    block once and one process writes the metadata. Saved on ``fsdp=8``, read on ``2 x 4``:

    >>> import tempfile, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> state = {"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("fsdp")))}
    >>> with Checkpoints(tempfile.mkdtemp(), keep=2) as checkpoints:
    ...     checkpoints.save(3, state, {"seed": 0})
    ...     other = make_mesh({"data": 2, "fsdp": 4})
    ...     like = {"w": jax.device_put(jnp.zeros(16), NamedSharding(other, P("fsdp")))}
    ...     restored, meta = checkpoints.restore(like)
    True
    >>> restored["w"].sharding == like["w"].sharding, float(restored["w"][5]), meta
    (True, 5.0, {'seed': 0, 'step': 3})
    """

    def __init__(
        self, directory: str | Path, *, keep: int | None = 3, every: int = 1, async_save: bool = True
    ):
        if every < 1 or (keep is not None and keep < 1):
            raise ValueError(
                f"Checkpoints: every={every} and keep={keep} must be at least 1 (keep=None keeps all)."
            )
        self.directory, self.every = Path(directory).absolute(), every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # half-written saves of a killed run
        )
        # Handlers named up front, so a new process can read metadata before its first restore.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: PyTree, meta: dict | None = None, *, force: bool = False) -> bool:
        """Starts saving ``state`` (and the JSON-able ``meta``) as checkpoint ``step``.

        Returns whether a save started. The arrays are copied off the devices before it
        returns, so the caller may donate or overwrite ``state`` at once.
        """
        if step % self.every and not force:
            return False
        items = ocp.args.Composite(
            state=ocp.args.StandardSave(global_tree(state)),
            meta=ocp.args.JsonSave({**(meta or {}), "step": step}),
        )
        # force: orbax would also save the first step of a fresh directory; we decide here.
        return self._manager.save(step, args=items, force=True)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def restore(self, like: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        """Checkpoint ``step`` (default: the newest) read into the tree and shardings of ``like``.

        ``like`` is a state of the model you train now, on the mesh you train on now (concrete
        arrays or ``jax.ShapeDtypeStruct``s with shardings). Returns ``(state, meta)``; raises
        ``CheckpointMismatchError`` naming every parameter whose shape differs.
        """
        self.wait()  # a save of this process still in flight is part of what there is to read
        step = self.latest() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no complete checkpoint {'' if step is None else step} in {self.directory}; "
                f"the complete ones are {self.steps()}."
            )
        target = _abstract(like)
        _check_shapes(self._manager.item_metadata(step)["state"], target, str(self.path(step)))
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
        )
        return _into(like, restored["state"]), dict(restored["meta"])

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()  # waits for the saves in flight

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _into(like: PyTree, restored: PyTree) -> PyTree:
    """``restored`` (nested dicts) put back into ``like``'s structure, boxes and key types."""
    plain_like = _unboxed(like)
    plain = serialization.from_state_dict(plain_like, restored)
    plain = jax.tree.map(
        lambda want, got: (
            jax.random.wrap_key_data(got, impl=jax.random.key_impl(want)) if _is_key(want) else got
        ),
        plain_like,
        plain,
    )
    return jax.tree.map(
        lambda box, value: box.replace_boxed(value) if _is_box(box) else value, like, plain, is_leaf=_is_box
    )

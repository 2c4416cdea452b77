"""The mesh-independent form of a train state, and its way back (used by ``checkpoint``).

A state is saved as nested dicts of plain global arrays: boxes unboxed, flax structs and
optax states as dicts, typed rng keys as their key data. Restoring reads into the
shardings of a state of this run and puts boxes and key types back.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import serialization
from flax.core.meta import AxisMetadata

from .._tree import path_of
from .._types import PyTree
from ..errors import CheckpointMismatchError

__all__ = ["abstract", "check_saved", "global_tree", "into"]


def _is_box(x: Any) -> bool:
    return isinstance(x, AxisMetadata)


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


def abstract(tree: PyTree) -> PyTree:
    """What orbax should read: each leaf's global shape, dtype and *current* sharding."""

    def target(x):
        # Always this run's sharding: the saved one may name devices this run does not have.
        sharding = getattr(x, "sharding", None)
        if _is_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    plain = _unboxed(tree)
    return serialization.to_state_dict(jax.tree.map(target, plain))


def check_saved(saved: PyTree, expected: PyTree, where: str) -> None:
    """Raises naming every leaf whose saved shape or dtype differs from the model's (or is
    missing): a restore never casts or reshapes silently."""
    saved_leaves = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    problems = []
    for path, want in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name, got = path_of(path), saved_leaves.get(path)
        if got is None:
            problems.append(f"{name}: missing (the model expects shape {tuple(want.shape)})")
        elif tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: saved shape {tuple(got.shape)}, the model expects {tuple(want.shape)}")
        elif getattr(got, "dtype", want.dtype) != want.dtype:
            problems.append(f"{name}: saved dtype {got.dtype}, the model expects {want.dtype}")
    expected_paths = {path for path, _ in jax.tree_util.tree_flatten_with_path(expected)[0]}
    problems += [
        f"{path_of(path)}: saved, but the model has no such leaf"
        for path in saved_leaves
        if path not in expected_paths
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {where} was written by a different model:\n  "
            + "\n  ".join(problems)
            + "\nRestore with the model (preset, sizes and dtypes) that wrote it, or use a new "
            "checkpoint directory."
        )


def into(like: PyTree, restored: PyTree) -> PyTree:
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

"""An NNX model's state as the step holds it: pure dicts nested by parameter path, the
parameters apart from the other Variables, each parameter stored as this device's block
(boxed with its split), and the Variables a merged model holds, built from that state.

>>> nest([(("mlp", "up", "kernel"), 1), (("mlp", "up", "bias"), 2)])
{'mlp': {'up': {'kernel': 1, 'bias': 2}}}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
from flax import nnx
from flax.core.meta import Partitioned
from jax.sharding import PartitionSpec

from .._axes import axes_named
from .._layout import block_of
from .._types import AxisName, is_box
from ..precision import MixedPrecision
from ._layers import Path, path_text
from ._read import FoldPlan, ReadPlan, on_read
from ._specs import Placement

__all__ = [
    "Path",
    "flat_tree",
    "model_state_of",
    "nest",
    "other_variables",
    "param_variables",
    "split_model",
    "stored_block",
]


def nest(items: Iterable[tuple[Path, Any]]) -> dict:
    """A pure dict (nested by path keys) from ``(path, leaf)`` pairs."""
    out: dict = {}
    for path, leaf in items:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def flat_tree(tree: dict) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested dict (a box is a leaf)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
    return {tuple(k.key for k in key_path): leaf for key_path, leaf in leaves}


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model's graph, its parameters and every other Variable."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    return graphdef, params, rest


def stored_block(value, spec: PartitionSpec):
    """``value`` as a device stores it under ``spec``: its block, boxed with the split."""
    if not axes_named(spec):
        return value
    names = tuple(spec) + (None,) * (value.ndim - len(spec))
    return Partitioned(block_of(value, spec), names)


def model_state_of(rest) -> dict:
    """The model's Variables other than parameters (BatchNorm statistics, rng keys and
    counts), by type name: what a step updates, never the optimizer."""
    by_type: dict[str, list] = {}
    for path, variable in nnx.to_flat_state(rest):
        by_type.setdefault(type(variable).__name__, []).append((path, variable.get_raw_value()))
    return {name: nest(items) for name, items in by_type.items()}


def param_variables(
    params: list, flat: dict, layout: Placement, batch: frozenset, precision: MixedPrecision | None
) -> list:
    """``(path, Variable)`` of each parameter of the model (``params``: the abstract ones),
    holding its stored value from ``flat``: a block gathered where the model reads it, a
    whole one read rounded under ``precision``, else the value as it is."""
    variables = []
    for path, variable in params:
        leaf, text = flat[path], path_text(path)
        if is_box(leaf):
            whole = frozenset([layout.roles.whole[text]]) if text in layout.roles.whole else frozenset()
            plan = ReadPlan(text, tuple(leaf.names), layout.gathered[path], batch, whole, precision)
            variables.append((path, on_read(variable, leaf.value, plan)))
        elif precision is not None:  # whole, read rounded all the same (no gather rounds it)
            plan = ReadPlan(text, (None,) * leaf.ndim, frozenset(), batch, precision=precision)
            variables.append((path, on_read(variable, leaf, plan)))
        else:
            variables.append((path, variable.copy(leaf)))
    return variables


def other_variables(
    rest: list, model_state: dict | None, batch_axes: tuple[AxisName, ...], caller: str
) -> list:
    """``(path, Variable)`` of each Variable other than parameters (``rest``: the abstract
    ones) from ``model_state``: an rng key folded over ``batch_axes`` where read."""
    saved = {name: flat_tree(tree) for name, tree in (model_state or {}).items()}
    if missing := sorted({type(v).__name__ for _, v in rest} - set(saved)):
        raise ValueError(
            f"{caller}(...).merge: the model holds {', '.join(missing)} Variables, and "
            f"model_state has {sorted(saved) or 'none'}; pass the state's: "
            f"merge(state.params, state.model_state)."
        )
    out = []
    for path, variable in rest:
        value = saved[type(variable).__name__][path]
        if isinstance(variable, nnx.RngKey):
            out.append((path, on_read(variable, value, FoldPlan(batch_axes))))
        else:
            out.append((path, variable.copy(value)))
    return out

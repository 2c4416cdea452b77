"""The transform core: store each parameter by a layout, gather it where it is used.

Every "store sharded, gather for compute" strategy of the library is these three pieces:

- :func:`store` keeps this device's block of every parameter, as a per-leaf *layout
  choice* says (FSDP's largest divisible dim, partition rules, ...), checks every leaf
  at once (:mod:`fsdp_tp._layout`) and boxes the blocks as ``nn.Partitioned``;
- :func:`fsdp_tp.linen._gather.gather` all-gathers the blocks over the given axes for compute,
  at once or where the module reads them; over a batch axis the backward pass
  reduce-scatters the mean gradient, over any other axis (every device there saw the
  same batch) it keeps this device's slice;
- :func:`map_params` makes a module transform of the two (``nn.map_variables`` on
  ``"params"``) that keeps the target's name and tells the two, while they run, the
  module's path and the axes its inputs vary over.

``fsdp.shard_module_params`` and ``rule_transform.shard_by_rules`` are thin front doors
over them; the tensor-parallel layers use the same layout core
(:func:`fsdp_tp._layout.sliced_init`) to create their blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._axes import axes_named, bound_axis_names, entry_axes, entry_of, varying_axes
from .._batch import resolve_batch_axes
from .._layout import block_of, check_fit
from .._tree import module_path, path_of
from .._types import PyTree, is_box
from ..errors import RuleError, warn
from ._call import calling, current
from ._dropout import exact_dropout

__all__ = [
    "LayoutChoice",
    "check_module_class",
    "current_module_path",
    "input_varying",
    "keep_module_name",
    "map_params",
    "store",
    "warn_once",
]

LayoutChoice = Callable[[str, tuple[int, ...], tuple, "tuple | None"], PartitionSpec | None]
"""``(path, stored shape, names a layer already split it by, logical names or None)`` -> the
spec to split the leaf by (over dims the layer left whole), or ``None`` to leave it as it is."""

_warned: set = set()


def warn_once(key, warning: Warning) -> None:
    """Warns once per process for ``key`` (a model is traced many times; one warning is enough)."""
    if key not in _warned:
        _warned.add(key)
        warn(warning)


def _merge(path: str, names: tuple, spec: PartitionSpec, further: bool) -> tuple[tuple, PartitionSpec]:
    """The box names after splitting by ``spec`` a value some layer already split as ``names``,
    and the spec of what is left to split of the layer's block. ``further``: a dim the layer
    split may be split further where ``spec`` names the layer's axes first (FSDP's choice on a
    column layer's bias). Rules may not: the axes a rule names are the axes its transform
    gathers, and a layer's axis is never gathered."""
    merged: list = list(names)
    beyond: list = [None] * len(spec)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        layer, axes = entry_axes(names[dim]), entry_axes(entry)
        more = axes[len(layer) :]
        if names[dim] is not None and not (further and axes[: len(layer)] == layer):
            raise RuleError(
                f"{path}: the rule splits dim {dim} over {entry!r}, but its layer already splits that dim "
                f"over {names[dim]!r}; give that dim None in the rule."
            )
        if twice := set(more) & axes_named(names):
            raise RuleError(
                f"{path}: the rule uses mesh axis {sorted(twice, key=str)[0]!r}, which its layer already "
                f"splits another dim over (names {names}); an axis can split one dim of a parameter."
            )
        merged[dim], beyond[dim] = entry, entry_of(more)
    return tuple(merged), PartitionSpec(*beyond)


def store(
    params: PyTree, choose: LayoutChoice, fix: str = "change the rule", further: bool = False
) -> PyTree:
    """This device's block of every parameter, as ``choose`` lays it out (inside ``shard_map``,
    on full values the same across the axes they are split over). Paths start at the
    wrapped module's path (:func:`current_module_path`); every leaf that does not fit is reported
    at once; ``fix`` ends the divisibility message; ``further``: ``choose`` may split a layer's
    blocks further (:func:`_merge`)."""
    sizes = {axis: jax.lax.axis_size(axis) for axis in bound_axis_names()}
    prefix = current_module_path()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
    plans = []
    for key_path, leaf in leaves:
        inner = path_of(key_path).removeprefix("params/")
        path = module_path((prefix,), inner)
        value = leaf.value if is_box(leaf) else leaf
        logical = tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else None
        names = tuple(leaf.names) if type(leaf) is nn.Partitioned else (None,) * np.ndim(value)
        spec = choose(path, np.shape(value), names, logical)
        plans.append((path, leaf, value, None if spec is None else _merge(path, names, spec, further)))
    # Dims a layer split are already local: what is split is the layer's block, by the axes
    # the spec adds.
    check_fit(((path, np.shape(value), split[1]) for path, _, value, split in plans if split), sizes, fix)
    out = []
    for _, leaf, value, split in plans:
        if split is None or not any(entry_axes(e) for e in split[1]):
            out.append(leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf)
            continue
        out.append(nn.Partitioned(block_of(value, split[1]), split[0]))
    return jax.tree.unflatten(treedef, out)


def check_module_class(target, who: str) -> None:
    """Raises ``TypeError`` unless ``target`` is a flax linen Module class (what every
    transform wraps), naming what was passed and how to pass the class instead."""
    if isinstance(target, type) and issubclass(target, nn.Module):
        return
    if isinstance(target, nn.Module):
        # An instance has already claimed its name in its parent, so it cannot
        # be re-created as the wrapped class under that name.
        cls = type(target).__name__
        raise TypeError(
            f"{who}: got a {cls} instance ({target.name or 'unnamed'}); pass the class and build the "
            f"layer from the result: {who}({cls}, ...)(...{cls} arguments...)."
        )
    raise TypeError(
        f"{who}: expected a flax.linen Module class such as nn.Dense, got {target!r} "
        f"({type(target).__name__}); to shard a function's parameters, wrap the module it calls."
    )


def _default_batch_axes() -> tuple:
    return resolve_batch_axes(None, "the transform")


def map_params(
    target,
    trans_in: Callable[[PyTree], PyTree],
    trans_out: Callable[[PyTree], PyTree],
    batch_axes: Callable[[], tuple] = _default_batch_axes,
):
    """``nn.map_variables`` over ``"params"`` that keeps ``target``'s name and tells the
    transforms, while they run, the axes the call's inputs vary over (:func:`input_varying`)
    and the module's path (:func:`current_module_path`). Its ``nn.Dropout`` draws this
    device's block of the unsharded mask, dim 0 split over ``batch_axes()``
    (:mod:`fsdp_tp.linen._dropout`)."""
    mapped = nn.map_variables(
        target, trans_in_fn=trans_in, trans_out_fn=trans_out, mapped_collections="params", mutable=True
    )

    class Sharded(mapped):  # type: ignore[valid-type, misc]
        # nowrap: a wrapped method would run the module's setup() here, outside the
        # lifted scope, on the stored shards; the mapped __call__ runs it inside.
        @nn.nowrap
        def __call__(self, *args, **kwargs):
            # The axes the inputs vary over are where JAX would pcast the gathered
            # params anyway; gather does it on the shards.
            varying = _varying_over_inputs((args, kwargs))
            with (
                calling(input_varying=varying, module_path=module_path(self.path)),
                exact_dropout(batch_axes),
            ):
                return super().__call__(*args, **kwargs)

    return keep_module_name(Sharded, target)


def input_varying() -> frozenset:
    """Inside a :func:`map_params` transform: the axes the module's inputs vary over."""
    return current().input_varying


def current_module_path() -> str:
    """Inside a :func:`map_params` transform: the wrapped module's path, ``"a/b"`` (root: ``""``)."""
    return current().module_path


def _varying_over_inputs(tree) -> frozenset:
    axes: frozenset = frozenset()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array | jax.core.Tracer):
            axes |= varying_axes(leaf)
    return axes


def keep_module_name(mapped, target):
    """Gives a transformed module class its target's name.

    Flax auto-names submodules ``f"{type(module).__name__}_{i}"`` and derives
    their init rngs from those names; ``nn.map_variables`` returns a class
    named ``Map_variablesDense``, which would change both the parameter paths
    and the init (docs/design.md invariants 1 and 2).
    """
    if isinstance(mapped, type):
        mapped.__name__ = target.__name__
        mapped.__qualname__ = target.__qualname__
    return mapped

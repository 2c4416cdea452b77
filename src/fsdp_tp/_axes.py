"""Questions about mesh axes asked from inside ``jax.shard_map``."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType

from ._types import AxisName, AxisNames
from .errors import UnboundAxisNameError

__all__ = [
    "CONTEXT",
    "TENSOR",
    "as_axis_tuple",
    "axes_named",
    "axis_size",
    "bound_axis_names",
    "checks_vma",
    "entry_axes",
    "entry_of",
    "local_slice",
    "require_axes",
    "varying_axes",
]

TENSOR = "tensor"  # the mesh axis tensor parallelism splits over unless told another (every default)
CONTEXT = "context"  # the mesh axis context parallelism splits the sequence over, by default


def as_axis_tuple(axes: AxisNames) -> tuple[AxisName, ...]:
    """``"fsdp"`` -> ``("fsdp",)``; a list, tuple or set of names -> a tuple (sets sorted)."""
    if isinstance(axes, (tuple, list)):
        return tuple(axes)
    if isinstance(axes, (set, frozenset)):
        return tuple(sorted(axes, key=str))
    return (axes,)


def entry_axes(entry) -> tuple[AxisName, ...]:
    """The axes of one entry of a ``PartitionSpec`` or of box names: ``None``, a name, or a tuple."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def entry_of(axes: tuple[AxisName, ...]) -> AxisName | tuple[AxisName, ...] | None:
    """The spec entry of a dim split over ``axes`` (the inverse of :func:`entry_axes`): ``None``,
    the one name, or the tuple.

    >>> entry_of(()), entry_of(("fsdp",)), entry_of(("tensor", "fsdp"))
    (None, 'fsdp', ('tensor', 'fsdp'))
    """
    return axes if len(axes) > 1 else (axes[0] if axes else None)


def axes_named(names) -> set[AxisName]:
    """Every mesh axis named by any entry of a spec or of a box's names."""
    return {axis for entry in names for axis in entry_axes(entry)}


def local_slice(x: jax.Array, dim: int, axis: AxisName) -> jax.Array:
    """This device's contiguous slice of dim ``dim`` when it is split evenly over ``axis``."""
    width = x.shape[dim] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * width, width, axis=dim)


def bound_axis_names() -> tuple[AxisName, ...]:
    """The mesh axes that the enclosing ``jax.shard_map`` makes manual (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(
        name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind == AxisType.Manual
    )


def require_axes(axes: AxisNames, caller: str) -> tuple[AxisName, ...]:
    """Returns ``axes`` as a tuple; raises if one is not bound by the enclosing shard_map."""
    names = as_axis_tuple(axes)
    bound = bound_axis_names()
    missing = [name for name in names if name not in bound]
    if missing:
        where = (
            f"the enclosing jax.shard_map binds {list(bound)}"
            if bound
            else "it was called outside jax.shard_map, where no mesh axis is bound"
        )
        raise UnboundAxisNameError(
            f"{caller}: mesh axis {missing[0]!r} is not bound here; {where}. "
            f"Pass axis names of the mesh given to jax.shard_map, and call {caller} inside it."
        )
    return names


def axis_size(axes: AxisNames) -> int:
    """The number of devices along one axis or the product over several."""
    return math.prod(jax.lax.axis_size(name) for name in as_axis_tuple(axes))


def varying_axes(x: jax.Array) -> frozenset[AxisName]:
    """The mesh axes along which ``x`` may differ, as the vma type system tracks them."""
    return jax.typeof(x).manual_axis_type.varying


def checks_vma(axis: AxisName) -> bool:
    """Whether the enclosing ``jax.shard_map`` runs with ``check_vma=True``.

    ``axis_index`` varies over its axis by definition; with checking off, every
    value's varying set is empty, so this one fact tells the two modes apart.
    """
    return axis in varying_axes(jax.lax.axis_index(axis))

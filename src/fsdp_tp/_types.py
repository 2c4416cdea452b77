"""Type aliases used across the package, defined once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

from flax.core.meta import Partitioned
from jax.sharding import PartitionSpec

__all__ = ["AxisName", "AxisNames", "PyTree", "Specs", "is_box", "logical_names"]

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts and registered nodes."""

AxisName: TypeAlias = Hashable
"""The name of one mesh axis, e.g. ``"fsdp"``."""

AxisNames: TypeAlias = AxisName | Sequence[AxisName]
"""One mesh axis name or several, as ``jax.lax`` collectives accept them."""

Specs: TypeAlias = PartitionSpec | Any
"""A pytree of ``PartitionSpec`` (a prefix of the tree it describes)."""


def is_box(x: Any) -> bool:
    """Whether ``x`` is a parameter box the layout core reads: flax's ``Partitioned`` (a block
    and the axes its dims are split over) or a subclass such as Linen's
    ``LogicallyPartitioned`` (logical names)."""
    return isinstance(x, Partitioned)


def logical_names(x: Any) -> tuple | None:
    """The logical names of a box that carries logical-axis rules of its own (Linen's
    ``LogicallyPartitioned``: ``Partitioned`` with a ``rules`` field), else ``None``. Read by
    its fields, so the core needs no front end's class."""
    return tuple(x.names) if isinstance(x, Partitioned) and hasattr(x, "rules") else None

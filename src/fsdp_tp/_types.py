"""Type aliases used across the package, defined once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

from jax.sharding import PartitionSpec

__all__ = ["AxisName", "AxisNames", "PyTree", "Specs"]

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts and registered nodes."""

AxisName: TypeAlias = Hashable
"""The name of one mesh axis, e.g. ``"fsdp"``."""

AxisNames: TypeAlias = AxisName | Sequence[AxisName]
"""One mesh axis name or several, as ``jax.lax`` collectives accept them."""

Specs: TypeAlias = PartitionSpec | Any
"""A pytree of ``PartitionSpec`` (a prefix of the tree it describes)."""

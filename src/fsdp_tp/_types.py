"""Type aliases used across the package, defined once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

import flax.linen as nn
from jax.sharding import PartitionSpec

__all__ = ["AxisName", "AxisNames", "PyTree", "Specs", "is_box"]

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts and registered nodes."""

AxisName: TypeAlias = Hashable
"""The name of one mesh axis, e.g. ``"fsdp"``."""

AxisNames: TypeAlias = AxisName | Sequence[AxisName]
"""One mesh axis name or several, as ``jax.lax`` collectives accept them."""

Specs: TypeAlias = PartitionSpec | Any
"""A pytree of ``PartitionSpec`` (a prefix of the tree it describes)."""


def is_box(x: Any) -> bool:
    """Whether ``x`` is a parameter box the layout core reads: ``nn.Partitioned`` (a block
    and the axes its dims are split over) or ``nn.LogicallyPartitioned`` (logical names)."""
    return isinstance(x, nn.Partitioned | nn.LogicallyPartitioned)

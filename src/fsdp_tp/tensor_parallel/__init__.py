"""Tensor parallelism: layers and blocks whose parameters are split over a mesh axis."""

from .blocks import MLPBlock as MLPBlock
from .dense import ColumnParallelDense as ColumnParallelDense
from .dense import RowParallelDense as RowParallelDense
from .dense import split_param as split_param

__all__ = ["ColumnParallelDense", "MLPBlock", "RowParallelDense", "split_param"]

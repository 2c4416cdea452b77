"""Tensor parallelism: layers and blocks whose parameters are split over a mesh axis."""

from .attention import AttentionBlock as AttentionBlock
from .blocks import MLPBlock as MLPBlock
from .dense import ColumnParallelDense as ColumnParallelDense
from .dense import RowParallelDense as RowParallelDense
from .dense import split_param as split_param

__all__ = ["AttentionBlock", "ColumnParallelDense", "MLPBlock", "RowParallelDense", "split_param"]

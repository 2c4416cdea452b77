"""Tensor parallelism: layers and blocks whose parameters are split over a mesh axis."""

from .attention import AttentionBlock as AttentionBlock
from .blocks import MLPBlock as MLPBlock
from .dense import ColumnParallelDense as ColumnParallelDense
from .dense import RowParallelDense as RowParallelDense
from .dense import split_param as split_param
from .vocab import VocabParallelEmbed as VocabParallelEmbed
from .vocab import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy

__all__ = [
    "AttentionBlock",
    "ColumnParallelDense",
    "MLPBlock",
    "RowParallelDense",
    "VocabParallelEmbed",
    "split_param",
    "vocab_parallel_cross_entropy",
]

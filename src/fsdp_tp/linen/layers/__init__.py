"""Tensor parallelism: layers and blocks whose parameters are split over a mesh axis."""

from ..._aliases import aliases_of
from .attention import AttentionBlock as AttentionBlock
from .blocks import MLPBlock as MLPBlock
from .dense import ColumnParallelDense as ColumnParallelDense
from .dense import RowParallelDense as RowParallelDense
from .dense import split_param as split_param
from .vocab import VocabParallelEmbed as VocabParallelEmbed

__all__ = [
    "AttentionBlock",
    "ColumnParallelDense",
    "MLPBlock",
    "RowParallelDense",
    "VocabParallelEmbed",
    "split_param",
]

from .. import _layers_check  # noqa: F401  (init_sharded checks these layers in the model)

__getattr__ = aliases_of(__name__)  # 0.1's vocab_parallel_cross_entropy here (fsdp_tp._aliases)

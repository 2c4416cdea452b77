"""One description of how a model is split over a mesh, shared by the model, the CLI and the bench."""

from __future__ import annotations

from dataclasses import dataclass

from ..linen.fsdp import shard_module_params
from ..precision import MixedPrecision, checked_policy

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Which mesh axes split what: ``tensor`` set means tensor parallelism over it (Megatron
    layers), ``fsdp`` set means every large parameter is also sharded over it; ``Layout()`` is
    the plain flax model, the unsharded twin.

    ``sequence_parallel``: the activations between blocks are split along the sequence
    over ``tensor``. ``collective_matmul`` (``"unidirectional"`` / ``"bidirectional"``): the
    tensor-parallel collectives become ``ppermute`` rings overlapped with the matmuls.
    ``min_weight_size``: parameters of at most this many elements stay whole under FSDP.
    ``mixed_precision``: the dtypes FSDP gathers and reduces in
    (:class:`~fsdp_tp.MixedPrecision`); it needs ``fsdp``.

    >>> import flax.linen as nn
    >>> layout = Layout(tensor="tensor", fsdp="fsdp", min_weight_size=0)
    >>> layout.shard(nn.Dense).__name__, Layout().shard(nn.Dense) is nn.Dense
    ('Dense', True)
    """

    tensor: str | None = None
    fsdp: str | None = None
    sequence_parallel: bool = False
    collective_matmul: str | None = None
    min_weight_size: int = 2**18
    mixed_precision: MixedPrecision | None = None

    def __post_init__(self):
        checked_policy(self.mixed_precision, "Layout")
        if self.mixed_precision is not None and self.fsdp is None:
            raise ValueError(
                f"Layout: mixed_precision={self.mixed_precision} casts what FSDP gathers, but fsdp is None; "
                f"name the FSDP axis (fsdp='fsdp') or drop mixed_precision."
            )

    def shard(self, cls):
        """``cls`` wrapped for FSDP over ``fsdp`` (:func:`~fsdp_tp.shard_module_params`), or as it is."""
        if self.fsdp is None:
            return cls
        return shard_module_params(cls, self.fsdp, self.min_weight_size, self.mixed_precision)

    @property
    def sequence_split(self) -> bool:
        """Whether the sequence is split between blocks (sequence parallelism needs a tensor axis)."""
        return self.tensor is not None and self.sequence_parallel

    @property
    def ring(self) -> str | None:
        """The collective-matmul mode the layers get (none without a tensor axis)."""
        return self.collective_matmul if self.tensor is not None else None

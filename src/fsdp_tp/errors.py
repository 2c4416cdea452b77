"""The errors the library raises at its boundaries.

Every message names what was passed, what was expected and how to fix it.

>>> from fsdp_tp import make_mesh
>>> make_mesh({"data": 3, "fsdp": 2})
Traceback (most recent call last):
...
fsdp_tp.errors.MeshShapeError: make_mesh: axis sizes {'data': 3, 'fsdp': 2} multiply to 6 devices, but 8 ...
"""

from __future__ import annotations

__all__ = [
    "BatchAxesError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "FoldedDropoutWarning",
    "IndivisibleShapeError",
    "LayerLeftWholeWarning",
    "MeshShapeError",
    "OptimizerOnShardsError",
    "ReplicatedParameterWarning",
    "RuleError",
    "SpecError",
    "SpecTreeMismatchError",
    "UnboundAxisNameError",
    "UncheckedPlanWarning",
    "UnmatchedRuleWarning",
]


class UnboundAxisNameError(NameError):
    """A mesh axis name that the enclosing ``jax.shard_map`` does not bind."""


class BatchAxesError(ValueError):
    """``batch_axes`` (a transform's, or a gradient sync's) that are not the axes the step
    splits its batch over: gradients would be averaged over the wrong devices, silently."""


class MeshShapeError(ValueError):
    """Mesh axis sizes that do not fit the devices they are laid over."""


class FoldedDropoutWarning(UserWarning):
    """An attention function the library does not own draws its dropout mask itself: each block
    draws an independent mask (the unsharded model's distribution, not its mask), where flax's
    own attention function draws the unsharded mask's block."""


class IndivisibleShapeError(ValueError):
    """An array dim that the mesh axes it is split over do not divide."""


class OptimizerOnShardsError(RuntimeError):
    """An optimizer update asked for on one device's shards, where a transform that reduces
    (a norm, a trust ratio, a factored moment) would compute a wrong update silently."""


class SpecError(ValueError):
    """A ``PartitionSpec`` that cannot lay out its array: more entries than dims, a mesh axis the
    mesh lacks, or one axis on two dims."""


class SpecTreeMismatchError(ValueError):
    """A ``PartitionSpec`` tree whose structure does not match the values it describes."""


class ReplicatedParameterWarning(UserWarning):
    """A parameter large enough to shard stayed replicated: no dim divides the axis size, or
    each dim it divides is already split over another axis (a tensor-parallel layer's)."""


class LayerLeftWholeWarning(UserWarning):
    """``tp_rules="auto"`` left whole a layer a role could split: it is replicated over the
    tensor axis and computed in full on each of its devices (its numbers are still the
    unsharded model's; its memory and FLOPs are not divided)."""


class RuleError(ValueError):
    """A partition rule that is malformed, matches nothing, or names a dim or axis wrongly."""


class UncheckedPlanWarning(UserWarning):
    """A tensor-parallel plan the check against the model's trace could not decide: a split
    reaches an operation it does not know. The plan runs; nothing proves it equal to unsharded."""


class UnmatchedRuleWarning(UserWarning):
    """Partition rules that matched no parameter: usually a typo in the pattern."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit the model restoring it (another preset or size)."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint whose files do not read back as the arrays that were saved (flipped or
    truncated bytes, deleted metadata): it is never trained on."""


class CheckpointSaveError(OSError):
    """A checkpoint that could not be written (read-only or full disk, no permission), or that
    was written but does not read back."""

"""The errors the library raises at its boundaries.

Every message names what was passed, what was expected and how to fix it. Every warning is an
:class:`FsdpTpWarning`, shown at the user's line (:func:`warn`), not the library's.

>>> from fsdp_tp import make_mesh
>>> make_mesh({"data": 3, "fsdp": 2})
Traceback (most recent call last):
...
fsdp_tp.errors.MeshShapeError: make_mesh: axis sizes {'data': 3, 'fsdp': 2} multiply to 6 devices, but 8 ...
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
import warnings

__all__ = [
    "BatchAxesError",
    "CheckPrecisionWarning",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "FoldedDropoutWarning",
    "FsdpTpWarning",
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
    "warn",
]


class FsdpTpWarning(UserWarning):
    """A warning of this library's: each ``*Warning`` below is one (``-W
    error::fsdp_tp.errors.FsdpTpWarning`` makes them all errors, wherever they point)."""


class CheckPrecisionWarning(FsdpTpWarning):
    """``check_sharded(float64=True)`` could not compute in float64 everywhere: the model
    rounds a value to a narrower dtype (an ``astype``, a layer's own ``dtype=jnp.float32``). The
    check ran, at float32's tolerances, and names that operation and its line."""


class UnboundAxisNameError(NameError):
    """A mesh axis name that the enclosing ``jax.shard_map`` does not bind."""


class BatchAxesError(ValueError):
    """``batch_axes`` (a transform's, or a gradient sync's) that are not the axes the step
    splits its batch over: gradients would be averaged over the wrong devices, silently."""


class MeshShapeError(ValueError):
    """Mesh axis sizes that do not fit the devices they are laid over."""


class FoldedDropoutWarning(FsdpTpWarning):
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


class ReplicatedParameterWarning(FsdpTpWarning):
    """A parameter large enough to shard stayed replicated: no dim divides the axis size, or
    each dim it divides is already split over another axis (a tensor-parallel layer's)."""


class LayerLeftWholeWarning(FsdpTpWarning):
    """``tp_rules="auto"`` left whole a layer a role could split: it is replicated over the
    tensor axis and computed in full on each of its devices (its numbers are still the
    unsharded model's; its memory and FLOPs are not divided)."""


class RuleError(ValueError):
    """A partition rule that is malformed, matches nothing, or names a dim or axis wrongly."""


class UncheckedPlanWarning(FsdpTpWarning):
    """A tensor-parallel plan the check against the model's trace could not decide: a split
    reaches an operation it does not know. The plan runs; nothing proves it equal to unsharded."""


class UnmatchedRuleWarning(FsdpTpWarning):
    """Partition rules that matched no parameter: usually a typo in the pattern."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit the model restoring it (another preset or size)."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint whose files do not read back as the arrays that were saved (flipped or
    truncated bytes, deleted metadata): it is never trained on."""


class CheckpointSaveError(OSError):
    """A checkpoint that could not be written (read-only or full disk, no permission), or that
    was written but does not read back."""


def warn(warning: Warning) -> None:
    """Emits ``warning`` at the user's line: the innermost frame outside fsdp_tp, flax, jax and
    Python's own modules (inside a traced model, the model's line that reached the library;
    else the line that called it), where Python and pytest show it and where a filter by module
    applies; with no such frame (``python -m fsdp_tp``), at the library's line that warned.

    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn(UnmatchedRuleWarning("example: rules matching no parameter: ['wq']"))
    >>> caught[0].category.__name__, caught[0].filename.startswith("<doctest")
    ('UnmatchedRuleWarning', True)
    """
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # (stacklevel 2: warn's caller)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level if frame is not None else 2)


def _is_library(filename: str) -> bool:
    libraries, stdlib, site = _folders()
    if filename.startswith(("<frozen ", "<string>")):  # (a dataclass's generated __init__)
        return True  # (a doctest's or a REPL's "<...>" line is the user's)
    return filename.startswith(libraries) or (filename.startswith(stdlib) and not filename.startswith(site))


@functools.cache
def _folders() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The folders of fsdp_tp, flax, jax and jaxlib; Python's own; its site-packages (inside
    Python's own folder on a system install, and holding the user's packages too)."""
    loaded = [sys.modules.get(name) for name in ("fsdp_tp", "flax", "jax", "jaxlib")]
    paths = sysconfig.get_paths()

    def folders(found) -> tuple[str, ...]:
        return tuple(os.path.join(folder, "") for folder in found)

    libraries = folders(os.path.dirname(m.__file__) for m in loaded if m is not None and m.__file__)
    return (
        libraries,
        folders((paths["stdlib"], paths["platstdlib"])),
        folders((paths["purelib"], paths["platlib"])),
    )

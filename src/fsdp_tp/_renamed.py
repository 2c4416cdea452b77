"""Every setting 0.2 named another way, in one table (:data:`RENAMED`), served one way.

One dialect (the roles', issue 58; everywhere, issue 83): a mesh axis is ``axis`` (several:
``axes``), an array dimension ``dim``, the sequence dim a layer's activations are split along
``sequence_dim``. A Linen layer's field 0.2 named otherwise is set through
:class:`RenamedFields` (:func:`renamed_fields`), a function's keyword through
:func:`renamed_keywords`: given under its old name, it warns at the caller's line naming the
new one and the release that removes the old one (that of :mod:`fsdp_tp._aliases`'s moved
paths), and sets the new one; both names at once, a ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ._aliases import REMOVED_IN
from .errors import warn

__all__ = ["DEPRECATED", "RENAMED", "Renamed", "RenamedFields", "renamed_fields", "renamed_keywords"]


class _Deprecated:
    def __repr__(self) -> str:
        return "DEPRECATED"


DEPRECATED: Any = _Deprecated()
"""The default of a renamed field: not set (a row of :data:`RENAMED` says its new name)."""


def _always(given: Any) -> bool:
    return True


def _a_dim(given: Any) -> bool:
    return isinstance(given, int)  # (an array dim; a mesh axis is a name or a tuple of names)


@dataclasses.dataclass(frozen=True)
class Renamed:
    """Field ``old`` of the Linen layer ``owner`` (its class, ``fsdp_tp.<owner>``), or keyword
    ``old`` of the function ``fsdp_tp.<owner>``, is now ``new``, of the value ``value`` gives
    (the same by default; ``meaning``: what it is). ``old_when(given)``: whether a value passed
    as ``old`` is the old setting, for a name both releases use for different things
    (``gather_from_axis``'s ``axis`` was an array dim, ``dim`` now; a mesh axis now)."""

    owner: str
    old: str
    new: str
    value: Callable[[Any], Any] = lambda given: given
    meaning: str = ""
    old_when: Callable[[Any], bool] = _always

    @property
    def of_a_function(self) -> bool:
        """Whether ``owner`` is a function (a keyword renamed), not a Linen layer (a field)."""
        return not self.owner[0].isupper()

    def message(self, given: Any) -> str:
        return (
            f"fsdp_tp.{self.owner}({self.old}={given!r}) is deprecated since 0.2.0 and goes in "
            f"{REMOVED_IN}: write {self.owner}({self.new}={self.value(given)!r}){self.meaning}"
        )


_DENSE = ("ColumnParallelDense", "RowParallelDense")
_SEQUENCE = " (the sequence dim of its (batch, sequence, features) input; None: whole)"
# One dialect (issue 83 point 5): a mesh axis is `axis` (several: `axes`), an array dimension
# is `dim`. The functions whose keywords 0.2 named otherwise:
_ON_AXIS = (
    "collectives.copy_to_axis",
    "collectives.reduce_from_axis",
    "collective_matmul.ring_all_gather",
    "collective_matmul.ring_reduce_scatter",
    "collective_matmul.matmul_reduce_scatter",
    "dropout.fold_rng_over_axis",
    "linen.fsdp.shard_params",
    "linen.fsdp.gather_params",
    "shard_module_params",
    "vocab_parallel_cross_entropy",
    "tp.pieces.kept_block",
    "tp.pieces.require_kept_blocks",
    "tp.pieces.vocab_lookup",
    "tp.pieces.vocab_start",
)
_ON_DIM_OF_AXIS = (  # (x, dim, axis): 0.2's (x, axis, axis_name), the same order
    "collectives.gather_from_axis",
    "collectives.scatter_to_axis",
    "collectives.gather_array_with_mean_grads",
    "collectives.gather_scaled_with_mean_grads",
)
_ON_AXES = (
    "sync_gradients",
    "gradients.batch_total",
    "gradients.batch_mean",
    "gradients.global_mean_loss",
    "gradients.global_sum_loss",
)
_SEQUENCE_DIM = ("tp.pieces.column_input", "tp.pieces.row_reduce")
RENAMED: tuple[Renamed, ...] = (
    # One name per setting, the roles' (issue 58): the mesh axis is `axis`, the sequence dim
    # that a sequence-parallel layer's activations are split along is `sequence_dim`.
    *(
        Renamed(owner, "axis_name", "axis")
        for owner in (
            "ColumnParallelDense",
            "RowParallelDense",
            "VocabParallelEmbed",
            "AttentionBlock",
            "MLPBlock",
        )
    ),
    *(
        Renamed(owner, "sequence_axis", "sequence_dim", meaning=_SEQUENCE)
        for owner in (*_DENSE, "VocabParallelEmbed")
    ),
    *(
        Renamed(owner, "sequence_parallel", "sequence_dim", lambda on: 1 if on else None, _SEQUENCE)
        for owner in ("AttentionBlock", "MLPBlock")
    ),
    *(
        Renamed(owner, "axis_name", "axis")
        for owner in (*_ON_AXIS, *_SEQUENCE_DIM, "tp.pieces.add_bias_once")
    ),
    *(Renamed(owner, "axis", "dim", old_when=_a_dim) for owner in _ON_DIM_OF_AXIS),
    *(Renamed(owner, "axis_name", "axis") for owner in _ON_DIM_OF_AXIS),
    *(Renamed(owner, "axis_names", "axes") for owner in _ON_AXES),
    *(
        Renamed(owner, "sequence_axis", "sequence_dim", meaning=" (the dim the sequence is split on)")
        for owner in _SEQUENCE_DIM
    ),
    Renamed(
        "tp.pieces.add_bias_once",
        "sequence_parallel",
        "sequence_dim",
        lambda on: 1 if on else None,
        " (the sequence dim of a (batch, sequence, features) output split over the axis; None: whole)",
    ),
)
"""Every renamed field of a Linen layer or keyword of a function, each with its new name; the
CHANGELOG lists the same rows."""


def renamed_fields(layer: Any) -> None:
    """In a Linen layer's ``__post_init__`` (:class:`RenamedFields`): each renamed field the
    caller set warns, naming the new one, and sets it (the old one unset again, so a clone does
    not warn twice); set with its new name too, a ``TypeError``."""
    names = {cls.__name__ for cls in type(layer).__mro__}
    for row in RENAMED:
        given = getattr(layer, row.old, DEPRECATED) if row.owner in names else DEPRECATED  # (a class's)
        if given is DEPRECATED:
            continue
        default = next(f.default for f in dataclasses.fields(layer) if f.name == row.new)
        if getattr(layer, row.new) != default:
            raise TypeError(
                f"{row.owner}: {row.old}={given!r} and {row.new}={getattr(layer, row.new)!r} name one "
                f"setting twice; {row.old} is deprecated: pass {row.new} alone."
            )
        warn(DeprecationWarning(row.message(given)))  # (at the line that built the layer)
        object.__setattr__(layer, row.new, row.value(given))
        object.__setattr__(layer, row.old, DEPRECATED)


def renamed_keywords(owner: str) -> Callable[[Callable], Callable]:
    """Decorates the function ``fsdp_tp.<owner>``: each keyword :data:`RENAMED` lists for it,
    passed under its old name, warns (at the caller's line) naming the new one and is passed as
    it; a setting passed under both names, a ``TypeError`` naming both.

    >>> import warnings
    >>> @renamed_keywords("collectives.gather_from_axis")
    ... def gather(x, dim, axis):
    ...     return x, dim, axis
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     gather("x", axis=1, axis_name="tensor")
    ('x', 1, 'tensor')
    >>> [str(w.message).split(": ")[-1] for w in caught]
    ['write collectives.gather_from_axis(dim=1)', "write collectives.gather_from_axis(axis='tensor')"]
    """
    rows = {row.old: row for row in RENAMED if row.owner == owner}
    assert rows, f"no row of RENAMED names fsdp_tp.{owner}"

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            if rows.keys() & kwargs.keys():
                kwargs = _new_keywords(rows, kwargs)
            return function(*args, **kwargs)

        call._fsdp_tp_renamed = owner  # type: ignore[attr-defined]  # (read by tests/test_one_path.py)
        return call

    return decorate


def _new_keywords(rows: dict[str, Renamed], kwargs: dict[str, Any]) -> dict[str, Any]:
    old = {name: rows[name] for name, given in kwargs.items() if name in rows and rows[name].old_when(given)}
    new = {name: given for name, given in kwargs.items() if name not in old}
    for name, row in old.items():
        if row.new in new:
            raise TypeError(
                f"fsdp_tp.{row.owner}: {name}={kwargs[name]!r} and {row.new}={new[row.new]!r} name one "
                f"setting twice; {name} is deprecated: pass {row.new} alone."
            )
    for name, row in old.items():
        warn(DeprecationWarning(row.message(kwargs[name])))
        new[row.new] = row.value(kwargs[name])
    return new


class RenamedFields:
    """A Linen layer's base, before ``nn.Module``, whose ``__post_init__`` takes the fields
    :data:`RENAMED` lists for it (:func:`renamed_fields`)."""

    def __post_init__(self):
        renamed_fields(self)
        super().__post_init__()  # type: ignore[misc]  # (nn.Module's, next in the MRO)

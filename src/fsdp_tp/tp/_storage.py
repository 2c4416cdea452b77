"""A role's split added to a parameter's storage spec, whichever front end stores it: the
spec kept where it agrees with the role, else a :class:`~fsdp_tp.errors.RuleError` whose
suggested spec (``err.fix``) is accepted; and no parameter a role leaves whole split over an
axis roles compute on.

>>> from jax.sharding import PartitionSpec as P
>>> with_split("mlp/up/kernel", P("fsdp"), 2, (-1, "tensor", "up$"))   # FSDP's split, then the role's
P('fsdp', 'tensor')
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from .._axes import axes_named, entry_axes, entry_of
from .._types import AxisName
from ..errors import RuleError

__all__ = ["require_no_tp_axis", "spec_source", "with_split"]


def spec_source(rule_index: int | None, rules, annotated: bool) -> str:
    """Where a parameter's spec came from, as an error names it: a storage rule (by pattern),
    the model's own annotation, or the default."""
    if rule_index is not None:
        return f"storage rule {rules[rule_index].pattern!r}"
    return "the model's own sharding annotation" if annotated else "the default spec"


def _fix(entries: list, index: int, axis: AxisName) -> PartitionSpec:
    """The storage spec to write instead: ``axis`` off every dim, and dim ``index`` (which the
    role splits over ``axis``) holding at most ``axis`` first, then what it held (split further,
    as FSDP does), or what it held moved to the last free dim."""
    fixed = [tuple(a for a in entry_axes(e) if a != axis) for e in entries]
    moved, fixed[index] = fixed[index], ()
    free = [i for i, e in enumerate(fixed) if not e and i != index]
    if moved and free:
        fixed[free[-1]] = moved
    elif moved:
        fixed[index] = (axis, *moved)
    return PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in fixed))


def with_split(
    path: str,
    spec: PartitionSpec | None,
    ndim: int,
    split: tuple[int, AxisName, str],
    source: str = "the storage rule",
) -> PartitionSpec:
    """``spec`` (from ``source``: a storage rule, an annotation) with the role's ``(dim, axis,
    pattern)`` split added. A spec that already splits that dim over the axis agrees and is
    kept (first: a further split of the dim over other axes, as FSDP's, stays inside the
    role's slice); any other use of the axis, or another axis on that dim, is a ``RuleError``
    whose suggested spec (``err.fix``) is accepted.

    >>> from jax.sharding import PartitionSpec as P
    >>> with_split("mlp/up/kernel", P("fsdp"), 2, (-1, "tensor", "up$"))
    P('fsdp', 'tensor')
    >>> with_split("mlp/up/kernel", P("fsdp", "tensor"), 2, (-1, "tensor", "up$"))   # agrees
    P('fsdp', 'tensor')
    """
    dim, axis, pattern = split
    entries = list(spec or ()) + [None] * (ndim - len(spec or ()))
    index = dim % ndim
    here = entry_axes(entries[index])
    elsewhere = [i for i, e in enumerate(entries) if i != index and axis in entry_axes(e)]
    if here[:1] == (axis,) and axis not in here[1:] and not elsewhere:
        return PartitionSpec(*entries)  # it agrees with the role's split
    if not here and not elsewhere:
        entries[index] = axis
        return PartitionSpec(*entries)
    fix = _fix(entries, index, axis)
    given = PartitionSpec(*entries)
    if elsewhere:
        why = f"splits dim {elsewhere[0]} over {axis!r}, but tp rule {pattern!r} splits dim {index} over it"
    elif axis in here:
        why = f"splits dim {index} over {entries[index]!r}; tp rule {pattern!r} needs {axis!r} first there"
    else:
        why = (
            f"splits dim {index} over {entries[index]!r}, and tp rule {pattern!r} computes on its "
            f"slices over {axis!r}"
        )
    err = RuleError(
        f"{path}: {source} gives {given}: it {why}; an axis splits one dim of a parameter. "
        f"Store it as {fix} (the role adds {axis!r} on dim {index}, or keeps it there)."
    )
    err.fix = fix  # type: ignore[attr-defined]  # what the message suggests, for tests to apply
    raise err


def require_no_tp_axis(path: str, spec: PartitionSpec, tp_axes: frozenset, source: str) -> None:
    """A parameter no role splits may not be split over an axis roles compute on: that axis is
    never gathered, so its module would compute on a slice it does not expect."""
    if used := [a for a in axes_named(spec) if a in tp_axes]:
        fix = PartitionSpec(*(entry_of(tuple(a for a in entry_axes(e) if a not in tp_axes)) for e in spec))
        err = RuleError(
            f"{path}: {source} gives {spec}, splitting it over {used[0]!r}, which tp rules compute "
            f"over; no tp rule's role splits this parameter, so nothing would compute on its slices. "
            f"Store it as {fix}, or name its module in a tp rule."
        )
        err.fix = fix  # type: ignore[attr-defined]
        raise err

"""tp rules, whichever front end applies them: the rules checked, the role's split added to
a storage spec, and the errors that name a rule that works.

A front end says which of its module classes are which layer kind (:class:`Kinds`); the
rest (which rule names which submodule, the splits, every error's wording) is here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from ._axes import entry_axes
from ._layout import axis_text, require_divisible
from ._types import AxisName
from .errors import RuleError
from .rules import split_rule
from .tp_roles import ROLES, Layer, TPRole

__all__ = [
    "CompiledRole",
    "Kinds",
    "compile_tp_rules",
    "dims",
    "kind_error",
    "require_all_matched",
    "require_divides",
    "role_of",
    "slice_error",
    "with_split",
]

_ROLES = ", ".join(r.__name__ for r in ROLES) + " from fsdp_tp.tp_rules"


@dataclasses.dataclass(frozen=True)
class CompiledRole:
    pattern: str
    regex: Any
    role: TPRole


@dataclasses.dataclass(frozen=True)
class Kinds:
    """A front end's module classes per layer kind (``"dense"``: ``nn.Dense``, ...) and the
    prefix its users write them with (``nn``, ``nnx``)."""

    prefix: str
    classes: Mapping[str, tuple[type, ...]]

    def of(self, cls: type) -> str | None:
        return next((kind for kind, types in self.classes.items() if issubclass(cls, types)), None)

    def spelled(self, kinds: Sequence[str], sep: str = " or ") -> str:
        types = [t for kind in kinds for t in self.classes.get(kind, ())]
        return sep.join(f"{self.prefix}.{t.__name__}" for t in types)

    def roles_for(self, cls: type) -> list[str]:
        kind = self.of(cls)
        return [r.__name__ for r in ROLES if kind in r.kinds]


def compile_tp_rules(rules: Sequence, caller: str) -> tuple[CompiledRole, ...]:
    """Checks ``(pattern, role)`` pairs; a :class:`~fsdp_tp.errors.RuleError` names a bad one."""
    compiled = []
    for rule in rules:
        pattern, regex, role = split_rule(
            rule, caller, "(pattern, role) pair, e.g. ('Dense_0$', ColumnParallel())"
        )
        if not isinstance(role, TPRole):
            raise RuleError(f"{caller}: tp rule {pattern!r} -> {role!r}: give a role, one of {_ROLES}.")
        compiled.append(CompiledRole(pattern, regex, role))
    return tuple(compiled)


def dims(value) -> tuple:
    """A layer attribute that is one size or a sequence of them, as a tuple."""
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def slice_error(path: str, role: TPRole, err: Exception) -> RuleError:
    """A module a role computes met inputs of other sizes than its slices (a row layer fed whole)."""
    return RuleError(
        f"{path} ({type(role).__name__}) cannot compute on its slices: {err}. A RowParallel layer "
        f"takes the split features a ColumnParallel (or HeadParallel) layer returns; its input "
        f"arrived with other sizes. Make the layer before it ColumnParallel, or this one ColumnParallel."
    )


def role_of(path: str, rules: tuple[CompiledRole, ...]) -> tuple[TPRole, str, int] | None:
    """The first rule whose pattern is found in ``path``: ``(role, pattern, its index)``."""
    for index, rule in enumerate(rules):
        if rule.regex.search(path):
            return rule.role, rule.pattern, index
    return None


def kind_error(role: TPRole, pattern: str, cls: type, path: str, modules: Mapping[str, type], kinds: Kinds):
    """Names what the rule matched and a rule that works: never a pattern that is refused in turn."""
    name = type(role).__name__
    computes = kinds.spelled(role.kinds)
    what = f"tp rule {pattern!r} -> {name} matches {path or 'the model'}, a {cls.__name__}"
    if fits := kinds.roles_for(cls):
        other = " or ".join(f"{f}()" for f in fits)
        return RuleError(
            f"{what}, which {name} does not compute ({name} computes {computes}); give it {other}."
        )
    if below := _nameable(modules, kinds, path):
        first = (below[0][0], below[0][1][0])  # no submodule takes this role: the first takes another
        example, role_name = next(((p, name) for p, roles in below if name in roles), first)
        return RuleError(
            f"{what}; {name} computes {computes} on its slices. Name the submodules a role computes, "
            f"e.g. ('{example}$', {role_name}()); under {path or 'the model'}: {_listed(below)}."
        )
    every = "; ".join(f"{r.__name__}: {kinds.spelled(r.kinds, ', ')}" for r in ROLES)
    return RuleError(
        f"{what}, which has no tensor-parallel role and no submodule one computes (roles compute "
        f"{every}). Drop the rule; storage rules can still split its parameters."
    )


def _nameable(modules: Mapping[str, type], kinds: Kinds, under: str = "") -> list[tuple[str, list[str]]]:
    """``(path, roles)`` of the submodules (under ``under``) a role computes, outermost only:
    the projections inside an attention are its HeadParallel role's."""
    found: list[tuple[str, list[str]]] = []
    for path, cls in modules.items():
        if under and not path.startswith(f"{under}/"):
            continue
        roles = kinds.roles_for(cls)
        if roles and not any(path.startswith(f"{p}/") for p, _ in found):
            found.append((path, roles))
    return found


def _listed(nameable: list[tuple[str, list[str]]], most: int = 8) -> str:
    text = ", ".join(f"{p} ({' or '.join(roles)})" for p, roles in nameable[:most])
    return (text or "none") + (", ..." if len(nameable) > most else "")


def require_divides(role: TPRole, pattern: str, layer: Layer, size: int) -> None:
    """The axis size divides every size the role splits; else the one wording of the package."""
    for what, value in role.divides(layer).items():
        require_divisible(
            f"tp rule {pattern!r} -> {type(role).__name__}: {layer.path}",
            what,
            value,
            axis_text(role.axis),
            size,
            f"use a {role.axis!r} size that divides {value}, or leave {layer.path} whole "
            f"(drop it from the rules)",
        )


def with_split(
    path: str, spec: PartitionSpec | None, ndim: int, split: tuple[int, AxisName, str]
) -> PartitionSpec:
    """``spec`` (the storage rule's layout) with the role's ``(dim, axis, pattern)`` split added."""
    dim, axis, pattern = split
    entries = list(spec or ()) + [None] * (ndim - len(spec or ()))
    index = dim % ndim
    if entries[index] is not None:
        free = [i for i, e in enumerate(entries) if e is None and i != index]
        fixed = [None] * ndim
        if free:
            fixed[free[-1]] = entries[index]
        raise RuleError(
            f"{path}: the storage rule gives {PartitionSpec(*entries)}, splitting dim {index} over "
            f"{entries[index]!r}, and tp rule {pattern!r} computes on slices of dim {index} over {axis!r}; "
            f"split another dim in the storage rule for this parameter, e.g. {PartitionSpec(*fixed)}."
        )
    if any(axis in entry_axes(e) for e in entries):
        raise RuleError(
            f"{path}: the storage rule uses mesh axis {axis!r}, which tp rule {pattern!r} computes over; "
            f"an axis can split one dim. Use another axis in the storage rule."
        )
    entries[index] = axis
    return PartitionSpec(*entries)


def require_all_matched(
    rules: tuple[CompiledRole, ...],
    used: set[int],
    modules: Mapping[str, type],
    params: Sequence[str],
    kinds: Kinds,
) -> None:
    """Every tp rule named a submodule; else a RuleError listing the submodules a rule can name."""
    for index, rule in enumerate(rules):
        if index in used:
            continue
        named = [p for p in params if rule.regex.search(p)]
        hint = (
            f"it matches parameters ({', '.join(named[:3])}); tp rules name modules: drop the "
            f"parameter name, e.g. {named[0].rpartition('/')[0] + '$'!r}"
            if named
            else "fix the pattern or drop the rule"
        )
        raise RuleError(
            f"tp rule {rule.pattern!r} -> {type(rule.role).__name__} matches no submodule; {hint}. "
            f"Submodules a tp rule can name: {_listed(_nameable(modules, kinds))}."
        )

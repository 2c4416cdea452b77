"""The core of TP by rules: a submodule a rule names runs on its slices, from outside.

An ``nn.intercept_methods`` interceptor sees every submodule call of the transformed
model. At init it lets a named submodule create its full parameters from its own rng
(so the init is the unsplit model's, bit for bit) and records, per parameter path, the
dim its role splits, which the transform's :func:`~fsdp_tp.linen._transform.store` adds to the
rule's layout (:func:`with_split`). At apply it runs a clone of the submodule bound to
the same scope, with the attributes that make it compute on the local sizes (a
``Dense`` with ``features / size``), so flax reads the stored slices as the module's
own parameters; the role puts the collectives around that call
(:mod:`fsdp_tp.tp_rules`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import errors as flax_errors
from jax.sharding import PartitionSpec

from .._axes import entry_axes, require_axes
from .._layout import axis_text, require_divisible
from .._tree import module_path
from .._types import AxisName
from ..errors import RuleError
from ..rules import split_rule
from .tp_rules import ROLES, TPRole

__all__ = ["CompiledRole", "Seen", "compile_tp_rules", "local_compute", "require_all_matched", "with_split"]

_ROLES = ", ".join(r.__name__ for r in ROLES) + " from fsdp_tp.linen.tp_rules"
_ROLE_KINDS = "; ".join(f"{r.__name__}: " + ", ".join(f"nn.{k.__name__}" for k in r.kinds) for r in ROLES)


@dataclasses.dataclass(frozen=True)
class CompiledRole:
    pattern: str
    regex: Any
    role: TPRole


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


@dataclasses.dataclass
class Seen:
    """What one init of the model saw: every submodule (path -> class), the splits the
    roles make (parameter path -> (dim, axis, pattern)), the rules that matched, the
    parameter paths the transform stored; and the local clones of one call."""

    modules: dict[str, type] = dataclasses.field(default_factory=dict)
    params: list[str] = dataclasses.field(default_factory=list)
    splits: dict[str, tuple[int, AxisName, str]] = dataclasses.field(default_factory=dict)
    used: set[int] = dataclasses.field(default_factory=set)
    clones: dict[tuple, tuple[nn.Module, nn.Module]] = dataclasses.field(default_factory=dict)


# Clones running on slices pass through the interceptor; the children of a module a role
# governs get their roles from it (``inner``), not from the rules.
_LOCAL: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("fsdp_tp_local", default=frozenset())
_WITHIN: contextvars.ContextVar[tuple[str, dict]] = contextvars.ContextVar("fsdp_tp_within", default=("", {}))


@contextlib.contextmanager
def local_compute(rules: tuple[CompiledRole, ...], seen: Seen) -> Iterator[None]:
    """Within: every submodule a rule names computes on its slices (records ``seen`` at init)."""
    with nn.intercept_methods(functools.partial(_intercept, rules, seen)):
        yield


def _role_of(path: str, rules: tuple[CompiledRole, ...]) -> tuple[TPRole, str, int | None] | None:
    within, inner = _WITHIN.get()
    if within and path.startswith(within + "/"):
        name = path[len(within) + 1 :]
        return (inner[name], f"{within} (inside)", None) if name in inner else None
    for index, rule in enumerate(rules):
        if rule.regex.search(path):
            return rule.role, rule.pattern, index
    return None


def _intercept(rules, seen: Seen, next_fun, args, kwargs, context):
    module: nn.Module = context.module
    if id(module) in _LOCAL.get():
        return next_fun(*args, **kwargs)
    path = module_path(module.path)
    initializing = module.is_initializing()
    if initializing and context.method_name == "__call__":
        seen.modules.setdefault(path, type(module))
    found = _role_of(path, rules)
    if found is not None and context.method_name == "setup" and not initializing:
        # flax runs a setup-style module's setup (nn.Embed reads its table there) before any
        # interceptor sees the call; the clone runs its own, on the local sizes.
        return None
    if found is None or context.method_name not in found[0].methods:
        return next_fun(*args, **kwargs)
    role, pattern, index = found
    if not isinstance(module, role.kinds):
        next_fun(*args, **kwargs)  # to name the module's children in the error
        raise _kind_error(role, pattern, module, path, seen)
    (axis,) = require_axes(role.axis, f"tp rule {pattern!r}")
    size = jax.lax.axis_size(axis)
    token = _WITHIN.set((path, role.inner()))
    try:
        if initializing:
            if index is not None:
                seen.used.add(index)
            _require_divisible(role, pattern, module, path, args, kwargs, size)
            for name, dim in role.splits(module).items():
                seen.splits[f"{path}/{name}"] = (dim, axis, pattern)
            return next_fun(*args, **kwargs)
        local = _clone(seen, module, role.local(module, args, kwargs, size))
        return role.around(
            context.method_name, _runner(local, context.method_name, role, path), module, args, kwargs
        )
    finally:
        _WITHIN.reset(token)


def _clone(seen: Seen, module: nn.Module, attributes: dict) -> nn.Module:
    """The module with ``attributes``, bound to its scope; one per module, so a second method
    call (``nn.Embed.attend`` after ``__call__``) does not run a setup-style module's setup twice."""
    key = (id(module), tuple(sorted(attributes.items())))
    if key not in seen.clones:  # the module is kept with its clone, so its id is not reused
        seen.clones[key] = (module, module.clone(parent=module.scope, **attributes))
    return seen.clones[key][1]


def _runner(local: nn.Module, method: str, role: TPRole, path: str):
    def run(*args, **kwargs):
        token = _LOCAL.set(_LOCAL.get() | {id(local)})
        try:
            return getattr(local, method)(*args, **kwargs)
        except flax_errors.ScopeParamShapeError as err:
            raise RuleError(
                f"{path} ({type(role).__name__}) cannot compute on its slices: {err}. A RowParallel layer "
                f"takes the split features a ColumnParallel (or HeadParallel) layer returns; its input "
                f"arrived with other sizes. Make the layer before it ColumnParallel, or this one "
                f"ColumnParallel."
            ) from None
        finally:
            _LOCAL.reset(token)

    return run


def _kind_error(role: TPRole, pattern: str, module: nn.Module, path: str, seen: Seen) -> RuleError:
    """Names what the rule matched and a rule that works: never a pattern that is refused in turn."""
    name = type(role).__name__
    kinds = " or ".join(f"nn.{k.__name__}" for k in role.kinds)
    what = f"tp rule {pattern!r} -> {name} matches {path or 'the model'}, a {type(module).__name__}"
    fits = [r.__name__ for r in ROLES if isinstance(module, r.kinds)]
    if fits:
        other = " or ".join(f"{f}()" for f in fits)
        return RuleError(f"{what}, which {name} does not compute ({name} computes {kinds}); give it {other}.")
    below = _nameable(seen, path)
    if below:
        first = (below[0][0], below[0][1][0])  # no submodule takes this role: the first takes another
        example, role_name = next(((p, name) for p, roles in below if name in roles), first)
        return RuleError(
            f"{what}; {name} computes {kinds} on its slices. Name the submodules a role computes, "
            f"e.g. ('{example}$', {role_name}()); under {path or 'the model'}: {_listed(below)}."
        )
    return RuleError(
        f"{what}, which has no tensor-parallel role and no submodule one computes (roles compute "
        f"{_ROLE_KINDS}). Drop the rule; storage rules can still split its parameters."
    )


def _nameable(seen: Seen, under: str = "") -> list[tuple[str, list[str]]]:
    """``(path, roles)`` of the submodules (under ``under``) a role computes, outermost only:
    the projections inside an attention are its HeadParallel role's."""
    found: list[tuple[str, list[str]]] = []
    for path, cls in seen.modules.items():
        if under and not path.startswith(f"{under}/"):
            continue
        roles = [r.__name__ for r in ROLES if issubclass(cls, r.kinds)]
        if roles and not any(path.startswith(f"{p}/") for p, _ in found):
            found.append((path, roles))
    return found


def _listed(nameable: list[tuple[str, list[str]]], most: int = 8) -> str:
    text = ", ".join(f"{p} ({' or '.join(roles)})" for p, roles in nameable[:most])
    return (text or "none") + (", ..." if len(nameable) > most else "")


def _require_divisible(role, pattern, module, path, args, kwargs, size) -> None:
    for what, value in role.divides(module, args, kwargs).items():
        require_divisible(
            f"tp rule {pattern!r} -> {type(role).__name__}: {path}",
            what,
            value,
            axis_text(role.axis),
            size,
            f"use a {role.axis!r} size that divides {value}, or leave {path} whole (drop it from the rules)",
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


def require_all_matched(rules: tuple[CompiledRole, ...], seen: Seen) -> None:
    """Every tp rule named a submodule; else a RuleError listing the submodules a rule can name."""
    for index, rule in enumerate(rules):
        if index in seen.used:
            continue
        named = [p for p in seen.params if rule.regex.search(p)]
        hint = (
            f"it matches parameters ({', '.join(named[:3])}); tp rules name modules: drop the "
            f"parameter name, e.g. {named[0].rpartition('/')[0] + '$'!r}"
            if named
            else "fix the pattern or drop the rule"
        )
        raise RuleError(
            f"tp rule {rule.pattern!r} -> {type(rule.role).__name__} matches no submodule; {hint}. "
            f"Submodules a tp rule can name: {_listed(_nameable(seen))}."
        )

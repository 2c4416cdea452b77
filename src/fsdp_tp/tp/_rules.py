"""tp rules, whichever front end applies them: the rules checked, and the errors that name a
rule that works (a role's split added to a storage spec: :mod:`fsdp_tp.tp._storage`).

A front end says which of its module classes are which layer kind
(:class:`~fsdp_tp.tp._protocol.Kinds`); the rest (which rule names which submodule, the splits,
every error's wording) is here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping, Sequence
from typing import Any

import jax

from .._axes import require_axes
from ..errors import RuleError
from ..rules import split_rule
from ._protocol import Kinds
from ._registered import computes_of
from ._role import placements
from ._roles import ROLES, ColumnParallel, Layer, RowParallel, TPRole

__all__ = [
    "CompiledRole",
    "compile_tp_rules",
    "dims",
    "kind_error",
    "require_all_matched",
    "require_divides",
    "require_own_parameters",
    "role_of",
    "slice_error",
]

_ROLES = ", ".join(r.__name__ for r in ROLES) + " from fsdp_tp.tp"


@dataclasses.dataclass(frozen=True)
class CompiledRole:
    pattern: str
    regex: Any
    role: TPRole


def compile_tp_rules(rules: Sequence, caller: str) -> tuple[CompiledRole, ...]:
    """Checks ``(pattern, role)`` pairs (or a :class:`~fsdp_tp.tp._find.plan.TPPlan`, which iterates
    as its rules); a :class:`~fsdp_tp.errors.RuleError` names a bad one."""
    if isinstance(rules, str) and rules == "auto":
        raise RuleError(
            f"{caller}: tp_rules='auto' finds the plan from what the model computes on its inputs, for the "
            f"tensor axis's size, neither of which {caller} sees; find the plan and pass it: "
            f"tp_rules=find_tp_rules(model, *inputs, size=tensor size) (fsdp_tp.nnx.find_tp_rules for an "
            f"NNX model, fsdp_tp.linen.find_tp_rules for Linen), or give 'auto' to shard_by_rules "
            f"(with inputs= for NNX)."
        )
    if isinstance(rules, str) and rules.strip().lower() == "auto":
        raise RuleError(
            f"{caller}: tp_rules={rules!r}: the finder is spelled tp_rules='auto', in lower case."
        )
    if isinstance(rules, TPRole):
        raise RuleError(
            f"{caller}: tp_rules={rules!r} is a role alone; give a list of (pattern, role) pairs naming the "
            f"layers it splits, e.g. tp_rules=[('up$', {rules!r})]."
        )
    one = isinstance(rules, tuple | list) and len(rules) == 2 and isinstance(rules[1], TPRole)
    if isinstance(rules, str) or one:
        example = f"[{rules!r}]" if one else f"[({rules!r}, ColumnParallel())]"
        raise RuleError(
            f"{caller}: tp_rules={rules!r} is {'one pair' if one else 'a string'}; give a list of "
            f"(pattern, role) pairs, e.g. tp_rules={example}."
        )
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
    """A module a role computes met inputs of other sizes than its slices: a row layer fed
    whole (no column layer before it), or a column layer fed split (a column layer before it
    whose split never ended at a row layer). ``err``: what the module raised."""
    name = type(role).__name__
    if isinstance(role, RowParallel):
        return RuleError(
            f"{path} ({name}) takes the split features a ColumnParallel (or HeadParallel) layer "
            f"returns, and its input arrived whole ({err}). Fix: make the layer that feeds {path} "
            f"ColumnParallel, or drop {path}'s rule so it stays whole."
        )
    return RuleError(
        f"{path} ({name}) reads its input whole, and it arrived split ({err}): the layer before it "
        f"leaves its features split (a ColumnParallel or HeadParallel layer's split ends only at a "
        f"RowParallel one). Fix: make {path} RowParallel, so the split ends here, or drop the rule "
        f"of the layer before it."
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
    every = "; ".join(
        f"{r.__name__}: {kinds.spelled(r.kinds, ', ')}" for r in ROLES if "module" not in r.kinds
    )
    return RuleError(
        f"{what}, which has no tensor-parallel role and no submodule one computes (roles compute "
        f"{every}). If it computes an einsum of its input and one kernel parameter, tell the roles so: "
        f"fsdp_tp.tp.register_einsum({cls.__name__}, equation, kernel=..., sizes=...); if its own code "
        f"reads several raw kernels, name each one's split: fsdp_tp.tp.Region(dims={{'<parameter>': "
        f"<dim from the end>, ...}}); else drop the rule (storage rules can still split its parameters)."
    )


def _parameter_hint(named: Sequence[str], modules: Mapping[str, type], kinds: Kinds) -> str:
    """The fix for a tp rule that names parameters: their module where a role computes it; a
    module of raw parameters its own code reads (an MoE block's ``(E, d, h)`` experts, a
    one-module SwiGLU) no role computes, so the fix is a layer per kernel, not its name."""
    owner = named[0].rpartition("/")[0]
    said = f"it matches parameters ({', '.join(named[:3])}); tp rules name modules"
    if (cls := modules.get(owner)) is not None and kinds.roles_for(cls):
        return f"{said}: drop the parameter name, e.g. {owner + '$'!r}"
    region = f"({owner + '$'!r}, Region(dims={{'<parameter>': <dim from the end>, ...}}))"
    return (
        f"{said}, and {owner or 'the model'} is {f'a {cls.__name__}' if cls else 'a module'} whose own code "
        f"reads its raw parameters, which no column or row role computes, so naming a parameter splits "
        f"nothing. Fix: name the module and each kernel's split, {region} (fsdp_tp.tp.Region: its "
        f"einsums run on the blocks, the output summed); or give each kernel a layer of its own "
        f"(nnx.Einsum or nnx.Linear, nn.Einsum or nn.Dense, or a class of yours registered with "
        f"fsdp_tp.tp.register_einsum) and name those, or leave {owner or 'it'} whole (drop the rule; "
        f"storage rules still split its parameters over fsdp)"
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


def require_divides(role: TPRole, pattern: str, layer: Layer) -> None:
    """:meth:`TPRole.require_divides` for a tp rule, in the step (where its axes are bound):
    the role and each of its parts over its own mesh axis (an expert kernel's split within), the
    rule named, the fix to change the axis or drop the rule."""
    for part in role.parts():
        (axis,) = require_axes(part.axis, f"tp rule {pattern!r}")
        size = jax.lax.axis_size(axis)

        def fix(value: int, part: TPRole = part, size: int = size) -> str:
            # An einsum's letter the axis is larger than (kv heads) can be kept whole, a block each.
            kept = layer.kind == "einsum" and isinstance(part, ColumnParallel) and size % value == 0
            whole = ", or keep its kernel whole with each device's block of the letter: replicated=True"
            return (
                f"use a {part.axis!r} size that divides {value}, or leave {layer.path} whole "
                f"(drop it from the rules)" + (whole if kept else "")
            )

        part.require_divides(layer, size, f"tp rule {pattern!r} -> {type(part).__name__}: {layer.path}", fix)


def add_placements(
    splits: dict, path: str, role: TPRole, layer: Layer, pattern: str, present: Container[str] | None = None
) -> None:
    """Records in ``splits`` (parameter path -> its ``(dim, axis, pattern)`` splits) each split
    ``role`` and its parts make of the parameters of ``layer`` at module ``path`` (of those in
    ``present`` where given: a layer without a bias has no bias to split)."""
    for name, dim, axis in placements(role, layer):
        if present is None or f"{path}/{name}" in present:
            splits[f"{path}/{name}"] = (*splits.get(f"{path}/{name}", ()), (dim, axis, pattern))


def require_own_parameters(role: TPRole, pattern: str, layer: Layer, cls: type, names: Sequence[str]) -> None:
    """A dense, conv or einsum layer whose parameters are more than the role splits (a LoRA
    layer's ``lora_a`` / ``lora_b``; a registered class's bias) computes with parameters the
    role does not split: refused at the rule or the init, not at the first step. A module of raw
    kernels (:class:`~fsdp_tp.tp.Region`): each parameter its role names is one it holds."""
    if layer.kind == "module":
        if missing := sorted(set(role.splits(layer)) - set(names)):
            raise RuleError(
                f"tp rule {pattern!r} -> {type(role).__name__} matches {layer.path}, a {cls.__name__} "
                f"holding the parameters {sorted(names)}, and names {missing}, which it does not hold: "
                f"name the parameters as the module holds them (their paths under {layer.path})."
            )
        return
    if layer.kind not in ("dense", "conv", "einsum"):
        return
    own = computes_of(cls)
    made = [n.rpartition("/")[2] for n in names]
    if own is not None and own.kernel not in made:
        raise RuleError(
            f"tp rule {pattern!r} -> {type(role).__name__} matches {layer.path}, a {cls.__name__} "
            f"registered with kernel={own.kernel!r}, and it makes the parameters {made}: register it "
            f"with kernel= the name of its einsum's kernel (register_einsum({cls.__name__}, "
            f"{own.equation!r}, kernel=..., replace=True))."
        )
    if extra := [n for n in names if n.rpartition("/")[2] not in layer.parameters]:
        raise RuleError(
            f"tp rule {pattern!r} -> {type(role).__name__} matches {layer.path}, a {cls.__name__} that "
            f"also computes with {', '.join(extra)}, which {type(role).__name__} does not split (it "
            f"splits {' and '.join(layer.parameters)}). Fix: give each kernel a module of its own (a class "
            f"per einsum registered with register_einsum, or nnx.Einsum / nn.Einsum) and a rule each; or "
            f"leave {layer.path} whole: drop its rule and those of the layers split with it (the column "
            f"layers that feed a row layer, the row layer a column layer feeds; storage rules can still "
            f"split its parameters)."
        )


def require_all_matched(
    rules: tuple[CompiledRole, ...],
    used: set[int],
    modules: Mapping[str, type],
    params: Sequence[str],
    kinds: Kinds,
) -> None:
    """Every tp rule named a submodule; else a RuleError listing the submodules a rule can name,
    or, where it names one inside a module whose role runs its call again, saying so."""
    for index, rule in enumerate(rules):
        if index in used:
            continue
        _require_outside_rerun_calls(rule, [rules[i] for i in sorted(used)], modules)
        named = [p for p in params if rule.regex.search(p)]
        hint = _parameter_hint(named, modules, kinds) if named else "fix the pattern or drop the rule"
        raise RuleError(
            f"tp rule {rule.pattern!r} -> {type(rule.role).__name__} matches no submodule; {hint}. "
            f"Submodules a tp rule can name: {_listed(_nameable(modules, kinds))}."
        )


def _require_outside_rerun_calls(
    rule: CompiledRole, used: Sequence[CompiledRole], modules: Mapping[str, type]
) -> None:
    """A rule that matched nothing because the submodules it names are inside a module whose
    role runs its call again (:meth:`~fsdp_tp.tp.TPRole.runs_call_again`): that, and the fix."""
    for path in (p for p in modules if p and rule.regex.search(p)):
        for outer in (r for r in used if r.role.runs_call_again()):
            inside = (a for a in modules if a and path.startswith(a + "/") and outer.regex.search(a))
            if (bank := next(inside, None)) is not None:
                role = f"{type(outer.role).__name__}(dims=...)"
                raise RuleError(
                    f"tp rule {rule.pattern!r} -> {type(rule.role).__name__} names {path}, inside {bank}, "
                    f"whose role (tp rule {outer.pattern!r} -> {role}) runs its call again operation by "
                    f"operation: a role inside it never runs. Fix: drop the rule ({path} then "
                    f"computes whole on the tokens each device holds, as find_tp_rules leaves it), or move "
                    f"it out of {bank} to give it a role."
                )

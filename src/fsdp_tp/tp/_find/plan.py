"""The plan ``tp_rules="auto"`` finds (:class:`TPPlan`: rules a user would write, and the
layers left whole with the reason), and what "auto" says of the layers it leaves whole
(:func:`warn_left_whole`); the axis it splits over and its size under the mesh:
:mod:`fsdp_tp.tp._find.mesh`.
:mod:`fsdp_tp.tp.auto` finds the plan and is where these are imported from.

>>> from fsdp_tp.tp import ColumnParallel, RowParallel
>>> plan = TPPlan(((r"^up$", ColumnParallel()), (r"^down$", RowParallel())),
...               {"up": ColumnParallel(), "down": RowParallel()}, (("head", "a norm's mean"),),
...               ("up", "down", "head"))
>>> plan.differences([(r"^up$", ColumnParallel())])
['down: the plan RowParallel(), the rules whole']
>>> spelled(plan.scheduled(sequence_dim=1).rules[0][1])
'ColumnParallel(sequence_dim=1)'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..._axes import TENSOR
from ..._context import CHECK
from ..._trace.relations import DRAWN
from ...errors import LayerLeftWholeWarning, RuleError, warn
from .._einsum import Equation
from .._experts import EXPERT
from .._matmul import ColumnParallel, RowParallel
from .._roles import Layer, TPRole
from .._rules import compile_tp_rules, role_of
from .mesh import AUTO_AXIS

# How a module of raw kernels is named where a plan leaves it whole, and what would split it
RAW = "its own code reads raw parameters through matmuls"
RAW_FIX = (
    "no split of its kernels begins and is summed inside its code (a Region's), so give each kernel "
    "a layer of its own (an einsum module: nnx.Einsum, nn.Einsum, or a class registered with "
    "fsdp_tp.tp.register_einsum) to split it"
)

__all__ = [
    "RAW",
    "RAW_FIX",
    "TPPlan",
    "ancestors",
    "fitted",
    "letter_hints",
    "rules_for",
    "spelled",
    "warn_left_whole",
]


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """``rules``: the ``(pattern, role)`` pairs found (pass them as ``tp_rules=``, edit or pin
    them); ``roles``: the role each module gets; ``whole``: ``(module, why)`` for each layer a
    role could compute that the plan leaves whole; ``layers``: every module a role could
    compute; ``regions``: the modules of each region (split together or not at all).
    ``str(plan)`` is the rules as Python."""

    rules: tuple[tuple[str, TPRole], ...]
    roles: Mapping[str, TPRole]
    whole: tuple[tuple[str, str], ...] = ()
    layers: tuple[str, ...] = ()
    regions: tuple[tuple[str, ...], ...] = ()

    def __iter__(self) -> Iterator[tuple[str, TPRole]]:
        """A plan is its rules: it goes wherever ``(pattern, role)`` pairs go (``tp_rules=``)."""
        return iter(self.rules)

    def without_region(self, module: str | None, why: str) -> TPPlan | None:
        """The plan with the region that holds ``module`` left whole, each of its modules named
        with ``why``; ``None`` where no region holds it."""
        region = next((r for r in self.regions if module in r), None)
        if region is None:
            return None
        roles = {path: role for path, role in self.roles.items() if path not in region}
        return dataclasses.replace(
            self,
            rules=rules_for(roles, list(self.layers)),
            roles=roles,
            whole=(*self.whole, *((path, why) for path in region)),
            regions=tuple(r for r in self.regions if r is not region),
        )

    def scheduled(self, sequence_dim: int | None = None, collective_matmul: str | None = None) -> TPPlan:
        """The same plan with sequence parallelism (``sequence_dim``: the activations' sequence
        dim, split between the layers) and ``collective_matmul`` rings, on every role that has
        them: how the plan's collectives run, not where it splits."""
        given: dict[str, Any] = {"sequence_dim": sequence_dim, "collective_matmul": collective_matmul}

        def timed(role: TPRole) -> TPRole:
            names = {f.name for f in dataclasses.fields(role)}
            return dataclasses.replace(role, **{k: v for k, v in given.items() if k in names})

        rules = tuple((pattern, timed(role)) for pattern, role in self.rules)
        return dataclasses.replace(self, rules=rules, roles={p: timed(r) for p, r in self.roles.items()})

    def differences(self, rules) -> list[str]:
        """Each module to which ``rules`` (``(pattern, role)`` pairs: hand-written, or another
        plan's) give another role than this plan does, as ``"path: the plan ..., the rules ..."``;
        empty where they agree on every module."""
        compiled = compile_tp_rules(rules, "TPPlan.differences")
        out = []
        for path in self.layers:
            theirs = found[0] if (found := role_of(path, compiled)) else None
            if theirs != (ours := self.roles.get(path)):
                said = [spelled(r) if r is not None else "whole" for r in (ours, theirs)]
                out.append(f"{path}: the plan {said[0]}, the rules {said[1]}")
        return out

    def __str__(self) -> str:
        lines = ["tp_rules = ["]
        lines += [f'    (r"{pattern}", {spelled(role)}),' for pattern, role in self.rules]
        lines.append("]")
        if self.whole:
            lines.append("# left whole:")
            lines += [f"#   {path}: {why}" for path, why in self.whole]
        return "\n".join(lines)


def fitted(plan: TPPlan, attempt: Callable[[TPPlan], Any]) -> TPPlan:
    """``plan`` less each region the plan check refuses: ``attempt(plan)`` traces the model
    under the plan, which checks it (:mod:`fsdp_tp._check.driver`); a region it refuses is left
    whole, named with the check's reason, and the rest tried again. A refusal it cannot lay on
    one region (the model failing on its slices) is raised."""
    if CHECK.get().off:  # (inside the check's own trace, or a test's switched_off)
        return plan
    while True:
        try:
            attempt(plan)
            return plan
        except RuleError as err:
            reduced = plan.without_region(getattr(err, "module", None), getattr(err, "reason", str(err)))
            if reduced is None:
                raise
            plan = reduced


def ancestors(module: str) -> list[str]:
    """``module``'s path and each of its parents', outermost first: ``a``, ``a/b``, ``a/b/c``."""
    parts = module.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def rules_for(roles: Mapping[str, TPRole], paths: list[str]) -> tuple[tuple[str, TPRole], ...]:
    """A rule per role, its pattern the path with each index generalized (``block_\\d+``)
    where that names more than one module, each with this role; else the path itself."""
    rules, done = [], set()
    for path, role in roles.items():
        if path in done:
            continue
        pattern = "^" + re.sub(r"\d+", r"\\d+", re.escape(path)) + "$"
        matched = [p for p in paths if re.search(pattern, p)]
        if len(matched) < 2 or not all(roles.get(p) == role for p in matched):
            pattern, matched = "^" + re.escape(path) + "$", [path]
        rules.append((pattern, role))
        done |= set(matched)
    return tuple(rules)


def letter_hints(rules, layers: Mapping[str, Layer], found: TPPlan) -> str:
    """For each einsum layer a rule gives a column or row role where its equation offers
    several letters and the plan found from the model (``found``) gives it another role: the
    letter the role took (``letter=``, else the first), the others, and the found role.

    >>> from fsdp_tp.tp._rules import compile_tp_rules
    >>> from fsdp_tp.tp import ColumnParallel
    >>> kv = Layer("einsum", "kv", equation="BSD,CDKH->CBSKH", kernel_shape=(2, 16, 2, 8))
    >>> found = TPPlan((), {"kv": ColumnParallel(letter="K")})
    >>> rules = compile_tp_rules([("kv$", ColumnParallel())], "demo")
    >>> print(letter_hints(rules, {"kv": kv}, found))
     Einsum letters: kv: ColumnParallel() splits letter 'C' of 'BSD,CDKH->CBSKH', the first of
     'C', 'K', 'H'; the plan found gives ColumnParallel(letter='K').
    """
    hints = []
    for path, layer in layers.items():
        hit = role_of(path, rules) if layer.kind == "einsum" else None
        role = hit[0] if hit is not None else None
        if not isinstance(role, ColumnParallel | RowParallel):
            continue
        eq = Equation.parse(layer.equation, path)
        options = eq.produced if isinstance(role, ColumnParallel) else eq.contracted
        if len(options) < 2:
            continue
        better = found.roles.get(path)
        if better == role:
            continue  # (the plan found gives it the same role: its letter is not in question)
        said = "the plan leaves it whole" if better is None else f"the plan found gives {spelled(better)}"
        taken = f"{path}: {spelled(role)} splits letter {role.letter or options[0]!r} of {eq.text!r}"
        which = "the first" if role.letter is None else "one"
        hints.append(f"{taken}, {which} of {', '.join(map(repr, options))}; {said}")
    return f" Einsum letters: {'; '.join(hints)}." if hints else ""


def spelled(role: TPRole) -> str:
    """A role as a user writes it: its fields that differ from the defaults (a role inside it,
    ``within``, spelled so too)."""
    said = lambda value: spelled(value) if isinstance(value, TPRole) else repr(value)
    fields = [
        f"{f.name}={said(getattr(role, f.name))}"
        for f in dataclasses.fields(role)
        if getattr(role, f.name) != f.default
    ]
    return f"{type(role).__name__}({', '.join(fields)})"


def warn_left_whole(
    plan: TPPlan, size: int | None, caller: str, axis: str | None = TENSOR, experts: int | None = None
) -> None:
    """Names, once per plan ``tp_rules="auto"`` finds, each layer it leaves whole and why
    (:class:`~fsdp_tp.errors.LayerLeftWholeWarning`): a user who asked for tensor
    parallelism learns which layers do not get it without reading ``tp_plans``.

    >>> import warnings
    >>> plan = TPPlan((), {}, (("head", "a norm's mean over its features"),), ("head",))
    >>> with warnings.catch_warnings(record=True) as said:
    ...     warnings.simplefilter("always")
    ...     warn_left_whole(plan, 4, "shard_by_rules(LM)")
    >>> str(said[0].message).split(", each")[0]
    "shard_by_rules(LM): tp_rules='auto' on tensor=4 leaves 1 of 1 layers whole"
    """
    # (no tensor axis: every layer but the experts is whole, as asked; a module of raw kernels,
    # which no role computes, raw experts too, is named on an expert axis as well)
    whole = plan.whole if axis is not None else tuple((p, why) for p, why in plan.whole if RAW in why)
    if not whole or (axis is None and experts is None):
        return
    named, sized = (AUTO_AXIS, size) if axis is not None else (EXPERT, experts)
    names = "; ".join(f"{path} ({why})" for path, why in whole)
    noisy = [path for path, why in whole if DRAWN in why]
    numbers = (
        "The numbers are the unsharded model's"
        if not noisy
        else f"The numbers are not the unsharded model's where the model draws random numbers itself "
        f"({', '.join(noisy)}): a draw of its own (not a dropout layer's, whose mask the library "
        f"draws block by block) is made on each device's block from the key that device is "
        f"given, another draw than the unsharded model's, whether or not the layer is split"
    )
    warn(
        LayerLeftWholeWarning(
            f"{caller}: tp_rules='auto' on {named}={sized} leaves {len(whole)} of "
            f"{len(plan.layers) + sum(RAW in why for _, why in plan.whole)} layers whole, each held and "
            f"computed in full on every {named} device: {names}. {numbers}; to split a layer, "
            f"change what its split meets (the plan: .tp_plans[{size}]), or silence this with "
            f"warnings.filterwarnings('ignore', category=fsdp_tp.errors.LayerLeftWholeWarning)."
        )
    )

"""The bytes one device's step sends, read off its per-device program, on a mesh of any size.

A per-device program (a jaxpr traced under ``jax.shard_map``, as :mod:`fsdp_tp._trace.per_device` gives
it) names each collective with its axes and its operand's shape and dtype: that is all the
ring model of ``docs/design.md`` needs, so no device and no compiler is asked. Each collective
becomes an :class:`~fsdp_tp.analysis.Collective` (the record the HLO parser gives, with the
same ``wire_bytes``), executed once per trip of every ``scan`` around it, at any depth: the
re-gathers of ``jax.checkpoint``'s recomputation are in the backward pass's program and are
counted. What the program asks for is counted: a backend may widen it (XLA:CPU moves a bf16
gather as f32; the 8-bit policies' bits are u8 everywhere).

>>> import jax, jax.numpy as jnp
>>> gathered = lambda w: jax.lax.all_gather(w, "fsdp", tiled=True).sum()   # one device's program
>>> inner = jax.make_jaxpr(gathered, axis_env=[("fsdp", 4)])(jnp.ones(256))
>>> [(c.kind, c.operand_bytes, c.group_size, c.wire_bytes) for c in step_collectives(inner, {"fsdp": 4})]
[('all-gather', 1024, 4, 3072)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jax.extend import core

from . import Collective, array_bytes
from ._step_memory import is_collective

__all__ = ["UncountedWire", "step_collectives", "step_wire", "wire_lines"]

_KINDS = {
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",  # (VocabParallel's logits: the same bytes, another type)
    "reduce_scatter": "reduce-scatter",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}
# Collectives that move nothing: check_vma's type markers and a device's own index.
_FREE = {"pvary", "pcast", "axis_index"}


class UncountedWire(Exception):
    """The program holds what the ring model cannot count: a collective it does not know, or
    one inside a loop of unknown trips (a ``while``) or a branch (a ``cond``)."""


def step_collectives(jaxpr: core.Jaxpr | core.ClosedJaxpr, mesh: Mapping[str, int]) -> list[Collective]:
    """Every collective ``jaxpr`` runs, with its executions per call, on ``mesh`` (axis sizes)."""
    return [c for _, c in _by_axes(jaxpr, mesh)]


def _by_axes(jaxpr, mesh: Mapping[str, int]) -> list[tuple[str, Collective]]:
    """Each collective with the axes it crosses (``"data, fsdp"``)."""
    found: list[tuple[str, Collective]] = []
    _visit(jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr, dict(mesh), 1, found, "")
    return found


def _visit(jaxpr: core.Jaxpr, mesh: dict, times: int, found: list, inside: str) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if is_collective(eqn):
            if name in _FREE:  # (moves nothing, in a branch too: the ring's skipped blocks retype)
                continue
            if inside:
                raise UncountedWire(f"a {name} inside a {inside}")
            found.append(_collective(eqn, mesh, times))
            continue
        trips = times * eqn.params["length"] if name == "scan" else times
        unknown = inside or (name if name in ("while", "cond") else "")
        for body in _bodies(eqn):
            _visit(body, mesh, trips, found, unknown)


def _collective(eqn, mesh: dict, times: int) -> tuple[str, Collective]:
    name = eqn.primitive.name
    if name not in _KINDS:
        raise UncountedWire(f"the collective {name}")
    axes = eqn.params.get("axis_name", eqn.params.get("axes"))
    axes = axes if isinstance(axes, tuple) else (axes,)
    operands = [v.aval for v in eqn.invars]
    return ", ".join(map(str, axes)), Collective(
        kind=_KINDS[name],
        name=name,
        computation="",
        operand_bytes=sum(array_bytes(a) for a in operands),
        operands=len(operands),
        group_size=math.prod(mesh[a] for a in axes),
        executions=times,
        operand_types=tuple(a.str_short() for a in operands),
    )


def _bodies(eqn) -> list[core.Jaxpr]:
    """The programs an equation runs: a loop's, a branch's, a call's or remat's body."""
    out = []
    for param in eqn.params.values():
        for p in param if isinstance(param, tuple) else (param,):
            if isinstance(p, core.ClosedJaxpr):
                out.append(p.jaxpr)
            elif isinstance(p, core.Jaxpr):
                out.append(p)
    return out


def step_wire(jaxpr, mesh: Mapping[str, int]) -> tuple[dict[str, dict[str, float]] | None, str]:
    """The bytes of :func:`step_collectives` by the axes they cross and the kind of collective,
    largest first (``{"fsdp": {"all-gather": ..., ...}, ...}``), and ``""``; or ``None`` and what
    the count cannot read. Collectives over axes of size 1 move nothing and are left out."""
    try:
        found = _by_axes(jaxpr, mesh)
    except UncountedWire as err:
        return None, str(err)
    wire: dict[str, dict[str, float]] = {}
    for axes, c in found:
        if not c.wire_bytes:  # (over an axis of size 1)
            continue
        kinds = wire.setdefault(axes, {})
        kinds[c.kind] = kinds.get(c.kind, 0.0) + c.wire_bytes
    by_size = lambda item: -sum(item[1].values())
    return {
        axes: dict(sorted(k.items(), key=lambda kv: -kv[1])) for axes, k in sorted(wire.items(), key=by_size)
    }, ""


def wire_lines(wire: Mapping[str, Mapping[str, float]] | None, note: str) -> list[str]:
    """The plan's lines for ``step_wire``'s figures."""
    if wire is None:
        return [f"wire of one step, per device: not counted ({note})"] if note else []
    out = ["wire of one step's forward and backward, per device (ring model, as the program asks):"]
    for axes, kinds in wire.items():
        each = ", ".join(f"{kind} {round(n):,} B" for kind, n in kinds.items())
        out.append(f"  over {axes}: {each}")
    return out if wire else [out[0] + " none"]

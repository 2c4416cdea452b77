"""Exact measurements: state bytes per device, compiled memory, collective bytes from HLO.

The collective figures use the ring model of ``docs/design.md`` ("How we measure"): per
device and per execution, an all-gather moves result*(S-1)/S bytes, a
reduce-scatter operand*(S-1)/S, an all-reduce 2*operand*(S-1)/S, an all-to-all
operand*(S-1)/S and a collective-permute its operand; ops inside while loops
count once per known trip.

>>> hlo = "\\n".join([
...     "ENTRY %main (p: f32[256]) -> f32[1024] {",
...     "  %p = f32[256]{0} parameter(0)",
...     "  ROOT %ag = f32[1024]{0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}",
...     "}"])
>>> [(c.kind, c.operand_bytes, c.group_size, c.wire_bytes) for c in parse_collectives(hlo)]
[('all-gather', 1024, 4, 3072)]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax
import numpy as np

from ._axes import entry_axes
from ._types import PyTree

__all__ = [
    "Collective",
    "collective_summary",
    "compiled_memory",
    "dot_flops",
    "ideal_bytes_per_device",
    "operand_count",
    "parse_collectives",
    "state_bytes_per_device",
    "type_bytes",
]

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program, with its bytes on the wire per device."""

    kind: str
    name: str
    computation: str
    operand_bytes: int
    operands: int
    group_size: int
    executions: int
    operand_types: tuple[str, ...] = ()  # e.g. ("f32[64,256]",), to tell a gradient from an activation

    @property
    def wire_bytes(self) -> float:
        """Ring-model bytes sent per device over all executions of this op."""
        s, n = self.group_size, self.operand_bytes
        per_run = {
            "all-gather": n * (s - 1),
            "reduce-scatter": n * (s - 1) / s,
            "all-reduce": 2 * n * (s - 1) / s,
            "all-to-all": n * (s - 1) / s,
            "collective-permute": n,
        }[self.kind]
        return per_run * self.executions


def type_bytes(text: str) -> int:
    """The bytes of every array type an HLO text names (``f32[4,2]`` is 32; a float8 one byte).

    >>> type_bytes("(f32[4,2]{1,0}, u8[16])")
    48
    """
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
    return total


def _split_type(rhs: str) -> tuple[str, str]:
    """``'(f32[2], s32[]) tuple(%a, %b), x=1'`` -> (type text, the rest)."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].strip()
    head, _, rest = rhs.partition(" ")
    return head, rest


def _group_size(attrs: str, num_partitions: int) -> int:
    if m := re.search(r"replica_groups=\{(\{[\d,]*\})", attrs):
        return len([d for d in m.group(1).strip("{}").split(",") if d])
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", attrs):
        return int(m.group(1).split(",")[-1])
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs):
        sizes = {k.strip("' "): int(v) for k, v in re.findall(r"([^=,\s]+)=(\d+)", m.group(1))}
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    return num_partitions


def _executions(calls: dict, trips: dict, entry: str) -> dict[str, int]:
    """How often each computation runs per call of ``entry``, through while trip counts."""
    runs: dict[str, int] = collections.defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        runs[comp] += times
        for callee, site in calls.get(comp, ()):
            visit(callee, times * trips.get(site, 1), depth + 1)

    visit(entry, 1)
    return runs


@dataclasses.dataclass(frozen=True)
class _Instruction:
    computation: str
    name: str
    op: str
    operands: tuple[str, ...]
    rest: str


def _parse(hlo_text: str):
    """Instructions, the type of every value, and how often each computation runs."""
    text = re.sub(r"/\*.*?\*/", "", hlo_text)
    shapes: dict[str, str] = {}
    calls: dict[str, list] = collections.defaultdict(list)
    trips: dict[str, int] = {}
    found: list[_Instruction] = []
    comp, entry = "", ""
    for line in text.splitlines():
        if header := _HEADER.match(line):
            comp = header.group(2)
            entry = comp if header.group(1) else entry
            continue
        if not (instr := _INSTR.match(line)):
            continue
        name, (type_text, rest) = instr.group(1), _split_type(instr.group(2))
        shapes[name] = type_text
        op, _, args = rest.partition("(")
        for role, target in _CALLEE.findall(rest):
            for callee in re.findall(r"%?([\w.\-]+)", target):
                calls[comp].append((callee, name if role in ("body", "condition") else None))
        if op == "while" and (t := re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)):
            trips[name] = int(t.group(1))
        # Operands are %-prefixed in compiled HLO, bare in the lowered (pre-optimization) text.
        operands = tuple(re.findall(r"%?([\w.\-]+)", args.split(")")[0]))
        found.append(_Instruction(comp, name, op, operands, rest))
    m = re.search(r"num_partitions=(\d+)", text)
    return found, shapes, _executions(calls, trips, entry), int(m.group(1)) if m else 1


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, with operand bytes, group size and executions.

    The text of a compiled program (``compile().as_text()``: what runs) or of a lowered one
    (``lower().as_text(dialect="hlo")``: what the program asks for, before the backend's
    passes; XLA's CPU backend, for one, upcasts bf16 collectives to f32)."""
    found, shapes, runs, num_partitions = _parse(hlo_text)
    return [
        Collective(
            kind,
            i.name,
            i.computation,
            sum(type_bytes(shapes.get(o, "")) for o in i.operands),
            len(i.operands),
            _group_size(i.rest, num_partitions),
            runs.get(i.computation, 0),
            tuple(shapes.get(o, "") for o in i.operands),
        )
        for i in found
        if (kind := i.op.removesuffix("-start")) in _KINDS
    ]


def operand_count(collectives: list[Collective], kind: str, group_size: int) -> int:
    """Operands of the ``kind`` collectives over groups of ``group_size`` devices, times their
    executions: e.g. the activations all-reduced over a `tensor` axis of that size per step.

    >>> c = Collective("all-reduce", "ar", "main", 64, operands=2, group_size=4, executions=3)
    >>> operand_count([c], "all-reduce", 4), operand_count([c], "all-reduce", 2)
    (6, 0)
    """
    return sum(
        c.operands * c.executions for c in collectives if c.kind == kind and c.group_size == group_size
    )


def dot_flops(hlo_text: str) -> int:
    """Floating-point operations of every ``dot`` in an HLO module's text, per device and call
    (2 x result elements x contracted size; ops inside while loops once per known trip).
    Read the lowered text (``lower().as_text(dialect="hlo")``): a backend may rewrite dots.

    >>> hlo = "\\n".join([
    ...     "ENTRY %main (x: f32[4,8], w: f32[8,16]) -> f32[4,16] {",
    ...     "  %x = f32[4,8]{1,0} parameter(0)",
    ...     "  %w = f32[8,16]{1,0} parameter(1)",
    ...     "  ROOT %d = f32[4,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    ...     "}"])
    >>> dot_flops(hlo)
    1024
    """
    found, shapes, runs, _ = _parse(hlo_text)
    total = 0
    for i in found:
        if i.op != "dot":
            continue
        (_, out), (_, lhs) = _SHAPE.findall(shapes[i.name])[0], _SHAPE.findall(shapes[i.operands[0]])[0]
        lhs_dims = [int(d) for d in lhs.split(",") if d]
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.rest)
        size = math.prod(
            lhs_dims[int(d)] for d in (contracted.group(1) if contracted else "").split(",") if d
        )
        total += 2 * math.prod(int(d) for d in out.split(",") if d) * size * runs.get(i.computation, 0)
    return total


def collective_summary(collectives: list[Collective]) -> dict[str, dict[str, float]]:
    """``{kind: {"ops": executions, "wire_bytes": bytes}}`` per device, summed per kind."""
    summary: dict[str, dict[str, float]] = {}
    for c in collectives:
        entry = summary.setdefault(c.kind, {"ops": 0, "wire_bytes": 0.0})
        entry["ops"] += c.executions
        entry["wire_bytes"] += c.wire_bytes
    return summary


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes from ``memory_analysis()`` of a compiled function; ``total`` is
    argument + output - alias + temp (``peak_memory_in_bytes`` is not a real peak on CPU)."""
    stats = compiled.memory_analysis()
    out = {
        "argument": stats.argument_size_in_bytes,
        "output": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def state_bytes_per_device(tree: PyTree) -> dict[jax.Device, int]:
    """Bytes each device actually stores for the arrays of ``tree`` (its addressable shards)."""
    totals: dict[jax.Device, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device] += shard.data.nbytes
    return dict(totals)


def ideal_bytes_per_device(tree: PyTree) -> int:
    """Sum over arrays of nbytes / (product of the sizes of the mesh axes it is split over)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        axes = [a for entry in sharding.spec for a in entry_axes(entry)]
        parts = math.prod(sharding.mesh.shape[a] for a in axes)
        total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize // parts
    return total

"""An HLO module's text as :mod:`fsdp_tp.analysis` reads it: its instructions with their
operands, every value's type, the bytes a type names, and how often each computation runs
per call of the entry (through the known trip counts of its while loops).

>>> found, shapes, runs, partitions = parse_hlo("\\n".join([
...     "ENTRY %main (p: f32[256]) -> f32[1024] {",
...     "  %p = f32[256]{0} parameter(0)",
...     "  ROOT %ag = f32[1024]{0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}",
...     "}"]))
>>> [(i.op, i.operands) for i in found], type_bytes(shapes["ag"]), runs["main"]
([('parameter', ('0',)), ('all-gather', ('p',))], 4096, 1)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

__all__ = ["SHAPE", "Instruction", "group_size", "parse_hlo", "type_bytes"]

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
SHAPE = re.compile(  # an array type in HLO text: its dtype and its dims
    r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]"
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations|called_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


def type_bytes(text: str) -> int:
    """The bytes of every array type an HLO text names (``f32[4,2]`` is 32; a float8 one byte).

    >>> type_bytes("(f32[4,2]{1,0}, u8[16])")
    48
    """
    total = 0
    for dtype, dims in SHAPE.findall(text):
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


def group_size(attrs: str, num_partitions: int) -> int:
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
class Instruction:
    computation: str
    name: str
    op: str
    operands: tuple[str, ...]
    rest: str


def parse_hlo(hlo_text: str):
    """Instructions, the type of every value, and how often each computation runs."""
    text = re.sub(r"/\*.*?\*/", "", hlo_text)
    shapes: dict[str, str] = {}
    calls: dict[str, list] = collections.defaultdict(list)
    trips: dict[str, int] = {}
    found: list[Instruction] = []
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
        found.append(Instruction(comp, name, op, operands, rest))
    m = re.search(r"num_partitions=(\d+)", text)
    return found, shapes, _executions(calls, trips, entry), int(m.group(1)) if m else 1

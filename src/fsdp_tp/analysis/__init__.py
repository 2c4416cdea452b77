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

from .._axes import entry_axes
from .._types import PyTree
from ._hlo import SHAPE, group_size, parse_hlo, type_bytes

__all__ = [
    "Collective",
    "array_bytes",
    "collective_summary",
    "compiled_memory",
    "dot_flops",
    "ideal_bytes_per_device",
    "operand_count",
    "parse_collectives",
    "state_bytes_per_device",
    "type_bytes",
]

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


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


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, with operand bytes, group size and executions.

    The text of a compiled program (``compile().as_text()``: what runs) or of a lowered one
    (``lower().as_text(dialect="hlo")``: what the program asks for, before the backend's
    passes; XLA's CPU backend, for one, upcasts bf16 collectives to f32)."""
    found, shapes, runs, num_partitions = parse_hlo(hlo_text)
    return [
        Collective(
            kind,
            i.name,
            i.computation,
            sum(type_bytes(shapes.get(o, "")) for o in i.operands),
            len(i.operands),
            group_size(i.rest, num_partitions),
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
    found, shapes, runs, _ = parse_hlo(hlo_text)
    total = 0
    for i in found:
        if i.op != "dot":
            continue
        (_, out), (_, lhs) = SHAPE.findall(shapes[i.name])[0], SHAPE.findall(shapes[i.operands[0]])[0]
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
    """Bytes each device actually stores for the arrays of ``tree`` (its addressable shards),
    or would store for its shape structs with their shardings (``abstract_init``'s)."""
    totals: dict[jax.Device, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                totals[shard.device] += shard.data.nbytes
            continue
        for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
            block = (len(range(*i.indices(n))) for i, n in zip(index, leaf.shape, strict=True))
            totals[device] += math.prod(block) * leaf.dtype.itemsize
    return dict(totals)


def array_bytes(leaf) -> int:
    """The global bytes of an array, or of what has only a shape and a dtype (a shape struct,
    which has no ``nbytes``: a state :func:`~fsdp_tp.sharded_init.abstract_init` gives as
    shapes; a traced value's aval).

    >>> import jax, jax.numpy as jnp
    >>> array_bytes(jnp.ones((4, 8))), array_bytes(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16))
    (128, 64)
    """
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def ideal_bytes_per_device(tree: PyTree) -> int:
    """Sum over arrays of nbytes / (product of the sizes of the mesh axes it is split over)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        axes = [a for entry in sharding.spec for a in entry_axes(entry)]
        parts = math.prod(sharding.mesh.shape[a] for a in axes)
        total += array_bytes(leaf) // parts
    return total

"""Long sequences (issue 84): ring attention over ``context`` against attention whose keys and
values are all-gathered (what sequence parallelism does at every attention), the attention's
forward and backward alone, on ``cp`` devices of one ``context`` axis.

From each compiled program: the per-device temporary bytes (``memory_analysis()``) against
sequence length and ``cp``, and the longest sequence (a power of two) whose program fits a
per-device budget; the collective-permutes' bytes against the formulas
(:mod:`fsdp_tp.context._ring`); from the ring's own schedule the causal work per device
(:func:`~fsdp_tp.context.blocks_run`), balanced and contiguous; and the step time, as a ratio.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..analysis import parse_collectives
from ..context import all_to_all_attention, blocks_run, ring_attention, ring_bytes
from ..mesh import make_mesh
from .context_step_rows import STEP_BUDGET, step_longest, step_section, step_temp_bytes
from .figures import median
from .report import spread

__all__ = ["CONTEXT_SIZES", "ContextMeasured", "context_costs", "context_section", "temp_bytes"]

CONTEXT_SIZES = dict(batch=1, heads=8, kv_heads=2, head_dim=32)
LENGTHS = (1024, 2048, 4096)
CPS = (1, 2, 4, 8)
BUDGET = 64 * 2**20  # per-device temporaries, for the longest sequence that fits
LONGEST = 2**16  # (the search stops there)
TIMED = (8, 4096)  # (cp, tokens) of the timed forward and backward, ring against all-gathered
ALL_TO_ALL_CP = 2  # (ring against all-to-all: a cp that divides the kv heads)


def _gathered(q, k, v):
    """This device's queries (a contiguous slice) against all-gathered keys and values."""
    local, axis = q.shape[1], "context"
    k, v = (jax.lax.all_gather(t, axis, axis=1, tiled=True) for t in (k, v))
    k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], axis=2) for t in (k, v))
    rows = jax.lax.axis_index(axis) * local + jnp.arange(local)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None] <= rows[None, None, :, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _program(kind: str, cp: int, length: int):
    """The attention's forward and backward on ``cp`` devices, jitted, and its argument shapes."""
    mesh = make_mesh({"context": cp}, devices=jax.devices()[:cp])
    attention = {"ring": ring_attention, "all_to_all": all_to_all_attention, "gathered": _gathered}[kind]
    seq = P(None, "context")

    def local(q, k, v, cotangent):
        _, vjp = jax.vjp(attention, q, k, v)
        return vjp(cotangent)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 4, out_specs=(seq,) * 3))
    s = CONTEXT_SIZES
    q = jax.ShapeDtypeStruct((s["batch"], length, s["heads"], s["head_dim"]), jnp.float32)
    kv = jax.ShapeDtypeStruct((s["batch"], length, s["kv_heads"], s["head_dim"]), jnp.float32)
    return run, (q, kv, kv, q)


@functools.cache  # (the temporaries, the longest search and the bytes read the same programs)
def _compiled(kind: str, cp: int, length: int):
    run, shapes = _program(kind, cp, length)
    return run.lower(*shapes).compile()


def temp_bytes(kind: str, cp: int, length: int) -> int:
    """The temporary bytes a device of the compiled forward and backward holds."""
    return _compiled(kind, cp, length).memory_analysis().temp_size_in_bytes


@dataclasses.dataclass(frozen=True)
class ContextMeasured:
    temps: dict[tuple[str, int, int], int]  # (kind, cp, length) -> temporary bytes a device
    longest: dict[tuple[str, int], int]  # (kind, cp) -> the longest sequence within BUDGET
    sent: dict[int, tuple[int, int]]  # cp -> the ring's collective-permute bytes (forward+backward, minimum)
    work: dict[int, tuple[list[int], list[int]]]  # cp -> blocks run per device (balanced, contiguous)
    timed: tuple[int, int]  # (cp, tokens) of the times
    times: dict[str, list[float]]  # "ring" / "gathered" -> seconds of the forward and backward
    step_temps: dict[tuple[int, int], int]  # (cp, length) -> the model step's temporaries a device
    step_longest: dict[int, int]  # cp -> the longest sequence whose step fits step_budget
    step_start: int = 1024  # (where the step's longest search starts)
    step_budget: int = STEP_BUDGET


def _longest(kind: str, cp: int) -> int:
    length, fits = 1024, 0
    while length <= LONGEST and temp_bytes(kind, cp, length) <= BUDGET:
        fits, length = length, length * 2
    return fits


def _sent(cp: int, length: int) -> tuple[int, int]:
    collectives = parse_collectives(_compiled("ring", cp, length).as_text())
    sent = round(sum(c.wire_bytes for c in collectives if c.kind == "collective-permute"))
    s = CONTEXT_SIZES
    forward, backward = ring_bytes(s["batch"], length, s["kv_heads"], s["head_dim"], cp, jnp.float32)
    return sent, forward + backward  # (k, v twice round; n hops of their grads)


def _timed(blocks: int, steps: int, cp: int, length: int) -> dict[str, list[float]]:
    """Each program's forward and backward, ``steps`` runs a block, interleaved, ``blocks`` times:
    the ring and all-gathered k, v at ``cp``; the ring and all-to-all at ``ALL_TO_ALL_CP``."""
    runs = {}
    for kind, on in (("ring", cp), ("gathered", cp), ("ring", ALL_TO_ALL_CP), ("all_to_all", ALL_TO_ALL_CP)):
        run, shapes = _program(kind, on, length)
        args = [jax.random.normal(jax.random.key(i), a.shape, a.dtype) for i, a in enumerate(shapes)]
        jax.block_until_ready(run(*args))
        runs[f"{kind} at cp {on}"] = (run, args)
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for _ in range(blocks):
        for kind, (run, args) in runs.items():
            began = time.perf_counter()
            for _ in range(steps):
                out = run(*args)
            jax.block_until_ready(out)
            times[kind].append((time.perf_counter() - began) / steps)
    return times


def context_costs(
    blocks: int,
    steps: int,
    lengths=LENGTHS,
    cps=CPS,
    timed=TIMED,
    step_lengths=LENGTHS,
    step_start: int = 1024,
    step_budget: int = STEP_BUDGET,
) -> ContextMeasured:
    temps = {
        (kind, cp, n): temp_bytes(kind, cp, n) for kind in ("ring", "gathered") for cp in cps for n in lengths
    }
    longest = {(kind, cp): _longest(kind, cp) for kind in ("ring", "gathered") for cp in cps}
    sent = {cp: _sent(cp, lengths[-1]) for cp in cps if cp > 1}
    work = {cp: (blocks_run(cp, 16 * cp), blocks_run(cp, 16 * cp, balanced=False)) for cp in cps if cp > 1}
    step_temps = {(cp, n): step_temp_bytes(cp, n) for cp in cps for n in step_lengths}
    step_fits = {cp: step_longest(cp, step_start, step_budget) for cp in cps}
    times = _timed(blocks, steps, *timed)
    return ContextMeasured(
        temps, longest, sent, work, timed, times, step_temps, step_fits, step_start, step_budget
    )


def _fits(length: int) -> str:
    return f"{length:,}" if length else "< 1,024"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f}"


def context_section(m: ContextMeasured) -> str:
    cps = sorted({cp for _, cp in m.longest})
    lengths = sorted({n for _, _, n in m.temps})
    s = CONTEXT_SIZES
    head = "| sequence | " + " | ".join(f"cp {cp} ring MB (÷ cp 1)" for cp in cps) + " | "
    head += " | ".join(f"cp {cp} gathered k, v MB" for cp in cps) + " |\n"
    rows = []
    for n in lengths:
        base = m.temps[("ring", cps[0], n)]  # (cp 1's, where measured)
        cells = [f"{_mb(m.temps[('ring', cp, n)])} ({m.temps[('ring', cp, n)] / base:.3f})" for cp in cps]
        cells += [_mb(m.temps[("gathered", cp, n)]) for cp in cps]
        rows.append(f"| {n:,} | " + " | ".join(cells) + " |")
    longest = "| longest sequence within the budget | " + " | ".join(
        f"{_fits(m.longest[('ring', cp)])} ring, {_fits(m.longest[('gathered', cp)])} gathered" for cp in cps
    )
    sent = [
        f"| cp {cp} | {_mb(got)} | {_mb(want)} | {got / want:.2f} |"
        for cp, (got, want) in sorted(m.sent.items())
    ]
    work = [
        f"| cp {cp} | {bal} | {max(bal) / (sum(bal) / len(bal)):.2f} | {con} | "
        f"{max(con) / (sum(con) / len(con)):.2f} |"
        for cp, (bal, con) in sorted(m.work.items())
    ]
    cp, a2a = m.timed[0], ALL_TO_ALL_CP
    ring, gathered = m.times[f"ring at cp {cp}"], m.times[f"gathered at cp {cp}"]
    ring_2, all_to_all = m.times[f"ring at cp {a2a}"], m.times[f"all_to_all at cp {a2a}"]
    return (
        "\n### Long sequences: ring attention over `context`\n\n"
        f"The attention's forward and backward alone (float32, batch {s['batch']}, {s['heads']} query heads, "
        f"{s['kv_heads']} kv heads of {s['head_dim']} dims, causal), on `cp` devices of a `context` axis: "
        "`fsdp_tp.context.ring_attention` (balanced) against each device's queries over all-gathered "
        "keys and values (what sequence parallelism does at every attention); then a model's train "
        "step.\n\n"
        "Temporary bytes a device (`memory_analysis()`):\n\n"
        + head
        + "|---|"
        + "---:|" * (2 * len(cps))
        + "\n"
        + "\n".join(rows)
        + f"\n\nThe longest sequence (a power of two, up to {LONGEST:,}) whose program's temporaries fit "
        f"{BUDGET // 2**20} MiB a device:\n\n| | "
        + " | ".join(f"cp {cp}" for cp in cps)
        + " |\n|---|"
        + "---:|" * len(cps)
        + "\n"
        + longest
        + " |\n\n"
        f"K and V sent a device, forward and backward, at {lengths[-1]:,} tokens (collective-permutes of the "
        "compiled program; minimum: k and v round the ring each way, `2·2(n-1)/n·B·S·G·D·b`, and the "
        "gradients' `n` hops home, `2·B·S·G·D·b`; nothing else is sent):\n\n"
        "| | sent MB | minimum MB | ÷ minimum |\n|---|---:|---:|---:|\n" + "\n".join(sent) + "\n\n"
        "Causal work: the blocks of scores each device runs (the ring's schedule, a wholly masked "
        "block skipped), balanced (zigzag, blocks of `(S/2cp)²`) and contiguous (`(S/cp)²`):\n\n"
        "| | balanced, per device | max ÷ mean | contiguous, per device | max ÷ mean |\n"
        "|---|---|---:|---|---:|\n" + "\n".join(work) + "\n\n"
        f"Time of the forward and backward, {m.timed[1]:,} tokens, interleaved in one run (ms, median "
        f"(min-max)): at cp {cp}, ring {spread(ring)}, all-gathered {spread(gathered)}, ring ÷ all-gathered "
        f"{median(ring) / median(gathered):.2f}; at cp {a2a} (which divides the kv heads), ring "
        f"{spread(ring_2)}, all-to-all {spread(all_to_all)}, ring ÷ all-to-all "
        f"{median(ring_2) / median(all_to_all):.2f}.\n\n"
        + step_section(m.step_temps, m.step_longest, m.step_start, m.step_budget)
    )

"""The figures of a variant (docs/design.md, "How we measure"): exact bytes, then ratios of times.

Exact figures come from the state's shards and the compiled program; they do not
depend on the machine's load. Step and compile times do, so they are reported as
ratios from interleaved blocks in one process, with the spread of the blocks.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import flax.linen as nn
import jax

from ..analysis import (
    array_bytes,
    collective_summary,
    compiled_memory,
    ideal_bytes_per_device,
    parse_collectives,
    state_bytes_per_device,
)
from .variants import STRATEGIES, Variant, build_variant, plain_flax_build
from .workloads import WORKLOADS, gpt

__all__ = [
    "BuiltWhenTimed",
    "Figures",
    "Timed",
    "build_seconds",
    "compile_seconds",
    "exact_figures",
    "median",
    "minimum_wire_bytes",
    "step_seconds",
]


@dataclass
class Figures:
    """Per device: state bytes (params + optimizer) and their ideal, compiled memory,
    collective wire bytes per step by kind, and the strategy's minimum where one is known."""

    label: str
    state_bytes: int
    ideal_bytes: int
    temp_bytes: int
    total_bytes: int
    wire: dict[str, float]
    minimum: float | None
    full_gradient_all_reduces: int  # all-reduces shaped like a whole sharded parameter
    loss: float

    @property
    def wire_total(self) -> float:
        return sum(self.wire.values())


def _params(state):
    return state.params


def _sharded_shapes(model_state) -> set[tuple[int, ...]]:
    """Global shapes of the parameters a strategy splits (and, for stacked layers, of one layer)."""
    shapes = set()
    for box in jax.tree.leaves(_params(model_state), is_leaf=lambda x: isinstance(x, nn.Partitioned)):
        if isinstance(box, nn.Partitioned) and any(n is not None for n in box.names):
            shape = tuple(box.value.shape)
            shapes.add(shape)
            if len(shape) > 2:
                shapes.add(shape[1:])
    return shapes


def _dims(type_text: str) -> set[tuple[int, ...]]:
    return {tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", type_text)}


def _param_bytes(state) -> tuple[int, int, int]:
    """Global bytes of (sharded params inside remat'ed layers, other sharded params, replicated params)."""
    remat = other = replicated = 0
    flat = jax.tree_util.tree_flatten_with_path(
        _params(state), is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )[0]
    for path, leaf in flat:
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        nbytes = array_bytes(value)
        split = isinstance(leaf, nn.Partitioned) and any(n is not None for n in leaf.names)
        in_blocks = str(getattr(path[0], "key", "")).startswith("blocks")
        if not split:
            replicated += nbytes
        elif in_blocks:
            remat += nbytes
        else:
            other += nbytes
    return remat, other, replicated


def minimum_wire_bytes(variant: Variant, library_state) -> float | None:
    """The least a strategy must move per device per step, where a closed form is known.

    ``dp``: all-reduce every gradient, 2(N-1)/N · P. ``fsdp``: W_min = 2(N-1)/N · (S_p + R)
    with 3(N-1)/N on params re-gathered by remat (docs/design.md). ``tp`` on the classifier and
    the block: Megatron's one all-reduce per block forward and one backward (none for an
    input that needs no gradient), 2(t-1)/t · activation bytes each.
    """
    name, n = variant.strategy.name, 8
    if name == "dp":
        remat, other, replicated = _param_bytes(library_state)
        return 2 * (n - 1) / n * (remat + other + replicated)
    if name == "fsdp":
        remat, other, replicated = _param_bytes(library_state)
        remat_factor = 3 if variant.workload == "gpt" else 2
        return (n - 1) / n * (remat_factor * remat + 2 * (other + replicated))
    if name == "tp" and variant.workload in ("mlp", "block"):
        x = variant.batch[0]
        activation = array_bytes(x)  # (B, [S,] d): the residual width
        all_reduces = 3 if variant.workload == "mlp" else 4
        return all_reduces * 2 * (n - 1) / n * activation
    return None


def exact_figures(variant: Variant, library_state=None) -> Figures:
    """The exact figures of ``variant`` (one trace, one compile; runs one step for the loss)."""
    library_state = variant.state if library_state is None else library_state
    tree = (_params(variant.state), variant.state.opt_state)
    held = max(state_bytes_per_device(tree).values())
    compiled = variant.lowered().compile()
    memory = compiled_memory(compiled)
    found = parse_collectives(compiled.as_text())
    summary = collective_summary(found)
    sharded = _sharded_shapes(library_state)
    full_grads = sum(
        c.executions
        for c in found
        if c.kind == "all-reduce" and any(_dims(t) & sharded for t in c.operand_types)
    )
    # The step compiled above, run once (calling variant.step would trace and lower it again).
    _, loss = compiled(jax.tree.map(lambda a: a.copy(), variant.state), variant.batch)  # donated copy
    return Figures(
        label=variant.label,
        state_bytes=held,
        ideal_bytes=ideal_bytes_per_device(tree),
        temp_bytes=memory["temp"],
        total_bytes=memory["total"],
        wire={kind: entry["wire_bytes"] for kind, entry in summary.items()},
        minimum=minimum_wire_bytes(variant, library_state),
        full_gradient_all_reduces=full_grads,
        loss=float(loss),
    )


class BuiltWhenTimed:
    """A timed step whose state ``init()`` builds when it is first run: its figures are read off
    the lowered step and the state's shapes, so reading them builds nothing."""

    init: Callable[[], Any]

    @functools.cached_property
    def state(self) -> Any:
        return self.init()


class Timed(Protocol):
    """What ``step_seconds`` runs: a labelled step, its (donated) state and its batch."""

    @property
    def label(self) -> str: ...

    @property
    def state(self) -> Any: ...

    step: Callable
    batch: Any


def step_seconds(
    variants: Sequence[Timed], blocks: int = 3, steps: int = 5, copy: bool = True
) -> dict[str, list[float]]:
    """Seconds per step of each variant in ``blocks`` interleaved blocks (after two warm-up steps).

    Interleaving spreads the machine's noise over all variants alike; compare the
    medians as ratios, and read the spread of the blocks as the noise.
    """
    # A donating step consumes its state: time on copies, unless the caller gives its states
    # up (``copy=False``: a device that holds one model's state twice over may not hold it four times).
    states = {v.label: jax.tree.map(lambda a: a.copy(), v.state) if copy else v.state for v in variants}
    for v in variants:  # compile and warm up: twice, as the first step's output state may be
        for _ in range(2):  # laid out otherwise than the initial one and compile the step again
            states[v.label], loss = v.step(states[v.label], v.batch)
        jax.block_until_ready(loss)
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    for _ in range(blocks):
        for v in variants:
            began = time.perf_counter()
            for _ in range(steps):
                states[v.label], loss = v.step(states[v.label], v.batch)
            jax.block_until_ready((states[v.label], loss))
            times[v.label].append((time.perf_counter() - began) / steps)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def compile_seconds(variant: Variant) -> float:
    """Trace, lower and compile the step once (nothing cached: a fresh jit each variant)."""
    began = time.perf_counter()
    variant.lowered().compile()
    return time.perf_counter() - began


def build_seconds(layers: int, repeats: int = 3) -> tuple[float, float, float]:
    """Seconds to build the unrolled GPT-style model of ``layers`` layers, from nothing to a
    compiled first step: fsdp_tp on data=1 x fsdp=4 x tensor=2 (sharded init from the twin,
    specs, the step compiled), and plain flax on one device (init under jit, step compiled).

    Each of ``repeats`` rounds builds both, one after the other, so the two see the same load;
    returns the median library time, the median plain flax time and the median of the rounds'
    ratios. A shared CPU moves single builds a lot (two rounds back to back at 32 layers:
    ratios 1.58 and 1.31), hence rounds and medians, as for step times.
    """
    model = gpt(layers, scan_layers=False)
    library, plain = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        build_variant(WORKLOADS["gpt"], STRATEGIES["fsdp_tp"], "fsdp_tp", model).lowered().compile()
        library.append(time.perf_counter() - began)
        began = time.perf_counter()
        plain_flax_build(WORKLOADS["gpt"], model)
        plain.append(time.perf_counter() - began)
    ratios = [a / b for a, b in zip(library, plain, strict=True)]
    return median(library), median(plain), median(ratios)

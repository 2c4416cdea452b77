"""``fsdp-tp bench --accelerator``: the realistic presets on one device of this machine.

For each preset: the library's train step (the CLI's: ``shard_step`` at mesh 1 x 1 x 1,
without the non-finite guard) against the plain-flax twin's step (``jax.jit`` of
``value_and_grad`` and the same optimizer), timed in interleaved blocks; tokens/s and MFU
(``ModelConfig.flops_per_token`` over the device's peak from the CLI's table), and the
compiled step's memory (argument + output - alias + temp). Writes
``benchmarks_accelerator.md``.

On an H100 the issue's command is
``fsdp-tp bench --accelerator --presets 125m:32,1b:16 --dtype bf16``; it runs anywhere a
preset fits one device (on CPU without MFU, which needs a peak): ``fsdp-tp bench`` first
checks each preset's plan against the device's memory (``bench_settings``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
import optax

from ..analysis import compiled_memory
from ..mesh import make_mesh
from ..models import Layout
from ..recipe.config import PRESETS, ModelConfig
from ..recipe.throughput import Achieved, peak_tflops
from ..recipe.trainer import BATCH, Settings, Trainer, step_fn
from ..train import shard_step, state_init_fn
from .figures import median, step_seconds

__all__ = [
    "Measured",
    "accelerator_section",
    "bench_settings",
    "measure",
    "parse_presets",
    "write_accelerator_page",
]


@dataclass
class _Timed:
    label: str
    state: Any
    step: Any
    batch: Any


@dataclass(frozen=True)
class Measured:
    preset: str
    params: int
    batch: int
    seq_len: int
    times: dict[str, list[float]]  # "library" and "plain flax": seconds per step, per block
    memory: dict[str, int]  # compiled bytes of each step (argument + output - alias + temp)
    mfu: float | None
    tokens_per_s: float


def parse_presets(text: str) -> list[tuple[str, int]]:
    """``"125m:32,1b:16"`` -> ``[("125m", 32), ("1b", 16)]``: each preset with its global batch.

    >>> parse_presets("125m:32, tiny:8")
    [('125m', 32), ('tiny', 8)]
    """
    found = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, batch = item.partition(":")
        if name not in PRESETS or not batch.isdigit() or int(batch) < 1:
            raise ValueError(
                f"--presets item {item!r}: write PRESET:BATCH with PRESET one of {sorted(PRESETS)} "
                f"and BATCH a positive integer, e.g. 125m:32."
            )
        found.append((name, int(batch)))
    return found


def _plain_step(config: ModelConfig, tx: optax.GradientTransformation):
    """What a plain flax script compiles: the twin's loss, its gradient and the update."""
    twin = config.model()

    def step(state, windows):
        def loss_fn(params):
            logits = twin.apply({"params": params}, windows[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return jax.jit(step, donate_argnums=0), state_init_fn(twin, tx)


def bench_settings(config: ModelConfig, batch: int) -> Settings:
    """The run each preset is measured as (its plan is what ``fsdp-tp bench`` checks first)."""
    return Settings(config, 1000, batch, 1, 1e-4, 10, 0, Layout("tensor", "fsdp"), check_vma=True)


def measure(config: ModelConfig, name: str, batch: int, blocks: int, steps: int) -> Measured:
    """The library's step and the plain-flax twin's on one device, interleaved."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    settings = bench_settings(config, batch)
    trainer = Trainer(settings, mesh)
    step = step_fn(settings, trainer.model.logits)
    library: Any = shard_step(step, mesh, trainer.specs, BATCH)  # a jit: .lower
    rng = np.random.default_rng(0)
    windows = rng.integers(0, config.vocab_size, (batch, config.seq_len + 1), dtype=np.int32)
    windows = jax.device_put(windows, jax.sharding.NamedSharding(mesh, BATCH))
    plain, plain_init = _plain_step(config, trainer.tx)
    plain_state = jax.jit(plain_init)(jax.random.key(0), windows[:, :-1])
    # Compiled once each: the executables whose memory is read are the ones timed.
    compiled = {
        "library": library.lower(trainer.state, windows).compile(),
        "plain flax": plain.lower(plain_state, windows).compile(),
    }
    memory = {label: compiled_memory(c)["total"] for label, c in compiled.items()}
    timed = [
        _Timed("library", trainer.state, compiled["library"], windows),
        _Timed("plain flax", plain_state, compiled["plain flax"], windows),
    ]
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(plain_state.params))
    del trainer, plain_state  # the timed steps consume the two states: no third and fourth copy
    times = step_seconds(timed, blocks, steps, copy=False)
    tokens_per_s = batch * config.seq_len / median(times["library"])
    peak = peak_tflops(jax.devices()[0].device_kind, config.dtype)
    mfu = Achieved.of(config.flops_per_token(), tokens_per_s, 1, peak).mfu
    return Measured(name, params, batch, config.seq_len, times, memory, mfu, tokens_per_s)


def accelerator_section(
    presets: list[tuple[str, int]], overrides: dict, blocks: int, steps: int, argv: list[str], out: TextIO
) -> str:
    """Measures each preset with ``overrides`` (vocab_size, dtype, attention, remat); the page."""
    rows = []
    for name, batch in presets:
        config = dataclasses.replace(PRESETS[name], **overrides)
        m = measure(config, name, batch, blocks, steps)
        print(f"accelerator: {name} at batch {batch} measured", file=out, flush=True)
        ratio = [a / b for a, b in zip(m.times["library"], m.times["plain flax"], strict=True)]
        mfu = "—" if m.mfu is None else f"{100 * m.mfu:.1f} %"
        gib = {k: f"{v / 2**30:.2f}" for k, v in m.memory.items()}
        rows.append(
            f"| {name} ({m.params / 1e6:,.0f}M params) | {m.batch} x {m.seq_len} | {m.tokens_per_s:,.0f} | "
            f"{mfu} | {median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}) | "
            f"{gib['library']} GiB ({gib['plain flax']}) |"
        )
    device = jax.devices()[0]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    settings = ", ".join(f"{k} {v}" for k, v in overrides.items())
    return "\n".join(
        [
            "# Benchmarks on an accelerator",
            "",
            "Regenerate with:",
            "",
            f"    fsdp-tp bench {' '.join(argv)}".rstrip(),
            "",
            f"Ran {when} on one {device.device_kind} ({device.platform}), jax {jax.__version__}; {settings}; "
            "AdamW after global-norm clipping. The library's step at mesh 1 x 1 x 1 against the plain-flax "
            "twin's, interleaved blocks, medians (min-max of the per-block ratios in brackets). MFU: "
            "6 x weights + attention FLOPs per token (`ModelConfig.flops_per_token`) over the device's "
            "dense peak in the compute dtype (`fsdp_tp.recipe.throughput.PEAK_TFLOPS`; none on CPU). Memory: "
            "the compiled step's argument + output - alias + temp, plain flax's in brackets.",
            "",
            "| model | batch x seq | tokens/s (library) | MFU | library ÷ plain flax step time | memory |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def write_accelerator_page(text: str, out_dir: Path) -> Path:
    """Writes the page as ``out_dir/benchmarks_accelerator.md``; its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "benchmarks_accelerator.md"
    path.write_text(text)
    return path

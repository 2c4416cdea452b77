"""``fsdp-tp bench --accelerator``: the realistic presets on one device of this machine.

For each preset: the library's train step (the CLI's: ``shard_step`` at mesh 1 x 1 x 1,
without the non-finite guard) against the plain-flax twin's step (``jax.jit`` of
``value_and_grad`` and the same optimizer), timed in interleaved blocks; tokens/s and MFU
(``ModelConfig.flops_per_token`` over the device's peak from the CLI's table), and the
compiled step's memory (argument + output - alias + temp). With ``--precisions f32/f32,fp8/bf16``
each preset is measured once per FSDP gather precision (``MixedPrecision``), the plain-flax
twin compiled once: on one device nothing is gathered, so the rows show what the rounding
costs in compute. Writes
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
from ..precision import MixedPrecision
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
    "policies_of",
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
    precision: str  # FSDP's gather / reduce dtypes, e.g. "fp8 / bf16"
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


def policies_of(text: str, gather_dtypes: dict, reduce_dtypes: dict) -> dict[str, MixedPrecision | None]:
    """``--precisions`` (``GATHER/REDUCE`` items, comma-separated) -> each row's label and
    policy (``None`` for f32 both ways: the library's default). The dicts map the flags' dtype
    names to numpy's.

    >>> GATHER = {"f32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
    >>> REDUCE = {"f32": "float32", "bf16": "bfloat16"}
    >>> found = policies_of("f32/f32, fp8/bf16", GATHER, REDUCE)
    >>> list(found), found["f32 / f32"], found["fp8 / bf16"].gather_dtype
    (['f32 / f32', 'fp8 / bf16'], None, dtype(float8_e4m3fn))
    """
    found: dict[str, MixedPrecision | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        gather, _, reduce = item.partition("/")
        if gather not in gather_dtypes or reduce not in reduce_dtypes:
            raise ValueError(
                f"--precisions item {item!r}: write GATHER/REDUCE with GATHER one of "
                f"{sorted(gather_dtypes)} and REDUCE one of {sorted(reduce_dtypes)}, e.g. fp8/bf16."
            )
        policy = MixedPrecision(gather_dtypes[gather], reduce_dtypes[reduce])
        found[f"{gather} / {reduce}"] = None if gather == reduce == "f32" else policy
    if not found:
        raise ValueError(f"--precisions {text!r} names none: write GATHER/REDUCE items, e.g. fp8/bf16.")
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


def bench_settings(config: ModelConfig, batch: int, policy: MixedPrecision | None = None) -> Settings:
    """The run each preset is measured as (its plan is what ``fsdp-tp bench`` checks first):
    every layer of the library's, Megatron's over a tensor axis of one device too, against plain
    flax (``fsdp-tp train`` builds no Megatron layers on such a mesh: this is the dearer case)."""
    layout = Layout("tensor", "fsdp", mixed_precision=policy)
    return Settings(config, 1000, batch, 1, 1e-4, 10, 0, layout, check_vma=True)


def measure(
    config: ModelConfig,
    name: str,
    batch: int,
    blocks: int,
    steps: int,
    policies: dict[str, MixedPrecision | None] | None = None,
) -> list[Measured]:
    """The library's step per gather precision (f32 alone by default) and the plain-flax twin's
    on one device, interleaved; one record per precision, each timed beside the same twin."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    windows = rng.integers(0, config.vocab_size, (batch, config.seq_len + 1), dtype=np.int32)
    windows = jax.device_put(windows, jax.sharding.NamedSharding(mesh, BATCH))
    timed, memory = [], {}
    for label, policy in (policies or {"f32 / f32": None}).items():
        settings = bench_settings(config, batch, policy)
        trainer = Trainer(settings, mesh)
        library: Any = shard_step(step_fn(settings, trainer.model), mesh, trainer.specs, BATCH)
        # Compiled once: the executable whose memory is read is the one timed.
        compiled = library.lower(trainer.state, windows).compile()
        memory[label] = compiled_memory(compiled)["total"]
        timed.append(_Timed(label, trainer.state, compiled, windows))
        tx = trainer.tx
        del trainer  # the timed step consumes its state: no second copy
    plain, plain_init = _plain_step(config, tx)
    plain_state = jax.jit(plain_init)(jax.random.key(0), windows[:, :-1])
    compiled = plain.lower(plain_state, windows).compile()
    memory["plain flax"] = compiled_memory(compiled)["total"]
    timed.append(_Timed("plain flax", plain_state, compiled, windows))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(plain_state.params))
    del plain_state
    times = step_seconds(timed, blocks, steps, copy=False)
    peak = peak_tflops(jax.devices()[0].device_kind, config.dtype)
    found = []
    for record in timed[:-1]:
        tokens_per_s = batch * config.seq_len / median(times[record.label])
        mfu = Achieved.of(config.flops_per_token(), tokens_per_s, 1, peak).mfu
        mine = {"library": times[record.label], "plain flax": times["plain flax"]}
        bytes_ = {"library": memory[record.label], "plain flax": memory["plain flax"]}
        found.append(
            Measured(name, record.label, params, batch, config.seq_len, mine, bytes_, mfu, tokens_per_s)
        )
    return found


def _row(m: Measured) -> str:
    ratio = [a / b for a, b in zip(m.times["library"], m.times["plain flax"], strict=True)]
    mfu = "—" if m.mfu is None else f"{100 * m.mfu:.1f} %"
    gib = {k: f"{v / 2**30:.2f}" for k, v in m.memory.items()}
    return (
        f"| {m.preset} ({m.params / 1e6:,.0f}M params) | {m.precision} | {m.batch} x {m.seq_len} | "
        f"{m.tokens_per_s:,.0f} | {mfu} | {median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}) | "
        f"{gib['library']} GiB ({gib['plain flax']}) |"
    )


def accelerator_section(
    presets: list[tuple[str, int]],
    overrides: dict,
    blocks: int,
    steps: int,
    argv: list[str],
    out: TextIO,
    policies: dict[str, MixedPrecision | None] | None = None,
) -> str:
    """Measures each preset with ``overrides`` (vocab_size, dtype, attention, remat) once per
    FSDP gather precision of ``policies`` (f32 alone by default); the page."""
    rows = []
    for name, batch in presets:
        config = dataclasses.replace(PRESETS[name], **overrides)
        rows += [_row(m) for m in measure(config, name, batch, blocks, steps, policies)]
        print(f"accelerator: {name} at batch {batch} measured", file=out, flush=True)
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
            "the compiled step's argument + output - alias + temp, plain flax's in brackets. Gather / "
            "reduce: the dtypes FSDP gathers parameters and reduces gradients in (`MixedPrecision`); on "
            "one device nothing crosses a wire, so a narrower gather shows only its rounding's cost.",
            "",
            "| model | gather / reduce | batch x seq | tokens/s (library) | MFU | "
            "library ÷ plain flax step time | memory |",
            "|---|---|---|---|---|---|---|",
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

"""The flags of ``fsdp-tp``: every one with its meaning and default in ``--help``."""

from __future__ import annotations

import argparse

from .._sequence_split import STRATEGIES
from ..attention import ATTENTION_IMPLEMENTATIONS
from ..models.remat import REMAT_POLICIES
from ..recipe.config import PRESETS
from ..recipe.trainer import APIS
from .experts import add_expert_flags
from .finetune_flags import add_finetune_flags
from .supervise import add_process_flags
from .workdir import add_checkpoint_flags

__all__ = ["DEFAULT_MESH", "DEFAULT_WARMUP", "DTYPES", "GATHER_DTYPES", "PACKED_EOS", "parser"]

DEFAULT_MESH = "data=2,fsdp=2,tensor=2"
DEFAULT_WARMUP = 20  # --warmup's default; shorter runs warm up through all their steps
PACKED_EOS = ord(".")  # --packed's end of a document: a sentence of the embedded corpus
DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # the dtype flags' names -> numpy's
# What FSDP may gather in: the compute dtypes, and 8 bits with a scale a row (MixedPrecision.scaled)
GATHER_DTYPES = {**DTYPES, "fp8": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's text, once; the description's line breaks kept.

    A flag whose text already says its default (``default: the preset's``), or whose default
    is ``None`` (chosen at run time, as its text says), gets no ``(default: None)`` added.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action) or text


def _compute_flags(p, remat_default: str) -> None:
    """``--attention`` and ``--remat``: how the model computes (the same function either way).
    ``auto`` remat picks by the device's memory, so only ``train`` and ``plan`` offer it."""
    p.add_argument(
        "--attention",
        choices=ATTENTION_IMPLEMENTATIONS,
        default="auto",
        help="reference einsums, or jax.nn.dot_product_attention: xla, cudnn (flash, bf16 on GPU), "
        "auto (cudnn where it runs, else xla)",
    )
    p.add_argument(
        "--context-strategy",
        choices=STRATEGIES,
        default=None,  # (ring; given without a context axis, refused: it would do nothing)
        help="with a context axis in --mesh (the sequence split over it): attention across it by a "
        "ring of k and v, all_to_all (heads split instead), or auto (the fewer bytes)",
    )
    p.add_argument(
        "--packed",
        type=int,
        nargs="?",
        const=PACKED_EOS,
        default=None,
        metavar="EOS",
        help=f"train on packed documents, each ended by the token EOS (default: {PACKED_EOS}, the "
        "embedded corpus's '.'): a token attends within its own document, and the loss skips a "
        "target in the next one; under a context axis the segment ids are split with the tokens",
    )
    auto = remat_default == "auto"
    p.add_argument(
        "--remat",
        choices=[*REMAT_POLICIES, "auto"] if auto else list(REMAT_POLICIES),
        default=remat_default,
        help="what each layer keeps for the backward pass: full (only its input), dots (also its "
        "matmuls' results), none (everything)"
        + ("; auto: the fastest whose plan fits a device" if auto else ""),
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mesh",
        help=f"axis sizes over data, fsdp and tensor, context (the sequence split over it), and expert "
        f"with --experts (default: train on an "
        f"accelerator or with "
        f"--cpu-devices N puts every device on fsdp; otherwise on CPU, and for plan, {DEFAULT_MESH})",
    )
    p.add_argument(
        "--api",
        choices=APIS,
        default="linen",
        help="the Flax API the GPT is written in: linen (tensor parallelism by the library's Megatron "
        "layers) or nnx (by tp rules: HeadParallel on its nnx.MultiHeadAttention, Column/RowParallel on "
        "the MLP, VocabParallel on the embedding); from the same seed both train the same numbers",
    )
    p.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="model size; the flags below override it"
    )
    p.add_argument("--d-model", type=int, help="model width (default: the preset's)")
    p.add_argument("--layers", type=int, dest="num_layers", help="decoder layers (default: the preset's)")
    p.add_argument("--heads", type=int, dest="num_heads", help="attention heads (default: the preset's)")
    p.add_argument(
        "--kv-heads",
        type=int,
        dest="num_kv_heads",
        help="key/value heads, dividing --heads (default: the preset's)",
    )
    p.add_argument("--mlp-hidden", type=int, help="MLP width (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--vocab-size", type=int, help="default: 256 (bytes), or fitted to a token file")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32", help="compute dtype (params stay f32)")
    add_expert_flags(p)
    _compute_flags(p, remat_default="auto")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument(
        "--min-weight-size", type=int, default=2**10, help="parameters with fewer elements stay whole"
    )
    p.add_argument(
        "--gather-dtype",
        choices=list(GATHER_DTYPES),
        default="f32",
        help="dtype FSDP all-gathers parameters in; bf16 moves half the bytes and the model reads "
        "every parameter rounded to bf16 (stored and updated in f32); fp8 (float8_e4m3fn) and "
        "fp8-e5m2 move a quarter, each row scaled by its largest magnitude (needs an fsdp axis of more "
        "than one device: without one nothing is gathered)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=list(DTYPES),
        default="f32",
        help="dtype FSDP reduce-scatters gradients in",
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        help="split activations between TP blocks over the tensor axis (default: on)",
    )
    _scan_layers_flag(p, default=True, why="--no-scan-layers unrolls them")
    p.add_argument(
        "--async-tp",
        choices=["off", "unidirectional", "bidirectional"],
        default="off",
        help="overlap TP collectives with matmuls (ring collective matmul)",
    )
    p.add_argument(
        "--check-vma",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="jax.shard_map's varying-manual-axes checking",
    )


def _train_flags(train: argparse.ArgumentParser) -> None:
    train.add_argument("--steps", type=int, default=300, help="train steps (the schedule's length)")
    train.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps per batch")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine)")
    train.add_argument(
        "--warmup",
        type=int,
        help=f"warmup steps (default: {DEFAULT_WARMUP}; given, it must end before --steps)",
    )
    train.add_argument(
        "--optimizer",
        choices=["adamw", "adafactor", "lamb", "lion", "sgd"],
        default="adamw",
        help="optax optimizer",
    )
    train.add_argument(
        "--clip-norm", type=float, default=1.0, help="clip the gradient's global norm to this (0: off)"
    )
    train.add_argument(
        "--nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a step with a nan/inf loss or update: stop (exit 1, nothing bad saved) or skip it",
    )
    train.add_argument("--seed", type=int, default=0, help="init and batch order")
    train.add_argument(
        "--data",
        help="a UTF-8 text file (bytes as tokens), .npy or uint16 .bin tokens (default: embedded corpus)",
    )
    train.add_argument("--log-file", help="append JSON lines: a run header, then step, loss, tokens/s")
    train.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    train.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own logs (orbax's, through absl) on stderr",
    )
    train.add_argument(
        "--peak-tflops",
        type=float,
        help="a device's peak TFLOP/s in the compute dtype, for MFU (default: from a table of "
        "accelerators; none on CPU, where MFU is not shown)",
    )
    train.add_argument(
        "--check", type=int, default=0, metavar="K", help="compare K steps with the unsharded twin first"
    )
    train.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (0: off)")
    train.add_argument("--eval-batches", type=int, default=4, help="held-out batches per eval")
    add_checkpoint_flags(train)
    train.add_argument(
        "--cpu-devices", type=int, help="simulate this many CPU devices per process (default: the mesh's)"
    )
    add_process_flags(train)


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--out", default="docs", help="where benchmarks.md and the plots go")
    bench.add_argument("--workloads", default="mlp,block,gpt", help="some of mlp, block, gpt")
    bench.add_argument("--blocks", type=int, default=3, help="interleaved timing blocks (median taken)")
    bench.add_argument("--steps", type=int, default=3, help="steps per timing block")
    bench.add_argument("--depths", default="2,8,32", help="GPT layers for the compile-time figure")
    bench.add_argument("--max-unrolled", type=int, default=32, help="deepest unrolled GPT to compile")
    bench.add_argument(
        "--build-depths", default="8,32", help="unrolled GPT depths whose whole build is timed vs plain flax"
    )
    bench.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw the plots")
    bench.add_argument("--readme", default="README.md", help="rewrite its headline table (if marked)")
    acc = bench.add_argument_group("--accelerator: the realistic presets on one device (GPU or TPU)")
    acc.add_argument(
        "--accelerator",
        action="store_true",
        help="only this: library vs plain flax, tokens/s, MFU, memory -> benchmarks_accelerator.md",
    )
    acc.add_argument("--presets", default="125m:32,1b:16", help="PRESET:GLOBAL_BATCH, comma-separated")
    acc.add_argument("--vocab-size", type=int, default=32768, help="the presets' vocabulary")
    acc.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="compute dtype")
    acc.add_argument(
        "--precisions",
        default="f32/f32",
        help=f"one row per GATHER/REDUCE dtype pair FSDP gathers parameters and reduces gradients in, "
        f"comma-separated (GATHER: {', '.join(GATHER_DTYPES)}; REDUCE: {', '.join(DTYPES)}); one "
        "device gathers nothing, so a narrower gather shows its rounding's cost",
    )
    _compute_flags(acc, remat_default="dots")
    _scan_layers_flag(
        acc, default=False, why="unrolled by default, as docs/benchmarks_accelerator.md was measured"
    )


def _scan_layers_flag(p, default: bool, why: str) -> None:
    """``--scan-layers/--no-scan-layers``: the one flag, whose default differs by command
    (train and plan scan; the accelerator bench unrolls, as its page was measured)."""
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"nn.scan over the layers (one compiled block, a faster compile); {why}",
    )


def parser(description: str) -> argparse.ArgumentParser:
    """The ``fsdp-tp`` parser: ``train`` (the default command), ``plan``, ``finetune`` and ``bench``."""
    top = argparse.ArgumentParser(prog="fsdp-tp", description=description, formatter_class=_Help)
    sub = top.add_subparsers(dest="command", required=False)
    train = sub.add_parser("train", help="train the model (the default command)", formatter_class=_Help)
    plan = sub.add_parser(
        "plan", help="print what each device would hold, on any mesh", formatter_class=_Help
    )
    for p in (train, plan):
        _model_flags(p)
    plan.add_argument(
        "--from",
        dest="from_dir",
        metavar="DIR",
        help="plan a downloaded Hugging Face checkpoint's model (its config.json; no weights needed) "
        "instead of the preset's GPT",
    )
    _train_flags(train)
    add_finetune_flags(
        sub.add_parser(
            "finetune",
            help="fine-tune a downloaded Hugging Face checkpoint, all its weights",
            formatter_class=_Help,
        )
    )
    _bench_flags(
        sub.add_parser(
            "bench", help="measure every strategy against the baselines; write docs", formatter_class=_Help
        )
    )
    return top

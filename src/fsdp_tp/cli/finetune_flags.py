"""The flags of ``fsdp-tp finetune`` (:mod:`fsdp_tp.cli.finetune` runs them): the checkpoint
and the data, the mesh, the schedule, ``--check``, the export, and ``train``'s checkpoint flags."""

from __future__ import annotations

import argparse

from ..recipe.trainer import APIS
from .workdir import add_checkpoint_flags

__all__ = ["EXPORT_DTYPES", "add_finetune_flags"]

EXPORT_DTYPES = ("F32", "BF16", "F16")


def add_finetune_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from", dest="from_dir", metavar="DIR", required=True, help="a downloaded Hugging Face checkpoint"
    )
    p.add_argument(
        "--data",
        required=True,
        help="tokens (.npy, uint16 .bin) or UTF-8 text, tokenized by DIR's tokenizer.json",
    )
    p.add_argument(
        "--mesh", default="data=2,fsdp=2,tensor=2", help="axis sizes: data, fsdp, expert, context, tensor"
    )
    p.add_argument("--api", choices=APIS, default="linen", help="the decoder's Flax API")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="the blocks in one scan: one layer traced and compiled, whatever the depth (its layers alike)",
    )
    p.add_argument("--steps", type=int, default=20, help="fine-tuning steps (the schedule's length)")
    p.add_argument("--batch", type=int, default=8, help="windows a step (split over data, fsdp, expert)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens a window")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (AdamW; warmup, then cosine)")
    p.add_argument("--warmup", type=int, default=0, help="warmup steps")
    p.add_argument(
        "--clip-norm", type=float, default=1.0, help="clip the gradient's global norm to this (0: off)"
    )
    p.add_argument("--seed", type=int, default=0, help="batch order")
    p.add_argument("--log-every", type=int, default=1, help="steps between progress lines")
    p.add_argument(
        "--check", type=int, default=0, metavar="K", help="compare K steps with the unsharded model first"
    )
    p.add_argument("--export", metavar="OUT", help="write the tuned model to OUT in the checkpoint's layout")
    p.add_argument(
        "--export-dtype", choices=EXPORT_DTYPES, help="the export's dtype (default: each tensor's own)"
    )
    p.add_argument("--cpu-devices", type=int, help="simulate this many CPU devices (default: the mesh's)")
    add_checkpoint_flags(p)

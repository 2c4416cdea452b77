"""``fsdp-tp``: train the library's GPT-style model end to end, or print its sharding plan.

    fsdp-tp train                        # 8 simulated CPU devices, mesh 2x2x2, embedded data
    fsdp-tp train --check 3              # and first compare 3 steps with the unsharded twin
    fsdp-tp plan --preset base --mesh data=8,fsdp=64,tensor=8

Bad input exits with status 2 and one line saying what to change.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys

from ..errors import IndivisibleShapeError, MeshShapeError
from ..mesh import parse_mesh
from .config import PRESETS, preset
from .data import DataError

__all__ = ["main"]

DEFAULT_MESH = "data=2,fsdp=2,tensor=2"


class UsageError(ValueError):
    """Options that cannot work together (batch not divisible, ...)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-tp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=False)
    train = sub.add_parser("train", help="train the model (the default command)")
    plan = sub.add_parser("plan", help="print what each device would hold, on any mesh")
    for p in (train, plan):
        p.add_argument("--mesh", default=DEFAULT_MESH, help=f"axis sizes, e.g. {DEFAULT_MESH}")
        p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
        p.add_argument("--d-model", type=int)
        p.add_argument("--layers", type=int, dest="num_layers")
        p.add_argument("--heads", type=int, dest="num_heads")
        p.add_argument("--kv-heads", type=int, dest="num_kv_heads")
        p.add_argument("--mlp-hidden", type=int)
        p.add_argument("--seq-len", type=int)
        p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
        p.add_argument("--min-weight-size", type=int, default=2**10, help="smaller params stay whole")
        p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--async-tp", choices=["off", "unidirectional", "bidirectional"], default="off")
        p.add_argument("--check-vma", action=argparse.BooleanOptionalAction, default=True)
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--microbatches", type=int, default=1)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=20)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", help="a UTF-8 text file (bytes as tokens), .npy or uint16 .bin tokens")
    train.add_argument("--log-file", help="append JSON lines of step, loss, tokens/s")
    train.add_argument("--log-every", type=int, default=25)
    train.add_argument(
        "--check", type=int, default=0, metavar="K", help="compare K steps with the twin first"
    )
    train.add_argument("--cpu-devices", type=int, help="simulate this many CPU devices (default: the mesh's)")
    return parser


def _settings(args, mesh: dict):
    from .trainer import Settings

    overrides = {
        k: getattr(args, k)
        for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "seq_len")
    }
    config = preset(args.preset, **overrides)
    shards = mesh.get("data", 1) * mesh.get("fsdp", 1)
    if args.batch % shards:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the batch shards data x fsdp = {shards}; "
            f"use a multiple of {shards}."
        )
    microbatches = getattr(args, "microbatches", 1)
    if (args.batch // shards) % microbatches:
        raise UsageError(
            f"--microbatches {microbatches} does not divide the per-device batch {args.batch // shards} "
            f"(--batch {args.batch} / {shards} shards); choose a divisor of it."
        )
    return Settings(
        model=config,
        steps=getattr(args, "steps", 1),
        batch=args.batch,
        microbatches=microbatches,
        lr=getattr(args, "lr", 0.0),
        warmup=getattr(args, "warmup", 0),
        seed=getattr(args, "seed", 0),
        sequence_parallel=args.sequence_parallel,
        collective_matmul=None if args.async_tp == "off" else args.async_tp,
        check_vma=args.check_vma,
        min_weight_size=args.min_weight_size,
    )


def _mesh(text: str) -> dict:
    sizes = parse_mesh(text)
    unknown = set(sizes) - {"data", "fsdp", "tensor"}
    if unknown:
        raise MeshShapeError(f"--mesh {text!r}: unknown axes {sorted(unknown)}; use data, fsdp and tensor.")
    return {axis: sizes.get(axis, 1) for axis in ("data", "fsdp", "tensor")}


def _has_accelerator_plugin() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    args = _parser().parse_args(argv)
    try:
        sizes = _mesh(args.mesh)
        settings = _settings(args, sizes)
        if args.command == "plan":
            from .run import print_plan

            print_plan(settings, sizes, out)
            return 0
        from ..mesh import simulate_cpu_devices

        if args.cpu_devices or not _has_accelerator_plugin():
            simulate_cpu_devices(args.cpu_devices or math.prod(sizes.values()))
        from .run import train

        return train(settings, sizes, args, out)
    except (MeshShapeError, IndivisibleShapeError, DataError, UsageError) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

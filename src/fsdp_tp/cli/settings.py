"""The run's settings from ``fsdp-tp``'s flags: the mesh sizes, the model and schedule, and
the token files they must fit, every mismatch refused (exit 2) before anything starts."""

from __future__ import annotations

import numpy as np

from .._axes import CONTEXT
from .._sequence_split import SequenceSplit
from ..errors import MeshShapeError
from ..mesh import DEFAULT_AXIS_NAMES, parse_mesh
from ..models import Layout
from ..precision import MixedPrecision
from ..recipe.config import preset
from ..recipe.data import (
    EVAL_FRACTION,
    check_tokens,
    check_vocab,
    load_tokens,
    split_held_out,
    token_bounds,
    vocab_for,
)
from ..recipe.trainer import Settings
from .checks import UsageError, check_nnx, check_schedule, check_tensor_split
from .experts import check_experts, expert_fields
from .options import DEFAULT_MESH, DEFAULT_WARMUP, DTYPES, GATHER_DTYPES

__all__ = ["mesh_sizes", "settings_of", "tokens_and_settings"]


def settings_of(args, mesh: dict, vocab_size: int | None = None) -> Settings:
    """The run's ``Settings`` from the parsed flags on a mesh of ``mesh`` sizes; a batch,
    microbatch count or head count that does not fit raises ``UsageError`` naming the fix.

    >>> from fsdp_tp.cli.options import parser
    >>> args = parser("").parse_args(["train", "--steps", "5"])
    >>> settings_of(args, {"data": 2, "fsdp": 2, "tensor": 2}).steps
    5
    """
    overrides = {
        k: getattr(args, k)
        for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "seq_len")
    }
    config = preset(
        args.preset,
        **overrides,
        vocab_size=args.vocab_size or vocab_size,
        **{
            "dtype": DTYPES[args.dtype],
            "scan_layers": args.scan_layers,
            "attention": args.attention,
            "remat": args.remat,
            **expert_fields(args),  # (the MoE LM's: unrolled)
        },
    )
    check_experts(args, mesh, config)
    shards = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
    if args.batch % shards:
        axes = "data x fsdp x expert" if "expert" in mesh else "data x fsdp"
        raise UsageError(
            f"--batch {args.batch} is not divisible by the batch shards {axes} = {shards}; "
            f"use a multiple of {shards}."
        )
    microbatches = getattr(args, "microbatches", 1)
    if (args.batch // shards) % microbatches:
        raise UsageError(
            f"--microbatches {microbatches} does not divide the per-device batch {args.batch // shards} "
            f"(--batch {args.batch} / {shards} shards); choose a divisor of it."
        )
    clip_norm = getattr(args, "clip_norm", 0.0)
    if config.num_heads % config.num_kv_heads:
        given = f" (the {args.preset} preset's)"
        kv = f"--kv-heads {config.num_kv_heads}" + ("" if args.num_kv_heads else given)
        heads = f"--heads {config.num_heads}" + ("" if args.num_heads else given)
        raise UsageError(
            f"{kv} does not divide {heads}; each key/value head serves a whole group of query heads: "
            f"pass --kv-heads with a divisor of {config.num_heads}."
        )
    check_tensor_split(config, args, mesh, _sequence_parallel(args))
    sequence = _sequence_split(args, mesh, config)
    packed = _packed(args, config)
    _check_gathered(args, mesh)
    check_schedule(args)
    if args.api == "nnx" and not config.experts:
        check_nnx(args, mesh.get("tensor", 1))
    return Settings(
        model=config,
        steps=getattr(args, "steps", 1),
        batch=args.batch,
        microbatches=microbatches,
        lr=getattr(args, "lr", 0.0),
        warmup=DEFAULT_WARMUP if getattr(args, "warmup", None) is None else args.warmup,
        seed=getattr(args, "seed", 0),
        # A tensor axis of size 1 splits nothing: the model computes without Megatron's layers,
        # so FSDP may split every dim (a layer's dim over 'tensor' is not FSDP's to split).
        layout=Layout(
            tensor="tensor" if mesh.get("tensor", 1) > 1 else None,
            fsdp="fsdp",
            sequence_parallel=_sequence_parallel(args),
            collective_matmul=None if args.async_tp == "off" else args.async_tp,
            min_weight_size=args.min_weight_size,
            mixed_precision=_mixed_precision(args),
        ),
        check_vma=args.check_vma,
        optimizer_name=getattr(args, "optimizer", "adamw"),
        clip_norm=clip_norm,
        api=args.api,
        sequence=sequence,
        packed=packed,
    )


def _packed(args, config) -> int | None:
    """The token ending a document under ``--packed``, or ``None``; one the run cannot take is
    one line with the fix."""
    eos = getattr(args, "packed", None)
    if eos is None:
        return None
    if config.experts:
        raise UsageError(
            f"--packed {eos} with --experts: the MoE LM takes no segment ids yet; drop --packed "
            f"(its windows are then one document each), or drop --experts."
        )
    if not 0 <= eos < config.vocab_size:
        raise UsageError(
            f"--packed {eos}: the end-of-document token is no token of the vocabulary (0 .. "
            f"{config.vocab_size - 1}); pass the id your data ends a document with."
        )
    return eos


def _sequence_split(args, mesh: dict, config) -> SequenceSplit | None:
    """The sequence split a ``context`` axis in ``--mesh`` asks for, or ``None``; a sequence
    or a strategy it cannot take is one line with the fix."""
    size = mesh.get(CONTEXT, 1)
    strategy = getattr(args, "context_strategy", None)
    if size == 1:
        if strategy is not None:
            raise UsageError(
                f"--context-strategy {strategy} without a {CONTEXT} axis in --mesh "
                f"({','.join(f'{k}={v}' for k, v in mesh.items() if v > 1)}): nothing splits the "
                f"sequence, so no attention crosses devices; add {CONTEXT}=N to --mesh, or drop "
                f"--context-strategy."
            )
        return None
    flag = f"--mesh {CONTEXT}={size}"
    if config.experts and config.capacity_factor is not None:
        raise UsageError(
            f"{flag} with --capacity-factor {config.capacity_factor:g}: a device routes its own share of "
            f"each sequence, so a capacity would drop other tokens than the unsharded model does; drop "
            f"--capacity-factor (dropless routing, exact under the split), or the {CONTEXT} axis."
        )
    chunks = 2 * size
    if config.seq_len % chunks:
        raise UsageError(
            f"--seq-len {config.seq_len} on {flag}: the balanced split cuts each sequence in 2 x {size} = "
            f"{chunks} chunks; use --seq-len {-(-config.seq_len // chunks) * chunks}."
        )
    kv_here = config.num_kv_heads // max(mesh.get("tensor", 1), 1)
    strategy = strategy or "ring"
    if strategy == "all_to_all" and kv_here % size:
        raise UsageError(
            f"--context-strategy all_to_all on {flag}: a device holds {kv_here} kv heads (--kv-heads "
            f"{config.num_kv_heads} over tensor {mesh.get('tensor', 1)}), which {size} does not divide; "
            f"use --context-strategy ring (or auto, which takes the ring here)."
        )
    return SequenceSplit(CONTEXT, strategy=strategy)


def _sequence_parallel(args) -> bool:
    """``--sequence-parallel``, or its default: on."""
    return True if args.sequence_parallel is None else args.sequence_parallel


def _mixed_precision(args) -> MixedPrecision | None:
    """``--gather-dtype`` / ``--reduce-dtype``: a policy where either is narrower than f32."""
    if args.gather_dtype == args.reduce_dtype == "f32":
        return None
    return MixedPrecision(GATHER_DTYPES[args.gather_dtype], DTYPES[args.reduce_dtype])


def _check_gathered(args, mesh: dict) -> None:
    """``--gather-dtype`` / ``--reduce-dtype`` narrower than f32 on a mesh whose fsdp axis has
    one device: FSDP gathers and reduce-scatters nothing there, and the policy would only round
    every weight the model reads (an fp8 one trains another model, said to gather in fp8).
    Refused, with the mesh that moves the data axis's devices to fsdp."""
    if _mixed_precision(args) is None or mesh.get("fsdp", 1) > 1:
        return
    flags = " ".join(
        f"--{flag}-dtype {getattr(args, f'{flag}_dtype')}"
        for flag in ("gather", "reduce")
        if getattr(args, f"{flag}_dtype") != "f32"
    )
    moved = {"fsdp" if axis == "data" else axis: size for axis, size in mesh.items() if axis != "fsdp"}
    fix = ",".join(f"{axis}={size}" for axis, size in moved.items() if size > 1 or axis == "fsdp")
    given = ",".join(f"{axis}={size}" for axis, size in mesh.items() if size > 1) or "of one device"
    raise UsageError(
        f"{flags} on --mesh {given}: the mesh has no fsdp axis of more than one device, so FSDP "
        f"gathers and reduce-scatters nothing, and the dtype would only round every parameter the "
        f"model reads. Split the parameters over fsdp (--mesh {fix}), or leave the dtypes at f32."
    )


def mesh_sizes(text: str, experts: int | None = None) -> dict:
    """``--mesh`` as sizes over data, fsdp and tensor (1 where not named), and ``expert`` where
    named or the run has ``experts``.

    >>> mesh_sizes("fsdp=4,tensor=2")
    {'data': 1, 'fsdp': 4, 'tensor': 2}
    >>> mesh_sizes("data=2,expert=2,tensor=2", experts=8)
    {'data': 2, 'fsdp': 1, 'expert': 2, 'tensor': 2}
    """
    sizes = parse_mesh(text)
    unknown = set(sizes) - {"data", "fsdp", "expert", "tensor", CONTEXT}
    if unknown:
        raise MeshShapeError(
            f"--mesh {text!r}: unknown axes {sorted(unknown)}; use data, fsdp, tensor and context (and "
            f"expert, with --experts)."
        )
    bad = {axis: size for axis, size in sizes.items() if size < 1}
    if bad:
        raise MeshShapeError(f"--mesh {text!r}: axis sizes must be >= 1, got {bad}; e.g. {DEFAULT_MESH}.")
    axes = ("data", "fsdp", "expert", "tensor") if experts or "expert" in sizes else DEFAULT_AXIS_NAMES
    axes = (*axes[:-1], CONTEXT, axes[-1]) if CONTEXT in sizes else axes  # (the sequence's: named only)
    return {axis: sizes.get(axis, 1) for axis in axes}


def tokens_and_settings(args, mesh: dict):
    """The train and held-out tokens (``None`` without ``--eval-every``) and the settings that
    fit them, checked before anything starts or is written."""
    tokens = load_tokens(args.data)
    low, top = token_bounds(tokens)
    # A token file's ids may exceed the bytes' 256: fit the vocabulary unless it was given.
    settings = settings_of(args, mesh, None if tokens.dtype == np.uint8 else vocab_for(top))
    name = args.data or "the embedded corpus"
    check_vocab(low, top, settings.model.vocab_size, name)
    if not args.eval_every:
        check_tokens(tokens, settings.model.seq_len, name)
        train, held_out = tokens, None
    else:
        train, held_out = split_held_out(tokens, EVAL_FRACTION)
        check_tokens(train, settings.model.seq_len, f"{name} (train part)")
        check_tokens(held_out, settings.model.seq_len, f"{name} (held-out part for --eval-every)")
    return train, held_out, settings

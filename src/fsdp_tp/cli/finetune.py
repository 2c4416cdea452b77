"""``fsdp-tp finetune --from DIR``: full fine-tuning of a downloaded checkpoint on a mesh.

    fsdp-tp finetune --from ~/Llama-3.2-1B --data corpus.txt --mesh fsdp=4,tensor=2 --steps 200
    fsdp-tp finetune --from DIR --data tokens.npy --check 2 --export tuned/

The model is :class:`~fsdp_tp.hub.finetune.FineTune`'s: the checkpoint's decoder laid out over
``--mesh`` (``data``, ``fsdp``, ``expert``, ``context``, ``tensor``), its weights read straight
into their shards. The data is a token file (``.npy`` of any int dtype, or uint16 ``.bin``) or
UTF-8 text, which the checkpoint's own ``tokenizer.json`` tokenizes (the ``tokenizers``
package: ``pip install 'fsdp-tp[hub]'``; no ``transformers``). ``--check K`` first runs ``K``
steps sharded and on one device, unsharded, from the same weights, and compares them;
``--checkpoint-dir`` saves the train state as ``train`` does (``--resume`` continues it);
``--export DIR`` writes the tuned model back in the checkpoint's own layout.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

import numpy as np

from ..errors import CheckpointMismatchError
from ..recipe.data import Tokens, check_tokens, check_vocab, load_tokens, token_bounds
from .checks import UsageError
from .resume import data_identity
from .workdir import check_contents, clear, locked, resuming

__all__ = ["finetune", "read_data"]

# --check's bound on float64 loss and parameter differences (measured on the shipped tiny
# checkpoints: at most 4e-15 over the meshes tested; a wrong layout is off by > 1e-3)
CHECK_TOLERANCE = 1e-12


def read_data(path: str, directory: str) -> Tokens:
    """Tokens from a token file, or ``path``'s text tokenized by ``directory``'s ``tokenizer.json``."""
    if Path(path).suffix in (".npy", ".bin"):
        return load_tokens(path)
    vocabulary = Path(directory) / "tokenizer.json"
    if not vocabulary.is_file():
        raise UsageError(
            f"--data {path}: text, but {directory} has no tokenizer.json to tokenize it with; download "
            f"the checkpoint's tokenizer.json into {directory}, or pass tokens (.npy or uint16 .bin)."
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise UsageError(
            f"--data {path}: text is tokenized by the checkpoint's tokenizer.json with the tokenizers "
            f"package, which is not installed: pip install 'fsdp-tp[hub]' (or pass tokens, .npy or .bin)."
        ) from err
    text = Path(path).read_text(encoding="utf-8")
    return np.asarray(Tokenizer.from_file(str(vocabulary)).encode(text).ids, np.int32)


def _check_data(tokens: Tokens, args, vocab: int) -> None:
    check_tokens(tokens, args.seq_len, f"--data {args.data}")
    low, top = token_bounds(tokens)
    check_vocab(low, top, vocab, f"--data {args.data} (the checkpoint's vocabulary)")


def finetune(args, out: TextIO) -> int:
    """The command; its exit status (1: ``--check`` failed or a step was not finite)."""
    import jax

    from ..hub import DecoderConfig
    from ..hub.directory import Checkpoint
    from ..mesh import simulate_cpu_devices
    from .machine import check_platforms, uses_accelerator
    from .settings import mesh_sizes

    check_platforms()
    for flag in ("steps", "batch", "seq_len", "log_every"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1.")
    config = DecoderConfig.from_hub(Checkpoint(args.from_dir).config)  # (every header checked)
    tokens = read_data(args.data, args.from_dir)
    _check_data(tokens, args, config.vocab)
    sizes = mesh_sizes(args.mesh, config.experts or None)
    rows = math.prod(sizes.get(axis, 1) for axis in ("data", "fsdp", "expert"))
    if args.batch % rows:
        raise UsageError(
            f"--batch {args.batch}: the windows are split over data x fsdp x expert, {rows} devices in "
            f"--mesh {args.mesh}; pass a multiple of {rows}."
        )
    if args.checkpoint_dir:
        check_contents(args.checkpoint_dir, resuming(args), args.overwrite, args.resume_from)
    if not uses_accelerator(args):
        simulate_cpu_devices(args.cpu_devices or math.prod(sizes.values()))
    if math.prod(sizes.values()) != jax.device_count():
        raise UsageError(
            f"--mesh {args.mesh}: {math.prod(sizes.values())} devices, but {jax.device_count()} are "
            f"here; give sizes whose product is {jax.device_count()}."
        )
    tune = _fine_tune(args, sizes)
    say = lambda line: print(line, file=out, flush=True)
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tune.state.params))
    say(
        f"{config.family} from {args.from_dir}: {params:,} params on mesh "
        f"{' x '.join(f'{k}={v}' for k, v in sizes.items())}; this process read "
        f"{tune.report.bytes_read:,} B of the checkpoint; {len(tokens):,} tokens of --data"
    )
    if args.check and not _check(args, sizes, tokens, say):
        return 1
    with ExitStack() as stack:
        checkpoints = _checkpoints(args, stack, say)
        start = _resume(tune, checkpoints, args, tokens, say) if checkpoints else 0
        code = _loop(tune, tokens, start, args, checkpoints, say)
    if code == 0 and args.export:
        tune.export(args.export, args.export_dtype)
        say(f"exported the tuned model to {args.export} ({args.export_dtype or 'each tensor in its dtype'})")
    return code


def _fine_tune(args, sizes: dict, dtype=None):
    """The command's :class:`~fsdp_tp.hub.finetune.FineTune`, by its flags (``dtype``: the
    parameters', float64 for ``--check``)."""
    from ..hub.finetune import FineTune, Schedule

    schedule = Schedule(args.lr, args.warmup, args.steps, args.clip_norm)
    return FineTune(
        args.from_dir, sizes, batch=args.batch, seq_len=args.seq_len, api=args.api, schedule=schedule,
        seed=args.seed, dtype=dtype, scan=args.scan_layers,
    )  # fmt: skip


def _meta(args, tokens: Tokens) -> dict:
    """What a checkpoint records of its run: a resume refuses another (``--allow-changes`` aside)."""
    return {
        "from": str(Path(args.from_dir).resolve()),
        "data": data_identity(tokens, Path(args.data).name),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "schedule": {"lr": args.lr, "warmup": args.warmup, "steps": args.steps, "clip_norm": args.clip_norm},
        "api": args.api,
        "scan_layers": args.scan_layers,
    }


def _checkpoints(args, stack: ExitStack, say):
    if not args.checkpoint_dir:
        return None
    from ..checkpoint import Checkpoints

    stack.enter_context(locked(args.checkpoint_dir))
    if args.overwrite and (gone := clear(args.checkpoint_dir)):
        say(f"--overwrite: deleted checkpoints {gone} in {args.checkpoint_dir}")
    checkpoints = Checkpoints(args.checkpoint_dir, keep=args.keep, every=args.checkpoint_every)
    return stack.enter_context(checkpoints)


def _resume(tune, checkpoints, args, tokens: Tokens, say) -> int:
    """The step the run continues from: the newest checkpoint's (``--resume-from``'s), restored
    into ``tune`` on this mesh, or 0. Checkpoints newer than it are set aside, as ``train`` does."""
    if not resuming(args) or checkpoints.latest() is None:
        return 0
    state, meta = checkpoints.restore(tune.state, args.resume_from)
    now = _meta(args, tokens)
    changed = sorted(k for k in now if meta.get(k) != now[k])
    if changed and not args.allow_changes:
        raise CheckpointMismatchError(
            f"--resume: checkpoint {checkpoints.path(meta['step'])} was written by another run (its "
            f"{', '.join(changed)} differ from this one's); pass the same flags, or --allow-changes."
        )
    if newer := [s for s in checkpoints.steps() if s > meta["step"]]:
        moved = [checkpoints.set_aside(s, "superseded").name for s in newer]
        say(f"checkpoints {newer}, newer than step {meta['step']}, moved to {', '.join(moved)}")
    tune.state = state
    say(f"resumed from checkpoint {meta['step']} in {args.checkpoint_dir}")
    return int(meta["step"])


def _loop(tune, tokens: Tokens, start: int, args, checkpoints, say) -> int:
    meta, first, last = _meta(args, tokens), math.nan, math.nan
    began = time.perf_counter()
    for step in range(start, args.steps):
        loss = tune.step(tune.batch_at(tokens, step))
        if not math.isfinite(loss):
            print(f"fsdp-tp: error: step {step + 1}: loss {loss} is not finite; lower --lr.", file=sys.stderr)
            return 1
        first, last = (loss if math.isnan(first) else first), loss
        if checkpoints:
            checkpoints.check()
            checkpoints.save(step + 1, tune.state, meta, force=step + 1 == args.steps)
        if step % args.log_every == 0 or step == args.steps - 1:
            say(f"step {step + 1}/{args.steps}: loss {loss:.4f} ({time.perf_counter() - began:.1f} s)")
    if checkpoints:
        checkpoints.wait()
    say(f"done: loss {first:.4f} -> {last:.4f}" if start < args.steps else f"step {start} already reached")
    return 0


def _check(args, sizes: dict, tokens: Tokens, say) -> bool:
    """``--check K``: ``K`` steps on the mesh and on one device, unsharded, from the same weights
    on the same batches, in float64 (in float32, AdamW's first steps turn a gradient's rounding
    into a sign: measured, parameters apart by a third of the learning rate, whatever the
    layout); the run itself then starts afresh, in the decoder's dtype."""
    import jax

    with jax.enable_x64(True):
        sharded = _fine_tune(args, sizes, dtype="float64")
        twin = sharded.twin()
        losses = [sharded.step(sharded.batch_at(tokens, i)) for i in range(args.check)]
        twin_losses = [twin.step(twin.batch_at(tokens, i)) for i in range(args.check)]
        diffs = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), sharded.params(), twin.params())
    param_diff = max(jax.tree.leaves(diffs))
    loss_diff = float(np.abs(np.subtract(losses, twin_losses)).max())
    ok = loss_diff <= CHECK_TOLERANCE and param_diff <= CHECK_TOLERANCE
    say(
        f"check: {args.check} steps sharded vs unsharded, float64: largest loss difference {loss_diff:.3g}, "
        f"largest parameter difference {param_diff:.3g} -> {'ok' if ok else 'FAILED'}"
    )
    return ok

"""What a checkpoint of ``fsdp-tp train`` records besides its arrays, what a resume changed,
and the resume (:func:`resume`).

A resumed run continues the one that wrote the checkpoint only if it draws the same batches
(data, seed, batch) from the same schedule (learning rate, warmup, steps, optimizer,
clipping) on the same model. Anything else is refused unless ``--allow-changes`` says so.

>>> recorded = {"schedule": {"lr": 0.003, "steps": 300}, "seed": 0}
>>> changes(recorded, {"schedule": {"lr": 0.001, "steps": 300}, "seed": 0})
['schedule lr: 0.003 -> 0.001']
"""

from __future__ import annotations

import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..checkpoint import Checkpoints
from ..errors import CheckpointMismatchError
from ..recipe.data import Tokens
from ..recipe.trainer import Settings, Trainer
from .checks import UsageError

__all__ = ["changes", "data_identity", "data_name", "precision_of", "record", "resume"]

_SAMPLES = 4096  # tokens read to fingerprint a (possibly huge, memory-mapped) token file


def data_name(args) -> str:
    """What the run's data is called in its record: the file's name, or the embedded corpus."""
    return Path(args.data).name if args.data else "embedded corpus"


def data_identity(tokens: Tokens, name: str) -> dict:
    """The data's name, length and a CRC of evenly spaced tokens: cheap on a 100 GB file, and
    different for another file, another tokenizer or another order with near certainty."""
    stride = max(1, len(tokens) // _SAMPLES)
    sample = np.asarray(tokens[: stride * _SAMPLES : stride], dtype=np.int64)  # (read only these)
    return {"name": name, "tokens": len(tokens), "crc32": zlib.crc32(sample.tobytes())}


def record(settings: Settings, data: dict) -> dict:
    """The checkpoint's ``meta``: what ``changes`` compares on resume."""
    return {
        "api": settings.api,
        "seed": settings.seed,
        "batch": settings.batch,
        "data": data,
        "model": asdict(settings.model),
        "precision": precision_of(settings),
        "schedule": {
            "lr": settings.lr,
            "warmup": settings.warmup,
            "steps": settings.steps,
            "optimizer": settings.optimizer_name,
            "clip_norm": settings.clip_norm,
        },
    }


def precision_of(settings: Settings) -> dict:
    """The dtypes FSDP gathers and reduces f32 parameters in (they change the numbers a resumed
    run computes): ``{"gather": "bfloat16", "reduce": "float32"}``, say."""
    policy = settings.layout.mixed_precision
    gather, reduce = policy.dtypes_for("float32") if policy is not None else (None, None)
    return {"gather": str(gather or "float32"), "reduce": str(reduce or "float32")}


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + " ") if isinstance(value, dict) else {name: value})
    return out


def changes(recorded: dict, now: dict) -> list[str]:
    """``"what: recorded -> now"`` for every recorded field that differs (fields a checkpoint of
    an older version did not record are not compared)."""
    old, new = _flat(recorded), _flat(now)
    return [f"{k}: {old[k]} -> {new.get(k)}" for k in old if k in new and old[k] != new[k]]


def _other_api(checkpoints: Checkpoints, step: int | None, now: dict) -> None:
    """A checkpoint whose arrays do not fit this model, written with another ``--api``, is
    named by the flag (its trees differ: a list of shapes would not say why)."""
    step = checkpoints.latest() if step is None else step
    if step is None:
        return
    try:
        recorded = checkpoints.meta(step).get("api")
    except Exception:  # unreadable meta: the mismatch's own message stands
        return
    if recorded is not None and recorded != now.get("api"):
        raise UsageError(
            f"checkpoint {checkpoints.path(step)} was written with --api {recorded}, and this run is "
            f"--api {now.get('api')}: the two APIs' models are different trees. Resume with --api "
            f"{recorded}, or start a new --checkpoint-dir."
        )


def resume(trainer: Trainer, checkpoints: Checkpoints, args, now: dict, say) -> int:
    """Loads the newest checkpoint that verifies (or ``--resume-from``'s) into the trainer,
    resharding it onto this mesh; refuses one written with other data or schedule. Its step."""
    try:
        state, meta = checkpoints.restore(trainer.state, args.resume_from)
    except CheckpointMismatchError:
        _other_api(checkpoints, args.resume_from, now)  # the likeliest cause, named as a flag
        raise
    for step, why in meta.get("skipped", {}).items():
        say(f"skipped checkpoint {checkpoints.path(step)}: {why}")
    changed = changes(meta, now)
    if changed and not args.allow_changes:
        raise UsageError(
            f"checkpoint {checkpoints.path(meta['step'])} was written by another run: "
            + "; ".join(changed)
            + ". Pass the recorded values, or --allow-changes to resume anyway."
        )
    if changed:
        say(f"note: resuming with changes: {'; '.join(changed)}")
    newer = [s for s in checkpoints.steps() if s > meta["step"]]  # --resume-from an older one
    if newer:
        moved = [checkpoints.set_aside(s, "superseded").name for s in newer]
        say(f"checkpoints {newer}, newer than step {meta['step']}, moved to {', '.join(moved)}")
    trainer.state = state
    say(f"resumed from {checkpoints.path(meta['step'])} at step {meta['step']}")
    return int(meta["step"])

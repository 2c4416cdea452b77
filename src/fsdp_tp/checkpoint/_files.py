"""What a checkpoint directory holds, through orbax: the meta sealed with its digest, a step's
arrays read back and proved against their fingerprints, and a filesystem's error in one line.

:class:`~fsdp_tp.checkpoint.Checkpoints` decides when to save, verify, fall back and delete;
this module reads and writes one step. A meta is saved with the fingerprints of the arrays
beside it and a digest of the rest (:func:`sealed`), and read back only if both still hold:

>>> meta = sealed({"step": 3, "seed": 0})
>>> unsealed(dict(meta), 3)
{'step': 3, 'seed': 0}
>>> unsealed({**meta, "seed": 1}, 3)
Traceback (most recent call last):
...
fsdp_tp.errors.CheckpointCorruptError: its meta/metadata differs from the digest saved with it (edited?)
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._types import PyTree
from ..errors import CheckpointCorruptError
from ._integrity import fingerprints, meta_digest, mismatches
from ._state_tree import check_saved

__all__ = [
    "barrier",
    "cause",
    "moved_aside",
    "read_meta",
    "read_verified",
    "require_arrays",
    "sealed",
    "unsealed",
]

_FINGERPRINTS = "fingerprints"  # the meta key that holds them
_DIGEST = "digest"  # the meta key that holds the digest of the rest of the meta
_FILESYSTEM_ERRORS = (
    errno.EROFS,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EACCES,
    errno.EPERM,
    errno.EIO,
)


def open_manager(directory: Path, async_save: bool) -> ocp.CheckpointManager:
    """orbax's manager of ``directory``: our two items, and no deleting of its own."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # deleting is ours: only after newer ones verified (prunable)
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,  # half-written saves of a killed run
    )
    # Handlers named up front, so a new process can read metadata before its first restore.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def save_args(tree: PyTree, meta: dict | None, step: int) -> ocp.args.Composite:
    """What orbax saves as checkpoint ``step``: the global arrays ``tree``, and ``meta`` with
    the step and the arrays' fingerprints, sealed."""
    sealed_meta = sealed({**(meta or {}), "step": step, _FINGERPRINTS: fingerprints(tree)})
    return ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(sealed_meta))


def prunable(steps: list[int], verified: set[int], keep: int | None) -> list[int]:
    """The ``steps`` (oldest first) older than the ``keep`` newest that are at most the newest
    ``verified`` one: what may be deleted now.

    >>> prunable([1, 2, 3, 4], {3}, keep=2)   # 4 not yet verified: it does not count
    [1]
    """
    newest = max(verified, default=None)
    settled = [s for s in steps if newest is not None and s <= newest]
    if keep is None or len(settled) <= keep:
        return []
    return [s for s in steps if s < settled[-keep]]


def sealed(meta: dict) -> dict:
    """The meta with a digest of itself: a resume reads the step and the run's record from it."""
    return {**meta, _DIGEST: meta_digest(meta)}


def unsealed(meta: dict, step: int) -> dict:
    """The meta read back, checked against its digest and against the checkpoint's own step
    (an edited ``"step"`` would resume another step's state under its number)."""
    digest = meta.pop(_DIGEST, None)  # checkpoints of versions before the digest have none
    if digest is not None and digest != meta_digest(meta):
        raise CheckpointCorruptError("its meta/metadata differs from the digest saved with it (edited?)")
    if meta.get("step", step) != step:
        raise CheckpointCorruptError(
            f"its meta/metadata says step {meta['step']}, but it is checkpoint {step}"
        )
    return meta


def read_verified(
    manager: ocp.CheckpointManager, step: int, target: PyTree, where: str
) -> tuple[PyTree, dict]:
    """Checkpoint ``step``'s global arrays (into ``target``'s abstract tree) and meta, each
    proved: :class:`~fsdp_tp.errors.CheckpointCorruptError` says what did not hold, a
    :class:`~fsdp_tp.errors.CheckpointMismatchError` that ``target`` is another model."""
    try:
        saved = manager.item_metadata(step)["state"]
    except Exception as err:
        raise CheckpointCorruptError(f"its metadata does not read ({cause(err)})") from err
    if saved is None:
        raise CheckpointCorruptError("its array metadata (state/_METADATA) is missing or unreadable")
    check_saved(saved, target, where)  # another model: the user's mistake, not corruption
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
    except Exception as err:
        raise CheckpointCorruptError(f"its arrays do not read ({cause(err)})") from err
    meta = unsealed(dict(restored["meta"]), step)
    recorded = meta.pop(_FINGERPRINTS, None)
    if recorded is None:
        raise CheckpointCorruptError("it records no fingerprints, so its bytes cannot be verified")
    bad = mismatches(recorded, fingerprints(restored["state"]))
    if bad:
        raise CheckpointCorruptError(
            f"{len(bad)} array(s) differ from the fingerprints saved with them: {', '.join(bad[:4])}"
            + (", ..." if len(bad) > 4 else "")
        )
    return restored["state"], meta


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    """Checkpoint ``step``'s meta, checked against its digest, without its arrays or their
    fingerprints."""
    restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = unsealed(dict(restored["meta"]), step)
    meta.pop(_FINGERPRINTS, None)
    return meta


def cause(err: BaseException) -> str:
    """What went wrong, in one line: the filesystem's own error where orbax or tensorstore
    wrapped one (their messages run to 150 lines of escaped bytes), else the first line."""
    inner: BaseException | None = err
    while inner is not None:
        if isinstance(inner, OSError) and inner.strerror:
            return f"{inner.strerror}" + (f" ({inner.filename})" if inner.filename else "")
        inner = inner.__cause__ or inner.__context__
    text = str(err)
    for code in _FILESYSTEM_ERRORS:  # tensorstore reports them as text inside a ValueError
        if os.strerror(code) in text:
            return os.strerror(code)
    lines = text.strip().splitlines()
    first = lines[0].split(" See full TensorStore details")[0] if lines else ""
    return f"{type(err).__name__}: {first}"[:300]


def require_arrays(state: PyTree, step: int) -> None:
    """Every leaf of ``state`` is an array (a checkpoint holds arrays and fingerprints them);
    a string or another object is named with its path."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | bool | complex):
            raise TypeError(
                f"Checkpoints.save({step}, ...): the state's leaf at {jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r:.40}); a checkpoint holds arrays. Put it in meta= "
                f"(JSON, saved and restored with the step), or leave it out of the state."
            )


def moved_aside(path: Path, name: str) -> Path:
    """``path`` renamed to ``name`` beside it (``name.1``, ``name.2``, ... where taken), by one
    process, the others waiting for it; returns the new path."""
    barrier(f"fsdp_tp set aside {name}")  # every process names the same destination
    moved, suffix = path.parent / name, 0
    while moved.exists():
        suffix += 1
        moved = path.parent / f"{name}.{suffix}"
    if jax.process_index() == 0:
        path.rename(moved)
    barrier(f"fsdp_tp set aside {name} done")
    return moved


def barrier(name: str) -> None:
    """A barrier across the processes of a multi-process run (nothing in a single one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

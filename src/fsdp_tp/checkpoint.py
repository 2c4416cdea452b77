"""Sharded checkpoints that do not depend on the mesh they were written on, and prove their bytes.

A train state is saved as its *global* arrays (each device writes its own blocks,
through orbax-checkpoint) with the boxes (``nn.Partitioned``) stripped, so the tree on
disk is the unsharded model's tree (invariant 1). Restoring reads each block straight
into the shardings of the state you hand in as ``like``: the same mesh resumes, another
mesh reshards, and no device ever holds more than its own shards.

Saves are asynchronous (training goes on while the bytes are written) and atomic: orbax
writes into a temporary directory and renames it when complete, so a process killed in
the middle of a save leaves the previous checkpoint as the newest restorable one.

Each checkpoint records a fingerprint of every array (``_integrity``) and a digest of its
meta (the step, the run's record, the fingerprints), and a restore recomputes them from what
it read: a checkpoint with flipped or truncated bytes, lost metadata, or an edited meta (or
one renamed to another step) is never handed back. ``restore()`` falls back to the newest checkpoint that
verifies and moves the bad ones aside (``corrupt-<step>``); old checkpoints are deleted
only once ``keep`` newer ones have been read back and verified.

>>> import tempfile, jax.numpy as jnp
>>> with Checkpoints(tempfile.mkdtemp()) as checkpoints:
...     checkpoints.save(0, {"w": jnp.ones(4)}), checkpoints.restore({"w": jnp.zeros(4)})[0]["w"].tolist()
(True, [1.0, 1.0, 1.0, 1.0])
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from ._integrity import fingerprints, meta_digest, mismatches
from ._state_tree import abstract, check_saved, global_tree, into
from ._types import PyTree
from .errors import CheckpointCorruptError, CheckpointSaveError

__all__ = ["Checkpoints", "global_tree"]

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


def _sealed(meta: dict) -> dict:
    """The meta with a digest of itself: a resume reads the step and the run's record from it."""
    return {**meta, _DIGEST: meta_digest(meta)}


def _unsealed(meta: dict, step: int) -> dict:
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


def _cause(err: BaseException) -> str:
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


def _require_arrays(state: PyTree, step: int) -> None:
    """Every leaf of ``state`` is an array (a checkpoint holds arrays and fingerprints them);
    a string or another object is named with its path."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | bool | complex):
            raise TypeError(
                f"Checkpoints.save({step}, ...): the state's leaf at {jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__} ({leaf!r:.40}); a checkpoint holds arrays. Put it in meta= "
                f"(JSON, saved and restored with the step), or leave it out of the state."
            )


def _sync(name: str) -> None:
    """A barrier across the processes of a multi-process run (nothing in a single one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Checkpoints:
    """Numbered, verified checkpoints of a (sharded) train state in ``directory``.

    ``keep``: how many verified checkpoints to keep (``None``: all). ``every`` > 1 makes
    ``save`` skip steps that are not multiples of it (``force`` overrides). ``verify_saves``:
    read each finished save back and check its fingerprints before older ones are deleted
    (costs one read of the state per save). Every process of a multi-process run makes the
    same calls; orbax writes each array block once and one process writes the metadata.
    Saved on ``fsdp=8``, read on ``2 x 4``:

    >>> import tempfile, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> state = {"w": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("fsdp")))}
    >>> with Checkpoints(tempfile.mkdtemp(), keep=2) as checkpoints:
    ...     checkpoints.save(3, state, {"seed": 0})
    ...     other = make_mesh({"data": 2, "fsdp": 4})
    ...     like = {"w": jax.device_put(jnp.zeros(16), NamedSharding(other, P("fsdp")))}
    ...     restored, meta = checkpoints.restore(like)
    True
    >>> restored["w"].sharding == like["w"].sharding, float(restored["w"][5]), meta
    (True, 5.0, {'seed': 0, 'step': 3})
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int | None = 3,
        every: int = 1,
        async_save: bool = True,
        verify_saves: bool = True,
    ):
        if every < 1 or (keep is not None and keep < 1):
            raise ValueError(
                f"Checkpoints: every={every} and keep={keep} must be at least 1 (keep=None keeps all)."
            )
        self.directory, self.every, self.keep = Path(directory).absolute(), every, keep
        self.verify_saves = verify_saves
        self._unverified: tuple[int, PyTree] | None = None  # the last save, and what to read it into
        self._verified: set[int] = set()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # deleting is ours: only after newer ones verified (_prune)
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # half-written saves of a killed run
        )
        # Handlers named up front, so a new process can read metadata before its first restore.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except OSError as err:
            raise CheckpointSaveError(f"checkpoint directory {self.directory}: {_cause(err)}") from err

    def save(self, step: int, state: PyTree, meta: dict | None = None, *, force: bool = False) -> bool:
        """Starts saving ``state`` (and the JSON-able ``meta``) as checkpoint ``step``.

        Returns whether a save started. The arrays are copied off the devices before it
        returns, so the caller may donate or overwrite ``state`` at once. Raises
        ``CheckpointSaveError`` when this or the previous save failed.
        """
        if step % self.every and not force:
            return False
        _require_arrays(state, step)
        self._settle()
        tree = global_tree(state)
        items = ocp.args.Composite(
            state=ocp.args.StandardSave(tree),
            meta=ocp.args.JsonSave(
                _sealed({**(meta or {}), "step": step, _FINGERPRINTS: fingerprints(tree)})
            ),
        )
        try:
            # force: orbax would also save the first step of a fresh directory; we decide here.
            started = self._manager.save(step, args=items, force=True)
        except Exception as err:  # orbax raises what the filesystem raised, in many types
            raise CheckpointSaveError(f"could not save {self.path(step)}: {_cause(err)}") from err
        if self.verify_saves:
            self._unverified = (step, abstract(state))
        return started

    def check(self) -> None:
        """Raises ``CheckpointSaveError`` if a save running in the background has failed (cheap:
        call it every step to stop within a step of a disk error, not at the next save)."""
        try:
            self._manager.check_for_errors()
        except Exception as err:
            raise CheckpointSaveError(f"could not save in {self.directory}: {_cause(err)}") from err

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def restore(self, like: PyTree, step: int | None = None) -> tuple[PyTree, dict]:
        """Checkpoint ``step`` (default: the newest that verifies) read into the tree and
        shardings of ``like``.

        ``like`` is a state of the model you train now, on the mesh you train on now (concrete
        arrays or ``jax.ShapeDtypeStruct``s with shardings). Returns ``(state, meta)``; ``meta``
        holds ``"step"`` and, when newer checkpoints failed verification, ``"skipped"``:
        ``{step: reason}`` (those were moved to ``corrupt-<step>``). Raises
        ``CheckpointMismatchError`` naming every leaf whose shape or dtype differs,
        ``CheckpointCorruptError`` when the asked-for step (or, without one, every step)
        fails verification.
        """
        self.wait()  # a save of this process still in flight is part of what there is to read
        target = abstract(like)
        if step is not None:
            if step not in self.steps():
                raise FileNotFoundError(
                    f"no complete checkpoint {step} in {self.directory}; "
                    f"the complete ones are {self.steps()}."
                )
            tree, meta = self._read(step, target)
            return into(like, tree), meta
        skipped: dict[int, str] = {}
        for candidate in reversed(self.steps()):
            try:
                tree, meta = self._read(candidate, target)
            except CheckpointCorruptError as err:
                skipped[candidate] = str(err)
                continue
            for bad in skipped:
                skipped[bad] += f"; moved it to {self._quarantine(bad).name}"
            return into(like, tree), {**meta, "skipped": skipped} if skipped else meta
        if skipped:
            raise CheckpointCorruptError(
                f"no checkpoint in {self.directory} verifies:\n  "
                + "\n  ".join(f"{s}: {why}" for s, why in skipped.items())
            )
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}.")

    def meta(self, step: int) -> dict:
        """The meta saved with checkpoint ``step``, checked against its digest, without its
        arrays: what a run that cannot restore them reads to say why (another model, another
        ``--api``)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = _unsealed(dict(restored["meta"]), step)
        meta.pop(_FINGERPRINTS, None)
        return meta

    def _read(self, step: int, target: PyTree) -> tuple[PyTree, dict]:
        """Checkpoint ``step``'s global arrays and meta, verified against its fingerprints."""
        where = str(self.path(step))
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as err:
            raise CheckpointCorruptError(f"its metadata does not read ({_cause(err)})") from err
        if saved is None:
            raise CheckpointCorruptError("its array metadata (state/_METADATA) is missing or unreadable")
        check_saved(saved, target, where)  # another model: the user's mistake, not corruption
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
            )
        except Exception as err:
            raise CheckpointCorruptError(f"its arrays do not read ({_cause(err)})") from err
        meta = _unsealed(dict(restored["meta"]), step)
        recorded = meta.pop(_FINGERPRINTS, None)
        if recorded is None:
            raise CheckpointCorruptError("it records no fingerprints, so its bytes cannot be verified")
        bad = mismatches(recorded, fingerprints(restored["state"]))
        if bad:
            raise CheckpointCorruptError(
                f"{len(bad)} array(s) differ from the fingerprints saved with them: {', '.join(bad[:4])}"
                + (", ..." if len(bad) > 4 else "")
            )
        self._verified.add(step)
        return restored["state"], meta

    def _settle(self) -> None:
        """Waits for the last save, reads it back and verifies it, then deletes old checkpoints."""
        self.wait()
        if self._unverified is not None:
            step, target = self._unverified
            self._unverified = None
            try:
                self._read(step, target)
            except CheckpointCorruptError as err:
                if not self.path(step).is_dir():  # nothing to set aside: someone removed it
                    raise CheckpointSaveError(
                        f"checkpoint {self.path(step)} was written but is gone: {self.directory} was "
                        f"deleted or moved during the run. Point --checkpoint-dir at a directory "
                        f"that stays, then --resume from what is left."
                    ) from err
                moved = self._quarantine(step)
                raise CheckpointSaveError(
                    f"checkpoint {self.path(step)} was written but does not read back: {err}; "
                    f"moved to {moved}."
                ) from err
        self._prune()

    def _prune(self) -> None:
        """Deletes the checkpoints older than the ``keep`` newest verified ones. A checkpoint
        older than one verified here was verified by the run that wrote it (each run reads its
        saves back before its next), so those a resumed run finds count: ``--keep`` holds across
        a resume, not only over this run's saves."""
        newest = max(self._verified, default=None)
        verified = [s for s in self.steps() if newest is not None and s <= newest]
        if self.keep is None or len(verified) <= self.keep:
            return
        oldest_kept = verified[-self.keep]
        for step in self.steps():
            if step < oldest_kept:
                self._manager.delete(step)

    def set_aside(self, step: int, label: str) -> Path:
        """Moves checkpoint ``step`` to ``<label>-<step>`` in the directory: out of the step list
        (so the step can be saved again), but nothing deleted. Returns the new path."""
        _sync(f"fsdp_tp set aside {step}")  # every process names the same destination
        moved, suffix = self.directory / f"{label}-{step}", 0
        while moved.exists():
            suffix += 1
            moved = self.directory / f"{label}-{step}.{suffix}"
        if jax.process_index() == 0:
            self.path(step).rename(moved)
        _sync(f"fsdp_tp set aside {step} done")
        self._manager.reload()
        self._verified.discard(step)
        return moved

    def _quarantine(self, step: int) -> Path:
        return self.set_aside(step, "corrupt")

    def wait(self) -> None:
        """Blocks until every started save is complete on disk; raises ``CheckpointSaveError``
        if one failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise CheckpointSaveError(f"could not save in {self.directory}: {_cause(err)}") from err

    def close(self) -> None:
        """Waits for the saves in flight and verifies the last one (see ``verify_saves``)."""
        try:
            self._settle()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: do not verify; the save that failed may fail closing again
            try:
                self._manager.close()
            except Exception:  # the error in flight is the one to report
                pass

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

from pathlib import Path

from .._types import PyTree
from ..errors import CheckpointCorruptError, CheckpointSaveError
from ._files import (
    cause,
    moved_aside,
    open_manager,
    prunable,
    read_meta,
    read_verified,
    require_arrays,
    save_args,
)
from ._state_tree import abstract, global_tree, into

__all__ = ["Checkpoints", "global_tree"]


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
        try:
            self._manager = open_manager(self.directory, async_save)
        except OSError as err:
            raise CheckpointSaveError(f"checkpoint directory {self.directory}: {cause(err)}") from err

    def save(self, step: int, state: PyTree, meta: dict | None = None, *, force: bool = False) -> bool:
        """Starts saving ``state`` (and the JSON-able ``meta``) as checkpoint ``step``.

        Returns whether a save started. The arrays are copied off the devices before it
        returns, so the caller may donate or overwrite ``state`` at once. Raises
        ``CheckpointSaveError`` when this or the previous save failed.
        """
        if step % self.every and not force:
            return False
        require_arrays(state, step)
        self._settle()
        try:
            # force: orbax would also save the first step of a fresh directory; we decide here.
            started = self._manager.save(step, args=save_args(global_tree(state), meta, step), force=True)
        except Exception as err:  # orbax raises what the filesystem raised, in many types
            raise CheckpointSaveError(f"could not save {self.path(step)}: {cause(err)}") from err
        if self.verify_saves:
            self._unverified = (step, abstract(state))
        return started

    def check(self) -> None:
        """Raises ``CheckpointSaveError`` if a save running in the background has failed (cheap:
        call it every step to stop within a step of a disk error, not at the next save)."""
        try:
            self._manager.check_for_errors()
        except Exception as err:
            raise CheckpointSaveError(f"could not save in {self.directory}: {cause(err)}") from err

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
                skipped[bad] += f"; moved it to {self.set_aside(bad, 'corrupt').name}"
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
        return read_meta(self._manager, step)

    def _read(self, step: int, target: PyTree) -> tuple[PyTree, dict]:
        """Checkpoint ``step``'s global arrays and meta, verified against its fingerprints."""
        state, meta = read_verified(self._manager, step, target, str(self.path(step)))
        self._verified.add(step)
        return state, meta

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
                moved = self.set_aside(step, "corrupt")
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
        for step in prunable(self.steps(), self._verified, self.keep):
            self._manager.delete(step)

    def set_aside(self, step: int, label: str) -> Path:
        """Moves checkpoint ``step`` to ``<label>-<step>`` in the directory: out of the step list
        (so the step can be saved again), but nothing deleted. Returns the new path."""
        moved = moved_aside(self.path(step), f"{label}-{step}")
        self._manager.reload()
        self._verified.discard(step)
        return moved

    def wait(self) -> None:
        """Blocks until every started save is complete on disk; raises ``CheckpointSaveError``
        if one failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise CheckpointSaveError(f"could not save in {self.directory}: {cause(err)}") from err

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

"""The checkpoint directory of one run: what it already holds, and a lock while a run uses it.

Two runs writing the same directory would each rotate the other's checkpoints away and die
at the first step number they share; a run started without ``--resume`` on a directory of
checkpoints would do the same to the previous run's. Both are refused before anything starts.

>>> import tempfile
>>> directory = tempfile.mkdtemp()
>>> with locked(directory):
...     with locked(directory):
...         pass
Traceback (most recent call last):
...
fsdp_tp.cli.checks.UsageError: --checkpoint-dir ...: in use by another run (process ...); wait ...
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .checks import UsageError

__all__ = ["LOCK", "check_contents", "clear", "locked", "saved_steps"]

LOCK = ".fsdp-tp.lock"


def saved_steps(directory: str | Path) -> list[int]:
    """The step numbers of the checkpoints in ``directory`` (orbax names them by step)."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit())


def check_contents(directory: str, resume: bool, overwrite: bool, resume_from: int | None = None) -> None:
    """Refuses a directory of checkpoints unless the run resumes from them or overwrites them,
    and ``--resume-from`` a step the directory does not hold (it would have trained from
    scratch, or ended in a traceback)."""
    steps = saved_steps(directory)
    if resume_from is not None and resume_from not in steps:
        held = f"its checkpoints are steps {', '.join(map(str, steps))}" if steps else "it holds none"
        raise UsageError(
            f"--resume-from {resume_from}: --checkpoint-dir {directory} has no checkpoint {resume_from} "
            f"({held}); pass one of them, --resume for the newest, or drop --resume-from to start over."
        )
    if steps and not (resume or overwrite):
        shown = ", ".join(map(str, steps[-5:]))
        raise UsageError(
            f"--checkpoint-dir {directory} already holds checkpoints (steps {shown}); pass --resume "
            f"to continue the newest, --overwrite to delete them and start over, or another directory."
        )


def clear(directory: str | Path) -> list[int]:
    """``--overwrite``: deletes the checkpoints (and half-written saves) in ``directory``."""
    path, steps = Path(directory), saved_steps(directory)
    for p in list(path.iterdir()) if path.is_dir() else []:
        if p.is_dir() and (p.name.isdigit() or ".orbax-checkpoint-tmp" in p.name):
            shutil.rmtree(p)
    return steps


@contextmanager
def locked(directory: str | Path) -> Iterator[None]:
    """Holds an exclusive lock on ``directory`` (created if missing) for the ``with`` block.

    ``flock`` locks are released by the kernel when the process ends, however it ends, so a
    killed run never leaves the directory locked.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise UsageError(
                f"--checkpoint-dir {directory}: in use by another run (process {holder}); "
                f"wait for it to finish or pass another directory."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock

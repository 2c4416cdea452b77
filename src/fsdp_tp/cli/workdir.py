"""The paths a run writes, checked before anything starts: the log file and the checkpoint
directory writable (:func:`check_paths`), what the directory already holds, and a lock while a
run uses it.

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

import argparse
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .checks import UsageError

__all__ = [
    "LOCK",
    "add_checkpoint_flags",
    "check_contents",
    "check_paths",
    "clear",
    "locked",
    "resuming",
    "saved_steps",
    "writable_directory",
    "writable_file",
]

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


def resuming(args) -> bool:
    """Whether the run continues from a checkpoint (``--resume`` or ``--resume-from``)."""
    return bool(args.resume or args.resume_from is not None)


def check_paths(args) -> None:
    """The log file and checkpoint directory can be written; resume flags make sense."""
    if getattr(args, "log_file", None):
        writable_file(args.log_file, "--log-file")
    directory = getattr(args, "checkpoint_dir", None)
    if not directory:
        if resuming(args):
            raise UsageError("--resume needs --checkpoint-dir DIR: the directory to resume from.")
        return
    if resuming(args) and args.overwrite:
        raise UsageError(
            "--resume and --overwrite contradict each other: "
            "resume keeps the checkpoints, overwrite deletes them."
        )
    writable_directory(directory, "--checkpoint-dir")


def _probe_directory(directory: Path, flag: str) -> None:
    """Raises unless a file can be created in ``directory`` (root ignores permission bits, so
    asking ``os.access`` is not enough: a read-only mount or a full disk answers only to a write)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise UsageError(
            f"{flag} {directory}: cannot write there ({err.strerror}); pass a writable path."
        ) from err


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_file(path: str, flag: str) -> None:
    """Raises unless ``path`` can be appended to (creating it), without creating it."""
    file = Path(path).absolute()
    if file.is_dir():
        raise UsageError(f"{flag} {path} is a directory; pass a file path.")
    if file.exists():
        if not os.access(file, os.W_OK):
            raise UsageError(f"{flag} {path}: the file is not writable; pass a writable path.")
        return
    if not file.parent.is_dir():
        raise UsageError(
            f"{flag} {path}: directory {file.parent} does not exist; create it or pass another path."
        )
    _probe_directory(file.parent, flag)


def writable_directory(directory: str, flag: str) -> None:
    """Raises unless ``directory`` is, or can be made, a directory files can be written in."""
    path = Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {directory} is a file; pass a directory.")
    ancestor = _existing_ancestor(path)
    try:
        _probe_directory(ancestor, flag)
    except UsageError as err:
        where = "" if ancestor == path else f" (it would be made in {ancestor}, where nothing can be)"
        raise UsageError(f"{flag} {directory}: cannot write there{where}; pass a writable path.") from err


def add_checkpoint_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags for its checkpoint directory: where, how often, how many, and resuming."""
    ckpt = train.add_argument_group("checkpoints (orbax: async, atomic, verified)")
    ckpt.add_argument("--checkpoint-dir", help="save sharded checkpoints here")
    ckpt.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    ckpt.add_argument("--keep", type=int, default=3, help="how many verified checkpoints to keep")
    ckpt.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint that verifies"
    )
    ckpt.add_argument("--resume-from", type=int, metavar="STEP", help="continue from this checkpoint")
    ckpt.add_argument(
        "--overwrite", action="store_true", help="delete the directory's checkpoints and start over"
    )
    ckpt.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume although the data, vocabulary, schedule or optimizer differ from the checkpoint's",
    )

"""What ``fsdp-tp train`` prints and logs: progress lines, and JSON lines with a run header.

Steps are counted from 1 everywhere (console and log): step ``n`` is the ``n``-th update, and
checkpoint ``n`` holds the state after it. Every log record carries a Unix timestamp; each
run (a resume included) starts with a header record, so appended runs stay apart.

>>> import argparse
>>> model_name(argparse.Namespace(preset="tiny", d_model=128, num_layers=None, num_heads=None,
...                               num_kv_heads=None, mlp_hidden=None, seq_len=None))
'tiny with d_model=128'
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from importlib import metadata
from typing import TextIO

import jax

from ..recipe.throughput import Achieved, memory_in_use
from ..recipe.trainer import Settings

__all__ = ["LogWriteError", "Output", "duration", "library_logs", "model_name", "run_header", "what_achieved"]

_SIZES = ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "seq_len")


def model_name(args) -> str:
    """The preset's name and the sizes a flag replaced: what the summary calls the model."""
    changed = [f"{k}={getattr(args, k)}" for k in _SIZES if getattr(args, k, None) is not None]
    return f"{args.preset} with {', '.join(changed)}" if changed else args.preset


def _versions() -> dict:
    names = ("fsdp-tp", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return {"python": sys.version.split()[0], **found}


def run_header(settings, args, start: int) -> dict:
    """The first record of a run's log: what ran, where, on what, from which step."""
    return {
        "event": "start",
        "resumed_from": start or None,
        "argv": sys.argv[1:],
        "settings": json.loads(json.dumps(asdict(settings), default=str)),
        "mesh": args.mesh,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "processes": jax.process_count(),
        "versions": _versions(),
    }


class LogWriteError(RuntimeError):
    """The log file stopped taking lines (a full disk, /dev/full)."""


@contextmanager
def library_logs(verbose: bool) -> Iterator[None]:
    """orbax logs through absl, whose records reach the terminal through Python's logging
    (a failed save printed 200 lines of ``ERROR:absl`` tracebacks before the run's one line).
    Within it they are kept off the terminal, unless ``verbose`` (``--verbose``) asks for them,
    and so are the echoes of a failed save's abandoned writes (``_quiet_abandoned_writes``)."""
    logger = logging.getLogger("absl")
    kept = logger.propagate, list(logger.handlers)
    if not verbose:
        logger.propagate, logger.handlers = False, [logging.NullHandler()]
        _quiet_abandoned_writes()
    try:
        yield
    finally:
        logger.propagate, logger.handlers = kept


def _not_an_abandoned_task(record: logging.LogRecord) -> bool:
    """Keeps every record but asyncio's "Task (or _GatheringFuture) exception was never
    retrieved" for an orbax write (its coroutine's file, or the error's frames, in orbax)."""
    text = record.getMessage()
    if "exception was never retrieved" not in text.partition("\n")[0]:
        return True
    frame = record.exc_info[2] if record.exc_info else None
    files = []
    while frame is not None:
        files.append(frame.tb_frame.f_code.co_filename)
        frame = frame.tb_next
    return not any("orbax" in where for where in (text, *files))


def _loop_closed(unraisable) -> bool:
    frame = unraisable.exc_traceback
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
        and frame is not None
        and frame.tb_frame.f_code.co_name == "_check_closed"
    )


def _quiet_abandoned_writes() -> None:
    """When one write of a save fails, orbax's ``asyncio.gather`` raises and its event loop
    closes while tensorstore still finishes the other writes: each then prints a traceback,
    ``RuntimeError: Event loop is closed`` from a tensorstore thread (through
    ``sys.unraisablehook``) or asyncio's "Task exception was never retrieved" (a full disk
    printed 210 such lines around the run's one line). The run has already reported the save's
    failure, so exactly these are dropped; any other unraisable error is still printed. It
    stays for the process: the writes end after the run has returned."""
    asyncio_logger = logging.getLogger("asyncio")
    if _not_an_abandoned_task not in asyncio_logger.filters:
        asyncio_logger.addFilter(_not_an_abandoned_task)
    hook = sys.unraisablehook
    if getattr(hook, "drops_closed_loops", False):
        return

    def drop_closed_loops(unraisable) -> None:
        if not _loop_closed(unraisable):
            hook(unraisable)

    drop_closed_loops.drops_closed_loops = True  # type: ignore[attr-defined]
    sys.unraisablehook = drop_closed_loops


def duration(seconds: float) -> str:
    """A time to wait, in the unit a reader wants.

    >>> duration(42.4), duration(1500), duration(7 * 3600), duration(3e7)
    ('42s', '25min', '7.0h', '347 days')
    """
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f}min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:,.0f} days"


class Output:
    """Progress and logs, written by process 0 only (every process trains; one speaks)."""

    def __init__(self, out: TextIO, log_file: str | None):
        self.primary = jax.process_index() == 0
        self.out = out
        self.log = open(log_file, "a") if log_file and self.primary else None
        self.log_file = log_file

    def say(self, text: str) -> None:
        if self.primary:
            print(text, file=self.out, flush=True)

    def record(self, **fields) -> None:
        """One JSON line in the log file, written through (a full disk fails this record, not
        the end of the run)."""
        if not self.log:
            return
        try:
            self.log.write(json.dumps({"time": round(time.time(), 3), **fields}) + "\n")
            self.log.flush()
        except OSError as err:
            log, self.log = self.log, None
            try:
                log.close()
            except OSError:
                pass  # what it could not write, it cannot flush on closing either
            where = f" at step {fields['step']}" if "step" in fields else ""
            raise LogWriteError(
                f"could not write --log-file {self.log_file}{where} ({err.strerror or err}); the run "
                f"stopped. Free space or pass another --log-file, then --resume."
            ) from err

    def progress(
        self,
        step: int,
        steps: int,
        loss: float,
        seconds: float,
        timed: float,
        counted: int,
        tokens_per_step: int,
        extra: str = "",
        compiled_before: bool = False,
    ) -> None:
        """The progress line after 0-based ``step``; the first step shows its compile time instead
        of a rate (it has none yet), or says it was compiled before (``--check`` ran the step).
        ``extra``: what else the step achieved (TFLOP/s, memory)."""
        bar = "#" * (20 * (step + 1) // steps)
        head = f"[{bar:<20}] step {step + 1}/{steps} loss {loss:.4f}"
        if not counted:
            done = "ran in {:.1f}s, compiled by --check" if compiled_before else "compiled and ran in {:.1f}s"
            self.say(f"{head} ({done.format(seconds)})")
            return
        rate, eta = tokens_per_step * counted / timed, (steps - step - 1) * timed / counted
        self.say(f"{head} {rate:,.0f} tokens/s{f', {extra}' if extra else ''} eta {duration(eta)}")

    def close(self) -> None:
        if self.log:
            self.log.close()


def what_achieved(settings: Settings, rate: float | None, peak: float | None) -> tuple[dict, str]:
    """The log fields and the progress text of what the steps so far achieved."""
    fields: dict = {}
    texts = []
    if rate:
        achieved = Achieved.of(settings.model.flops_per_token(), rate, jax.device_count(), peak)
        fields.update(achieved.fields())
        texts.append(achieved.text())
    if (memory := memory_in_use()) is not None:
        fields.update(bytes_in_use=memory[0], peak_bytes_in_use=memory[1])
        texts.append(f"{memory[0] / 2**30:.2f} GiB in use (peak {memory[1] / 2**30:.2f})")
    return fields, ", ".join(texts)

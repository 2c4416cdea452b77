"""SIGINT and SIGTERM end a run between two steps with one line: the step it reached and the
checkpoint that ``--resume`` continues from (not a ``KeyboardInterrupt`` traceback, or nothing).

The handler only takes note; the train loop asks after each step (:meth:`Stopping.check`).
An exception raised from the handler itself could land anywhere, in a garbage-collection
callback among others, where Python prints and drops it, and the run would go on. A second
signal stops at once; the same signal again within a second is the first one's copy (a
scheduler signals every process of a job, and a supervised child's parent passes its own on).

>>> import os, signal
>>> with stop_on_signals() as stopping:
...     os.kill(os.getpid(), signal.SIGTERM)
...     try:
...         stopping.check()
...     except Stopped as stop:
...         print(stop.signal, stop.exit_code)
SIGTERM 143
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from jax.errors import JaxRuntimeError

__all__ = ["AgreedStopping", "Stopped", "Stopping", "stop_on_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
COPY_WITHIN = 1.0  # s


class Stopped(Exception):
    """The run was asked to stop by ``signal`` (``"SIGINT"`` or ``"SIGTERM"``), sent to this
    process or (``origin``) to another process of the run."""

    def __init__(self, name: str, origin: int | None = None):
        super().__init__(name)
        self.signal, self.origin = name, origin

    @property
    def cause(self) -> str:
        """``SIGTERM``, or ``SIGTERM (sent to process 1)``."""
        return self.signal if self.origin is None else f"{self.signal} (sent to process {self.origin})"

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number (130, 143)."""
        return 128 + int(signal.Signals[self.signal])


class Stopping:
    """The signal received, if any; :meth:`check` raises :class:`Stopped` once one was."""

    def __init__(self):
        self.received: str | None = None
        self.at = 0.0

    def note(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if name == self.received and time.monotonic() - self.at < COPY_WITHIN:
                return  # the same request, delivered twice
            raise Stopped(self.received)  # asked twice: stop now
        self.received, self.at = name, time.monotonic()

    def check(self, completed: int = 0) -> None:
        """Raises :class:`Stopped` if a signal came; ``completed``: the steps done (unused here)."""
        if self.received is not None:
            raise Stopped(self.received)


class AgreedStopping:
    """Every process of a run stops after the same step, whichever process the signal reached.

    A process that stopped alone would leave the others waiting in the next step's collectives
    for ever (seen: SIGTERM to process 0 of 2 hung both). The first process asked writes
    ``step signal process`` to the coordination service, naming the next step;
    every process reads that key after each step. The host blocks on each step's loss, and no
    process can finish a step another has not started, so no process is past that step when
    the key is written: all stop after it, their checkpoints one consistent step. The
    key-value store writes once (a second writer gets ``ALREADY_EXISTS`` and reads the first's).
    """

    KEY = "fsdp_tp/stop"

    def __init__(self, local: Stopping, client, process: int):
        self.local, self.client, self.process = local, client, process
        self.agreed: tuple[int, str, int] | None = None

    def _read(self) -> tuple[int, str, int] | None:
        try:
            step, name, origin = self.client.key_value_try_get(self.KEY).split()
        except JaxRuntimeError as err:
            if "NOT_FOUND" in str(err):  # nobody was asked
                return None
            raise
        return int(step), name, int(origin)

    def check(self, completed: int) -> None:
        if self.agreed is None:
            self.agreed = self._read()
        if self.agreed is None and self.local.received is not None:
            try:
                self.client.key_value_set(self.KEY, f"{completed + 1} {self.local.received} {self.process}")
            except JaxRuntimeError as err:
                if "ALREADY_EXISTS" not in str(err):  # else another process was asked first
                    raise
            self.agreed = self._read()
        if self.agreed is not None and completed >= self.agreed[0]:
            _, name, origin = self.agreed
            raise Stopped(name, None if origin == self.process else origin)


@contextmanager
def stop_on_signals(client=None, process: int = 0) -> Iterator[Stopping | AgreedStopping]:
    """Within it, SIGINT and SIGTERM are noted for :meth:`Stopping.check`; the previous
    handlers come back after. Only the main thread can take signals: elsewhere nothing is
    installed and ``check`` never raises. With the coordination service's ``client`` (a
    multi-process run), every process stops after the same step (:class:`AgreedStopping`)."""
    stopping = Stopping()
    checked = stopping if client is None else AgreedStopping(stopping, client, process)
    if threading.current_thread() is not threading.main_thread():
        yield checked
        return
    previous = {s: signal.signal(s, stopping.note) for s in _SIGNALS}
    try:
        yield checked
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

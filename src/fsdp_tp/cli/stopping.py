"""SIGINT and SIGTERM end a run between two steps with one line: the step it reached and the
checkpoint that ``--resume`` continues from (not a ``KeyboardInterrupt`` traceback, or nothing).

The handler only takes note; the train loop asks after each step (:meth:`Stopping.check`).
An exception raised from the handler itself could land anywhere, in a garbage-collection
callback among others, where Python prints and drops it, and the run would go on. A second
signal stops at once.

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
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Stopped", "Stopping", "stop_on_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run was asked to stop by ``signal`` (``"SIGINT"`` or ``"SIGTERM"``)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.signal = name

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal's number (130, 143)."""
        return 128 + int(signal.Signals[self.signal])


class Stopping:
    """The signal received, if any; :meth:`check` raises :class:`Stopped` once one was."""

    def __init__(self):
        self.received: str | None = None

    def note(self, signum, _frame) -> None:
        if self.received is not None:  # asked twice: stop now
            raise Stopped(self.received)
        self.received = signal.Signals(signum).name

    def check(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)


@contextmanager
def stop_on_signals() -> Iterator[Stopping]:
    """Within it, SIGINT and SIGTERM are noted for :meth:`Stopping.check`; the previous
    handlers come back after. Only the main thread can take signals: elsewhere nothing is
    installed and ``check`` never raises."""
    stopping = Stopping()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return
    previous = {s: signal.signal(s, stopping.note) for s in _SIGNALS}
    try:
        yield stopping
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

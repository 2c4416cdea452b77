"""Keeping gloo's connection lines out of the CLI's output.

jaxlib's gloo collectives (CPU devices across processes) print ``[Gloo] Rank 0 is connected to
1 peer ranks. Expected number of connected peer ranks is : 1`` from C++ straight to file
descriptor 1, once per communicator and device: 15 lines per process for one ``fsdp-tp
train``, between the run's own lines, with no switch to turn them off. The devices' threads
print at once, piece by piece, so their pieces interleave: a line may start with any piece
(``Expected number ...``, a rank). Python's ``sys.stdout`` cannot see them, so the filter
sits below it: fd 1 becomes a pipe, and a thread copies what arrives to the real stdout,
leaving out every line made only of those pieces. Everything else written to stdout
(Python's and C's) goes through unchanged and in order; a partial line (a progress bar's)
is passed on at once unless it may still turn out to be gloo's.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

__all__ = ["GLOO_PIECES", "LineFilter", "drop_stdout_lines", "restore_stdout"]

# What gloo's connection message is printed in (std::cout << piece << rank << ...).
GLOO_PIECES = (
    b"[Gloo] Rank ",
    b" is connected to ",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
)


class LineFilter:
    """A byte stream with every whole line made only of ``pieces`` and numbers left out; the
    data may arrive cut anywhere.

    >>> f = LineFilter(GLOO_PIECES)
    >>> f.feed(b"step 1\\n[Gloo] Rank 0 is connected to 1 peer ranks. [Gloo] Rank 1 is connected ")
    b'step 1\\n'
    >>> f.feed(b"to 1 peer ranks. Expected number of connected peer ranks is : 1\\nExpected") + f.feed(
    ...     b" number of connected peer ranks is : 1\\nstep 2: loss 6.1")
    b'step 2: loss 6.1'
    """

    def __init__(self, pieces: tuple[bytes, ...]):
        self._pieces = pieces
        self._start = re.compile(b"|".join([re.escape(p) for p in pieces] + [rb"\d+"]))
        self._held = b""  # the start of a line that may still be one to drop
        self._at_line_start = True

    def _leftover(self, line: bytes) -> bytes:
        """``line`` after the pieces and numbers it starts with."""
        while line and (match := self._start.match(line)):
            line = line[match.end() :]
        return line

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (after anything held back) can be passed on now."""
        data, self._held = self._held + data, b""
        out = []
        while data:
            end = data.find(b"\n")
            line = data if end < 0 else data[:end]
            if self._at_line_start and line:
                rest = self._leftover(line)
                if end < 0 and any(p.startswith(rest) for p in self._pieces):
                    self._held = data  # gloo's so far: wait for the line's end
                    break
                if end >= 0 and not rest:
                    data = data[end + 1 :]
                    continue
            if end < 0:
                out.append(data)
                self._at_line_start = False
                break
            out.append(data[: end + 1])
            data = data[end + 1 :]
            self._at_line_start = True
        return b"".join(out)


class _Pump:
    def __init__(self, pieces: tuple[bytes, ...]):
        sys.stdout.flush()
        self.real = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self.thread = threading.Thread(target=self._copy, args=(read, LineFilter(pieces)), daemon=True)
        self.thread.start()

    def _copy(self, read: int, line_filter: LineFilter) -> None:
        while chunk := os.read(read, 1 << 16):
            passed = line_filter.feed(chunk)
            if passed:
                os.write(self.real, passed)
        os.close(read)

    def close(self) -> None:
        os.dup2(self.real, 1)  # closes the pipe's last write end: the copying thread sees its end
        self.thread.join(timeout=10)


_active: _Pump | None = None


def drop_stdout_lines(pieces: tuple[bytes, ...] = GLOO_PIECES) -> None:
    """From now on, lines this process writes to fd 1 made only of ``pieces`` (and numbers) are
    left out, until :func:`restore_stdout` (which also runs at exit). A second call changes
    nothing."""
    global _active
    if _active is None:
        _active = _Pump(pieces)
        atexit.register(restore_stdout)


def restore_stdout() -> None:
    """Flushes ``sys.stdout``; fd 1 is the real stdout again, after everything written before
    is passed on. Call it before ``os._exit``, which skips the exit handlers and flushes nothing."""
    global _active
    sys.stdout.flush()
    if _active is not None:
        _active.close()
        _active = None

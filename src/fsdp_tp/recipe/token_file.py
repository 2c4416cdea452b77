"""A token file read by ``os.pread``, never memory-mapped.

A memory map of a file that is truncated while a run reads it kills the process with SIGBUS
at the next read of a lost page, and Python cannot catch that. Checking the file's size before
each batch narrows the window but cannot close it (the truncation can land between the check
and the read: CI saw exactly that). ``pread`` on a truncated file returns fewer bytes instead,
which is an error this module can name. The descriptor stays open, so a file renamed over or
deleted keeps reading the data the run started with, as a map would.

Example:

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "t.bin")
>>> np.arange(10, dtype=np.uint16).tofile(path)
>>> tokens = TokenFile.open(path, np.uint16)
>>> len(tokens), tokens[3:6].tolist(), tokens.part(8, 10)[0:2].tolist(), tokens.bounds()
(10, [3, 4, 5], [8, 9], (0, 9))
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["DataChangedError", "DataError", "TokenFile"]

_CHUNK = 1 << 24  # tokens per read when scanning the whole file (64 MiB of int32 at most)


class DataError(ValueError):
    """A data file that is missing, empty, or too short for one batch."""


class DataChangedError(DataError):
    """The data file was truncated or rewritten in place while a run read it."""


class _Descriptor:
    """An open file shared by a file's views, closed when the last view is gone."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        os.close(self.fd)


@dataclass(frozen=True)
class TokenFile:
    """Tokens ``start .. start + length`` of a flat array at byte ``offset`` of ``path``.

    Indexing with a slice reads those tokens (a numpy array); ``part`` is a view without a
    read. A read that comes back short, or a file whose size or mtime changed in place, raises
    ``DataChangedError`` naming the file and both sizes."""

    path: str
    file: _Descriptor
    dtype: np.dtype
    offset: int  # bytes before the first token (a .npy header)
    start: int
    length: int
    stamp: tuple[int, int, int]  # (inode, size, mtime) when opened

    @classmethod
    def open(cls, path: str, dtype, offset: int = 0) -> TokenFile:
        """The tokens of ``path`` after ``offset`` header bytes, as ``dtype``."""
        file = _Descriptor(path)
        st = os.fstat(file.fd)
        dtype = np.dtype(dtype)
        return cls(path, file, dtype, offset, 0, (st.st_size - offset) // dtype.itemsize, _stamp(st))

    def __len__(self) -> int:
        return self.length

    def part(self, start: int, stop: int) -> TokenFile:
        """Tokens ``start .. stop`` of this view, read later."""
        start, stop, _ = slice(start, stop).indices(self.length)
        return TokenFile(
            self.path,
            self.file,
            self.dtype,
            self.offset,
            self.start + start,
            max(0, stop - start),
            self.stamp,
        )

    def __getitem__(self, where: slice) -> np.ndarray:
        if not isinstance(where, slice):
            raise TypeError(f"TokenFile reads slices, got {where!r}")
        start, stop, step = where.indices(self.length)
        if step == 1:
            return self._read(start, max(0, stop - start))
        strided = [self._read(i, 1) for i in range(start, stop, step)]  # (a sample: one read a token)
        return np.concatenate(strided) if strided else np.empty(0, self.dtype)

    def bounds(self) -> tuple[int, int]:
        """The smallest and largest token, read in chunks (one pass over a file of any size)."""
        low, top = None, None
        for at in range(0, self.length, _CHUNK):
            chunk = self._read(at, min(_CHUNK, self.length - at))
            low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
            top = int(chunk.max()) if top is None else max(top, int(chunk.max()))
        if low is None or top is None:
            raise DataError(f"--data {self.path}: holds no tokens (an empty array).")
        return low, top

    def _read(self, at: int, count: int) -> np.ndarray:
        self._check_unchanged()
        size = count * self.dtype.itemsize
        data = os.pread(self.file.fd, size, self.offset + (self.start + at) * self.dtype.itemsize)
        if len(data) != size:
            self._changed(os.fstat(self.file.fd).st_size)
        return np.frombuffer(data, dtype=self.dtype)

    def _check_unchanged(self) -> None:
        """A file changed in place (same inode, another size or mtime) is refused even where
        the bytes a read asks for are still there: they may be other tokens now."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return  # deleted: the open descriptor still reads the data the run started with
        if st.st_ino == self.stamp[0] and _stamp(st) != self.stamp:
            self._changed(st.st_size)

    def _changed(self, size_now: int) -> None:
        raise DataChangedError(
            f"--data {self.path} was changed while the run read it ({self.stamp[1]:,} bytes when "
            f"opened, {size_now:,} now); give a run a file nobody writes: write new data to another file."
        )


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns

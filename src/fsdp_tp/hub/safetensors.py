"""The safetensors format, read as untrusted input: a header checked whole before it steers any
read, then only the bytes of the block asked for.

A file is 8 bytes (a little-endian u64 ``n``), ``n`` bytes of JSON, then the data. The JSON maps
each tensor's name to its ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` (counted from
the data's start), plus an optional ``__metadata__`` of strings. A downloaded file is untrusted:
:func:`read_header` refuses a header longer than the file, offsets past the data's end or
overlapping another tensor's, a byte count that is not the shape's, an unknown dtype and a name
given twice — each with :class:`~fsdp_tp.errors.CheckpointCorruptError`, naming the file and the
tensor. Nothing is ever unpickled: the format holds no code.

:func:`read_block` reads one block of a tensor (a box of index ranges) with as few ``pread``
calls as the layout allows: a run of whole trailing dims is one contiguous range, and ranges
closer than ``coalesce`` bytes are read as one (the over-read is at most the gaps).

>>> import os, tempfile, numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
>>> write(path, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
>>> entry = read_header(path)["w"]
>>> entry.dtype, entry.shape
('F32', (3, 4))
>>> block, nbytes = read_block(path, entry, ((1, 3), (2, 4)))
>>> block.tolist(), nbytes  # two rows' last two columns: one read, the 8-byte gap between them too
([[6.0, 7.0], [10.0, 11.0]], 24)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import struct
import tempfile
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from ..errors import CheckpointCorruptError

__all__ = ["COALESCE", "DTYPES", "Entry", "read_block", "read_header", "reads", "spans", "write"]

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The reference implementation's own bound: a header is metadata, never gigabytes.
_MAX_HEADER = 100 << 20
# Ranges closer than this are read as one: a block of a row-major matrix split on its columns is
# one range a row; coalescing trades at most these bytes a gap for one syscall fewer.
COALESCE = 4096

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a file: its safetensors ``dtype`` name, ``shape``, and ``begin``/``end``
    byte offsets in the file (absolute: the header's offsets plus the data's start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | os.PathLike) -> dict[str, Entry]:
    """The tensors of the safetensors file at ``path``, every field checked against the file's
    size before anything else of it is read (see the module's docstring)."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"is {size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > _MAX_HEADER:
            raise _corrupt(
                path,
                f"gives a header of {length} bytes, but the file has {size - 8} after the length"
                + ("" if length <= _MAX_HEADER else f" and a header is at most {_MAX_HEADER}"),
            )
        raw = file.read(length)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError) as err:
        raise _corrupt(path, f"has a header that is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"has a header that is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "has a __metadata__ that is not an object of strings")
    start, data = 8 + length, size - 8 - length
    entries = {name: _entry(path, name, fields, start, data) for name, fields in header.items()}
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _corrupt(path, f"gives tensors {first!r} and {second!r} overlapping bytes")
    return entries


def _no_repeats(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"names given twice: {repeated}")
    return dict(pairs)


def _entry(path, name: str, fields, start: int, data: int) -> Entry:
    def bad(why: str) -> CheckpointCorruptError:
        return _corrupt(path, f"tensor {name!r}: {why}")

    if not isinstance(fields, dict) or set(fields) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"expected the fields dtype, shape and data_offsets, got {fields!r}"[:300])
    dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} is none of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if not begin <= end <= data:
        raise bad(f"data_offsets [{begin}, {end}] do not lie within the file's {data} bytes of data")
    wanted = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != wanted:
        raise bad(f"holds {end - begin} bytes, but {dtype} of shape {tuple(shape)} takes {wanted}")
    return Entry(name, dtype, tuple(shape), start + begin, start + end)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _corrupt(path, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{os.fspath(path)} {why}: the file is damaged or not safetensors; download it again "
        "(nothing of it was read into the model)."
    )


def spans(entry: Entry, box: Box) -> list[tuple[int, int]]:
    """The byte ranges ``(offset, length)`` that hold ``box`` of ``entry``, in file order and in
    the box's row-major order: a run of whole trailing dims is one range.

    >>> e = Entry("w", "F32", (3, 4), 8, 56)
    >>> spans(e, ((0, 3), (0, 4))), spans(e, ((1, 3), (1, 3)))
    ([(8, 48)], [(28, 8), (44, 8)])
    """
    shape, itemsize = entry.shape, entry.np_dtype.itemsize
    if any(lo >= hi for lo, hi in box):
        return []
    whole = len(shape)  # dims whole..end are taken whole: they fold into one range
    while whole > 0 and box[whole - 1] == (0, shape[whole - 1]):
        whole -= 1
    if whole == 0:
        return [(entry.begin, entry.end - entry.begin)]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    lo, hi = box[whole - 1]
    length = (hi - lo) * strides[whole - 1] * itemsize
    return [
        (
            entry.begin
            + (sum(i * s for i, s in zip(outer, strides, strict=False)) + lo * strides[whole - 1]) * itemsize,
            length,
        )
        for outer in itertools.product(*(range(a, b) for a, b in box[: whole - 1]))
    ]


def reads(ranges: list[tuple[int, int]], coalesce: int = COALESCE) -> list[tuple[int, int, list]]:
    """``ranges`` grouped into reads ``(offset, length, ranges)``: a range starting at most
    ``coalesce`` bytes after the previous one ends joins its read.

    >>> reads([(0, 8), (12, 8), (100, 8)], coalesce=4)
    [(0, 20, [(0, 8), (12, 8)]), (100, 8, [(100, 8)])]
    """
    grouped: list[tuple[int, int, list]] = []
    for offset, length in ranges:
        if grouped and offset - (grouped[-1][0] + grouped[-1][1]) <= coalesce:
            first, _, members = grouped[-1]
            grouped[-1] = (first, offset + length - first, [*members, (offset, length)])
        else:
            grouped.append((offset, length, [(offset, length)]))
    return grouped


def read_block(
    path: str | os.PathLike, entry: Entry, box: Box, coalesce: int = COALESCE
) -> tuple[np.ndarray, int]:
    """``box`` (a ``(start, stop)`` a dim) of ``entry``, in its own dtype, and the bytes read.
    A range read alone goes straight into the block; memory beyond the block is one coalesced
    read's buffer, where ranges were joined across a gap."""
    out = np.empty(tuple(hi - lo for lo, hi in box), entry.np_dtype)
    into, cursor, total = out.reshape(-1).view(np.uint8), 0, 0
    with open(path, "rb") as file:
        for offset, length, members in reads(spans(entry, box), coalesce):
            if len(members) == 1:  # (no gap: the bytes land where they belong)
                got = os.preadv(file.fileno(), [into[cursor : cursor + length].data], offset)
                raw = None
            else:
                raw = os.pread(file.fileno(), length, offset)
                got = len(raw)
            if got != length:  # (the file shrank since its header was read)
                raise _corrupt(path, f"tensor {entry.name!r}: ended {length - got} bytes early")
            total += length
            if raw is None:
                cursor += length
                continue
            for start, size in members:  # (each range is the box's next row, in order)
                into[cursor : cursor + size] = np.frombuffer(raw, np.uint8, size, start - offset)
                cursor += size
    return out, total


def write(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping | None = None
) -> None:
    """Writes ``tensors`` to a safetensors file at ``path`` atomically (a temporary file in the
    same directory, renamed): a reader sees the old file or the whole new one."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset, arrays = 0, []
    for name in sorted(tensors):
        array = np.asarray(tensors[name])  # (not ascontiguousarray: it makes a scalar 1-d)
        if array.dtype not in _NAMES:
            raise TypeError(
                f"write: tensor {name!r} has dtype {array.dtype}, none of safetensors' {sorted(DTYPES)}"
            )
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # (the data starts 8-byte aligned, as the reference writes)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".writing-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(struct.pack("<Q", len(raw)) + raw)
            for array in arrays:
                file.write(array.tobytes(order="C"))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise

"""Issue 100, the safetensors format read as untrusted input: every lie a header can tell
(a length past the file, offsets past the data or overlapping, bytes that are not the shape's,
an unknown dtype, a name given twice, not JSON) refused before it steers a read, naming the file
and the tensor, and the honest file read (the negative control); an index of shards that names
a file outside the directory or one not downloaded refused, and the fix it names working; any
block of any tensor equal to the slice of the array written, reading exactly its bytes where
nothing is coalesced (hypothesis), and a block read one element off caught.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_tp.errors import CheckpointCorruptError, CheckpointMismatchError
from fsdp_tp.hub import Checkpoint
from fsdp_tp.hub.safetensors import read_block, read_header, write


def _honest(tmp_path, **tensors) -> str:
    path = os.path.join(tmp_path, "model.safetensors")
    write(path, tensors or {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int32)})
    return path


def _with_header(path: str, header: dict | bytes, data: bytes = b"", length: int | None = None) -> str:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _three_bytes(path: str) -> str:
    with open(path, "wb") as file:
        file.write(b"\x10\0\0")
    return path


LIES = {
    "header longer than the file": (lambda p: _with_header(p, {}, length=1 << 20), "header of 1048576 bytes"),
    "offsets past the end": (
        lambda p: _with_header(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        "'w': data_offsets [0, 8] do not lie within the file's 4 bytes",
    ),
    "overlapping tensors": (
        lambda p: _with_header(
            p,
            {
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        "'w' and 'x' overlapping bytes",
    ),
    "bytes not the shape's": (
        lambda p: _with_header(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "'w': holds 8 bytes, but F32 of shape (3,) takes 12",
    ),
    "unknown dtype": (
        lambda p: _with_header(p, {"w": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
        "'w': dtype 'PICKLE' is none of",
    ),
    "a name given twice": (
        lambda p: _with_header(
            p,
            b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
            b'"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
            b"\0",
        ),
        "names given twice: ['w']",
    ),
    "not JSON": (lambda p: _with_header(p, b"\x80garbage"), "not JSON"),
    "a negative or boolean size": (
        lambda p: _with_header(p, {"w": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"),
        "shape [True] is not a list of non-negative integers",
    ),
    "shorter than its length": (_three_bytes, "is 3 bytes, shorter than the 8-byte header length"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_header_that_lies_is_refused_before_it_steers_a_read(tmp_path, lie):
    make, said = LIES[lie]
    path = make(str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointCorruptError, match="download it again") as refused:
        Checkpoint(tmp_path)
    assert path in str(refused.value) and said in str(refused.value)


def test_the_honest_file_and_a_sharded_index_read_and_an_index_that_lies_is_refused(tmp_path):
    # (the negative control of the lies above: the same reader reads what tells the truth)
    path = _honest(tmp_path)
    assert Checkpoint(tmp_path).read("a").tolist() == [[0, 1, 2], [3, 4, 5]]
    os.rename(path, tmp_path / "part-1.safetensors")
    write(str(tmp_path / "part-2.safetensors"), {"c": np.full((2,), 7, np.float32)})
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-1.safetensors", "c": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert {n: Checkpoint(tmp_path).file(n) for n in "abc"} == {
        "a": "part-1.safetensors",
        "b": "part-1.safetensors",
        "c": "part-2.safetensors",
    }
    for shard, error, said in [
        ("../outside.safetensors", CheckpointCorruptError, "not a file name in the directory"),
        (
            "part-3.safetensors",
            CheckpointMismatchError,
            "the download is incomplete; fetch part-3.safetensors",
        ),
    ]:
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {**index["weight_map"], "c": shard}})
        )
        with pytest.raises(error, match="tensor 'c'") as refused:
            Checkpoint(tmp_path)
        assert said in str(refused.value)
    # The fix it names: fetch the shard.
    shutil.copy(tmp_path / "part-2.safetensors", tmp_path / "part-3.safetensors")
    assert Checkpoint(tmp_path).read("c").tolist() == [7, 7]


@st.composite
def _tensor_and_box(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    dtype = draw(st.sampled_from([np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.uint8]))
    box = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        box.append((lo, draw(st.integers(lo + 1, n))))
    return (np.arange(int(np.prod(shape))) % 250 + 1).astype(dtype).reshape(shape), tuple(box)


@settings(max_examples=60, deadline=None)
@given(_tensor_and_box(), st.sampled_from([0, 8, 4096]))
def test_a_block_read_is_that_slice_of_the_tensor_and_reads_its_bytes(
    tmp_path_factory, tensor_and_box, coalesce
):
    tensor, box = tensor_and_box
    path = _honest(tmp_path_factory.mktemp("st"), t=tensor, z_pad=np.zeros(8, np.uint8))
    entry = read_header(path)["t"]
    block, nbytes = read_block(path, entry, box, coalesce)
    wanted = tensor[tuple(slice(lo, hi) for lo, hi in box)]
    assert block.dtype == tensor.dtype and np.array_equal(block, wanted)
    if coalesce == 0:
        assert nbytes == wanted.nbytes
    assert wanted.nbytes <= nbytes <= tensor.nbytes
    # Negative control: the same box read one element off (bytes the header did not give it) differs.
    size = tensor.dtype.itemsize
    off_by_one = dataclasses.replace(entry, begin=entry.begin + size, end=entry.end + size)
    assert not np.array_equal(read_block(path, off_by_one, box, coalesce)[0], wanted)

"""A checkpoint directory in the Hugging Face layout, opened for reading: ``config.json``, and
``model.safetensors`` or the shards an index ``model.safetensors.index.json`` names.

Opening reads the headers only (every one checked, :mod:`fsdp_tp.hub.safetensors`); blocks are
read on demand, and :attr:`Checkpoint.bytes_read` counts them. An index is untrusted too: a shard
named by a path that leaves the directory, a shard that is missing, or a tensor the index puts in a
file whose header lacks it is refused, naming the tensor and the file.

>>> import os, tempfile, numpy as np
>>> from fsdp_tp.hub.safetensors import write
>>> directory = tempfile.mkdtemp()
>>> write(os.path.join(directory, "model.safetensors"), {"embed": np.ones((4, 2), np.float32)})
>>> checkpoint = Checkpoint(directory)
>>> checkpoint.shape("embed"), checkpoint.read("embed", ((1, 2), (0, 2))).tolist(), checkpoint.bytes_read
((4, 2), [[1.0, 1.0]], 8)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointCorruptError, CheckpointMismatchError
from .safetensors import COALESCE, Box, Entry, read_block, read_header

__all__ = ["INDEX", "SINGLE", "Checkpoint"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The tensors of the checkpoint in ``directory``: their names, dtypes and shapes, and any
    block of any of them (:meth:`read`). ``config`` is ``config.json``'s object (``{}`` without one)."""

    def __init__(self, directory: str | os.PathLike, coalesce: int = COALESCE):
        self.directory = Path(directory)
        self.coalesce = coalesce
        self.bytes_read = 0
        if not self.directory.is_dir():
            raise CheckpointMismatchError(
                f"Checkpoint: {os.fspath(directory)!r} is not a directory; pass the directory that holds "
                f"{SINGLE} or {INDEX} (a Hugging Face model's download)."
            )
        config = self.directory / "config.json"
        self.config = json.loads(config.read_text()) if config.is_file() else {}
        self.entries: dict[str, tuple[Path, Entry]] = {}
        for file, names in self._files().items():
            header = read_header(file)
            for name in names if names is not None else header:
                if name not in header:
                    raise CheckpointCorruptError(
                        f"{self.directory / INDEX} puts tensor {name!r} in {file.name}, whose header "
                        f"has no such tensor: the index or the file is damaged; download both again."
                    )
                self.entries[name] = (file, header[name])

    def _files(self) -> dict[Path, list[str] | None]:
        """Each file to open and the tensors to take from it (``None``: all of its own)."""
        index = self.directory / INDEX
        if not index.is_file():
            single = self.directory / SINGLE
            if not single.is_file():
                found = sorted(p.name for p in self.directory.iterdir())[:8]
                raise CheckpointMismatchError(
                    f"Checkpoint: {os.fspath(self.directory)!r} holds neither {SINGLE} nor {INDEX} "
                    f"(it holds {found}); pass the directory of a safetensors download."
                )
            return {single: None}
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointCorruptError(f"{index} has no weight_map object: download it again.")
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                raise CheckpointCorruptError(
                    f"{index} puts tensor {name!r} in {file!r}, not a file name in the directory: "
                    f"an index names its shards beside it; download it again."
                )
            path = self.directory / file
            if not path.is_file():
                raise CheckpointMismatchError(
                    f"{index} puts tensor {name!r} in {file}, which is not in {os.fspath(self.directory)!r}: "
                    f"the download is incomplete; fetch {file} too."
                )
            files.setdefault(path, []).append(name)  # type: ignore[union-attr]
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1].shape

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][1].np_dtype

    def file(self, name: str) -> str:
        return self.entries[name][0].name

    def read(self, name: str, box: Box | None = None) -> np.ndarray:
        """``box`` (a ``(start, stop)`` a dim; default all) of tensor ``name``, in its stored dtype."""
        file, entry = self.entries[name]
        box = tuple((0, d) for d in entry.shape) if box is None else tuple(box)
        block, nbytes = read_block(file, entry, box, self.coalesce)
        self.bytes_read += nbytes
        return block

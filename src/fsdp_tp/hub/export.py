"""A (fine-tuned) model back to the Hub's layout: the checkpoint it was loaded from, its tensors
replaced by the model's, written shard-wise.

:func:`export` writes the tensor names, files and ``config.json`` of ``like`` (the checkpoint
the model came from), each tensor in ``like``'s dtype (or ``dtype``), its values from the
model's parameters through the mapping's views undone. Every file's header is the same on every
process; each process then writes the bytes of the blocks its devices hold (one replica each:
no byte is written twice, none by a process that does not hold it) into the files, and process 0
moves the finished directory into place: a reader sees no directory or the whole checkpoint.

>>> import os, tempfile, numpy as np, jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> from fsdp_tp.hub.safetensors import write
>>> from fsdp_tp.hub.mapping import Rule, Transpose
>>> source, out = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "tuned")
>>> write(os.path.join(source, "model.safetensors"), {"w": np.zeros((4, 8), np.float32)})
>>> sharding = NamedSharding(make_mesh({"fsdp": 8}), P("fsdp"))
>>> params = {"kernel": jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), sharding)}
>>> export(params, [Rule("w", "kernel", (Transpose(),))], like=source, directory=out)
>>> Checkpoint(out).read("w")[1].tolist()  # the kernel's column 1, transposed back
[1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0, 29.0]
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from .._types import PyTree
from ..checkpoint._files import barrier
from ..errors import CheckpointSaveError
from .directory import INDEX, Checkpoint
from .load import param_path
from .mapping import Rule, box_of, match
from .safetensors import DTYPES, Entry, spans

__all__ = ["export"]


def export(
    params: PyTree,
    rules: Sequence[Rule],
    like: str | os.PathLike | Checkpoint,
    directory: str | os.PathLike,
    ignore: Sequence[str] = (),
    dtype: str | None = None,
) -> None:
    """Writes ``params`` (the model's parameters, global arrays in any sharding, Linen boxes or
    NNX variables) as a checkpoint in ``directory`` laid out as ``like``: its tensor names and
    files, ``config.json`` and an index where it has one. ``rules`` (and ``ignore``) as the
    load took them; tensors ``ignore`` matches are not written. ``dtype`` (``"BF16"``,
    ``"F32"``, ...): every tensor's; default each tensor's in ``like``. ``directory`` must not
    exist yet."""
    source = like if isinstance(like, Checkpoint) else Checkpoint(like)
    target = Path(directory)
    if target.exists():
        raise CheckpointSaveError(
            f"export: {os.fspath(target)!r} exists; export writes a new directory whole (pass a new path, "
            f"or remove that one first)."
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export: dtype={dtype!r} is none of safetensors' {sorted(DTYPES)}")
    leaves = {param_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    plan = match(
        rules,
        {n: source.shape(n) for n in source.names()},
        {p: x.shape for p, x in leaves.items()},
        ignore,
        where=source.file,
        done="written",
    )
    files = _layout(source, plan, dtype)
    temporary = target.parent / f".exporting-{target.name}"
    if jax.process_index() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        for file, (header, entries) in files.items():
            with open(temporary / file, "wb") as out:
                out.write(struct.pack("<Q", len(header)) + header)
                out.truncate(8 + len(header) + sum(e.end - e.begin for e in entries.values()))
        _write_sidecars(source, temporary, files)
    barrier(f"fsdp_tp export {target.name} laid out")
    try:
        _write_blocks(leaves, plan, files, temporary)
    except BaseException:
        if jax.process_index() == 0:  # (nothing half-written is left behind)
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    barrier(f"fsdp_tp export {target.name} written")
    if jax.process_index() == 0:
        os.replace(temporary, target)
    barrier(f"fsdp_tp export {target.name} done")


def _write_blocks(leaves: dict, plan, files, temporary: Path) -> None:
    """Each block this process's devices hold (one replica of each) into its files."""
    entries = {name: (file, entry) for file, (_, es) in files.items() for name, entry in es.items()}
    for path, sources in plan.items():
        for shard in leaves[path].addressable_shards:
            if shard.replica_id != 0:  # (one replica writes each block)
                continue
            box = box_of(shard.index, leaves[path].shape)
            value = np.asarray(shard.data)
            stacked = len(sources[0].at)
            for source_ in sources:
                if not all(lo <= i < hi for i, (lo, hi) in zip(source_.at, box, strict=False)):
                    continue
                part = value[tuple(i - lo for i, (lo, _) in zip(source_.at, box, strict=False))]
                stored_box, stored = source_.unblock(part, box[stacked:])
                file, entry = entries[source_.name]
                _write_box(temporary / file, entry, stored_box, stored.astype(entry.np_dtype))


def _layout(source: Checkpoint, plan, dtype: str | None) -> dict[str, tuple[bytes, dict[str, Entry]]]:
    """Each file's header bytes and entries: ``source``'s files and names, offsets anew."""
    written = {s.name for sources in plan.values() for s in sources}
    by_file: dict[str, list[str]] = {}
    for name in sorted(written):
        by_file.setdefault(source.file(name), []).append(name)
    files = {}
    for file, names in by_file.items():
        fields, offset = {}, 0
        for name in names:
            kind = dtype or source.entries[name][1].dtype
            size = int(np.prod(source.shape(name))) * DTYPES[kind].itemsize
            fields[name] = (kind, source.shape(name), offset, offset + size)
            offset += size
        raw = json.dumps(
            {n: {"dtype": k, "shape": list(s), "data_offsets": [b, e]} for n, (k, s, b, e) in fields.items()},
            separators=(",", ":"),
        ).encode()
        raw += b" " * (-len(raw) % 8)
        start = 8 + len(raw)
        files[file] = (
            raw,
            {n: Entry(n, k, tuple(s), start + b, start + e) for n, (k, s, b, e) in fields.items()},
        )
    return files


def _write_sidecars(source: Checkpoint, temporary: Path, files) -> None:
    """``config.json`` as ``source``'s, and the index where ``source`` has one."""
    if (source.directory / "config.json").is_file():
        shutil.copyfile(source.directory / "config.json", temporary / "config.json")
    if (source.directory / INDEX).is_file():
        weight_map = {name: file for file, (_, entries) in files.items() for name in entries}
        total = sum(e.end - e.begin for _, entries in files.values() for e in entries.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (temporary / INDEX).write_text(json.dumps(index, indent=2))


def _write_box(path: Path, entry: Entry, box, values: np.ndarray) -> None:
    """``values`` into ``box`` of ``entry`` in the file at ``path``: a ``pwrite`` a contiguous range."""
    raw = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    cursor = 0
    with open(path, "r+b") as file:
        for offset, length in spans(entry, box):
            os.pwrite(file.fileno(), raw[cursor : cursor + length].tobytes(), offset)
            cursor += length

"""``fsdp-tp plan --from DIR``: what each device would hold, and read, of a downloaded checkpoint's
model on any mesh, from its ``config.json`` alone (no weights needed, no devices: the mesh is
abstract, so an 8B model on 4,096 devices plans on a laptop).

The model is the library's decoder (:mod:`fsdp_tp.hub.decoder`) laid out as a fine-tune lays it:
FSDP over the mesh's ``fsdp`` axis (:func:`~fsdp_tp.hub.fsdp_rules`), Megatron's plan over
``tensor`` (:func:`~fsdp_tp.hub.tp_rules`), a mixture's experts over ``expert`` (which splits the
batch too), AdamW's state beside the parameters. Each device reads
its parameters' blocks from the checkpoint in the checkpoint's own dtype (``config.json``'s, or
the files' where they are there), so its bytes read are its parameter bytes scaled by that
dtype's size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import fsdp_tp

from ..errors import CheckpointMismatchError
from ..hub import Checkpoint, Decoder, DecoderConfig, fsdp_rules, tp_rules
from ..hub.directory import INDEX, SINGLE
from ..plan import Plan, make_plan
from .fit import abstract_mesh

__all__ = ["hub_plan", "print_hub_plan", "stored_itemsize"]

_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


def stored_itemsize(directory: Path, config: dict) -> int:
    """The bytes an element of the checkpoint's weights takes: its files' dtype where they are
    downloaded, else ``config.json``'s ``dtype`` (``torch_dtype``), else bfloat16's 2."""
    if (directory / SINGLE).is_file() or (directory / INDEX).is_file():
        checkpoint = Checkpoint(directory)
        sizes = {
            checkpoint.dtype(name).itemsize for name in checkpoint.names() if name.endswith("proj.weight")
        }
        if len(sizes) == 1:
            return sizes.pop()
    return _DTYPES.get(config.get("dtype") or config.get("torch_dtype") or "bfloat16", 2)


def hub_plan(directory: str | Path, sizes: dict, batch: int, seq_len: int) -> tuple[Plan, DecoderConfig]:
    """The plan of ``directory``'s model on an abstract mesh of ``sizes``, its batch of ``batch``
    sequences of ``seq_len`` tokens split over the mesh's ``data``, ``fsdp`` and ``expert`` axes."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise CheckpointMismatchError(
            f"plan --from {directory}: no config.json there; pass the directory of a Hugging Face "
            f"download (its config.json is all the plan reads)."
        )
    config = DecoderConfig.from_hub(json.loads((path / "config.json").read_text()))
    batch_axes = tuple(a for a in ("data", "fsdp", "expert") if a in sizes)
    storage = fsdp_rules(config) if sizes.get("fsdp", 1) > 1 else []
    tp = tp_rules(config, sizes=sizes)  # (only what the mesh splits)
    model = fsdp_tp.shard_by_rules(Decoder, storage, batch_axes=batch_axes, tp_rules=tp)(config)
    tx = optax.adamw(1e-5)

    def init_fn(key, tokens):
        params = model.init(key, tokens)["params"]
        return fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=tx, rng=key)

    tokens = jax.ShapeDtypeStruct((batch, seq_len), np.int32)
    plan = make_plan(init_fn, abstract_mesh(sizes), (P(), P(batch_axes)), jax.random.key(0), tokens)
    return plan, config


def print_hub_plan(directory: str, sizes: dict, batch: int, seq_len: int, out: TextIO) -> None:
    """:func:`hub_plan`'s table, then what a device reads of the checkpoint."""
    plan, config = hub_plan(directory, sizes, batch, seq_len)
    print(plan, file=out)
    itemsize = stored_itemsize(Path(directory), json.loads((Path(directory) / "config.json").read_text()))
    elements = sum(r.bytes_per_device // np.dtype(r.dtype).itemsize for r in plan.rows)
    print(
        f"reads per device: {elements * itemsize:,} B of the checkpoint ({elements:,} elements of "
        f"{itemsize} B: its parameters' blocks, nothing else), {config.family} of {config.layers} layers",
        file=out,
    )

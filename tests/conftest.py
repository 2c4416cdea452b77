"""What the test files share: the batch axes of the meshes they build, the data x fsdp meshes
and widths the FSDP properties draw, a mesh of the first devices, and the bytes a program's
collectives move (the root ``conftest.py`` sets up the devices before any of this imports
jax's backend)."""

from __future__ import annotations

import jax
import pytest
from hypothesis import strategies as st

import fsdp_tp
from fsdp_tp.collectives import copy_to_axis
from fsdp_tp.models import Layout
from fsdp_tp.recipe.config import preset
from fsdp_tp.recipe.trainer import Settings

__all__ = ["BATCH_AXES", "MESHES", "WIDTHS", "mesh_of", "replicated_ok", "settings", "total"]

BATCH_AXES = ("data", "fsdp")
MESHES = [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)]  # data x fsdp over the 8 devices
# 3, 5, 6 and 12 do not divide every axis size: those parameters must stay replicated.
WIDTHS = st.sampled_from([3, 4, 5, 6, 8, 12, 16, 24, 32])
replicated_ok = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")


def mesh_of(data: int, fsdp: int, tensor: int | None = None):
    """A mesh of ``data`` x ``fsdp`` (x ``tensor``, where given) on the first devices."""
    sizes = {"data": data, "fsdp": fsdp} | ({} if tensor is None else {"tensor": tensor})
    n = data * fsdp * (tensor or 1)
    return fsdp_tp.make_mesh(sizes, devices=jax.devices()[:n])


def total(found, kind: str, attr: str = "operand_bytes", min_group: int = 1) -> int:
    """``attr`` summed over the collectives of ``kind`` in ``found``
    (:func:`fsdp_tp.analysis.parse_collectives`), each as often as it runs, in groups of at
    least ``min_group`` devices."""
    return sum(getattr(c, attr) * c.executions for c in found if c.kind == kind and c.group_size >= min_group)


def settings(**changes) -> Settings:
    """The CLI's run of the tiny preset (2 x 2 x 2, sequence parallel), with ``changes``."""
    fields = dict(
        model=preset("tiny"),
        steps=12,
        batch=16,
        microbatches=1,
        lr=3e-3,
        warmup=20,
        seed=0,
        layout=Layout("tensor", "fsdp", sequence_parallel=True, min_weight_size=2**10),
        check_vma=True,
    )
    return Settings(**{**fields, **changes})


def first_block(param, dim, blocks, axis, *_, **__):
    """:func:`fsdp_tp.tp.pieces.kept_block` with every device keeping the first block(s): the negative
    control of each kept-whole path (a kv head read at the wrong index is another model)."""
    width = param.shape[dim] // blocks
    kept = max(1, blocks // jax.lax.axis_size(axis)) * width
    return jax.lax.slice_in_dim(copy_to_axis(param, axis), 0, kept, axis=dim)


@pytest.fixture
def compiled_here(monkeypatch):
    """The programs the test compiles are compiled, never loaded from the compilation cache
    (they are still written to it). For a program that XLA's CPU runtime runs wrongly once
    deserialized: the scanned, rematerialized LM whose FSDP gathers run inside the scan's
    loop (``tests/test_per_layer_gather.py``) deadlocked in a rendezvous (a device of one fsdp
    group joining another group's all-gather) or gave NaN on one group's rows in 4 of 40
    runs of that test loaded from the cache, 0 of 40 compiled (2026-12-07, jax 0.10.2;
    ``FSDP_TP_COMPILE_CACHE=off`` against the cache, alternating, one process a run).
    JAX's reader is private: both supported jax versions name it so."""
    from jax._src import compilation_cache

    monkeypatch.setattr(compilation_cache, "get_executable_and_time", lambda *args, **kwargs: (None, None))

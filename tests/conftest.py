"""What the test files share: the batch axes of the meshes they build, a mesh of the first
devices, and the bytes a program's collectives move (the root ``conftest.py`` sets up the
devices before any of this imports jax's backend)."""

from __future__ import annotations

import jax

import fsdp_tp

__all__ = ["BATCH_AXES", "mesh_of", "total"]

BATCH_AXES = ("data", "fsdp")


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

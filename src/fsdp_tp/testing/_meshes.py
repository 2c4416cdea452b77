"""Hypothesis strategies for the meshes the available devices can form, so a user's model is
property-tested over meshes in three lines:

>>> from hypothesis import given, settings
>>> @settings(max_examples=3, database=None, derandomize=True)
... @given(mesh=meshes(("data", "tensor")))
... def test_every_mesh(mesh):
...     assert mesh.size == 8 and mesh.axis_names == ("data", "tensor")
>>> test_every_mesh()
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ..mesh import make_mesh

__all__ = ["mesh_shapes", "meshes"]


def mesh_shapes(axes: Sequence[str], devices: int) -> list[dict[str, int]]:
    """Every way to lay ``devices`` over ``axes`` (each axis a size, their product the count).

    >>> mesh_shapes(("data", "tensor"), 4)
    [{'data': 1, 'tensor': 4}, {'data': 2, 'tensor': 2}, {'data': 4, 'tensor': 1}]
    """
    if not axes:
        return [{}] if devices == 1 else []
    first, *rest = axes
    return [
        {first: size, **shape}
        for size in range(1, devices + 1)
        if devices % size == 0
        for shape in mesh_shapes(rest, devices // size)
    ]


def meshes(axes: Sequence[str] = ("data", "fsdp", "tensor"), devices: Sequence | None = None):
    """A hypothesis strategy of meshes over ``axes`` laying out all of ``devices`` (default: every
    device of the default backend), one per way to factor their count (needs ``hypothesis``)."""
    try:
        from hypothesis import strategies as st
    except ImportError as err:  # (a dev dependency: pip install hypothesis)
        raise ImportError(
            "fsdp_tp.testing.meshes is a hypothesis strategy; install hypothesis (pip install hypothesis)."
        ) from err
    devices = list(jax.devices() if devices is None else devices)
    shapes = mesh_shapes(tuple(axes), len(devices))
    return st.sampled_from(shapes).map(lambda shape: make_mesh(shape, devices=devices))

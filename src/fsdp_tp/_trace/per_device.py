"""The one abstract per-device trace that specs, the plan and the sharded init read.

A function that builds a train state (or anything with ``Partitioned`` boxes) is
traced once per device under ``jax.shard_map``, abstractly (``jax.eval_shape``: no
FLOPs, no memory, any mesh, an ``AbstractMesh`` included). The trace keeps:

- the output's tree and each leaf's *local* shape and dtype (what one device holds),
- each leaf's ``PartitionSpec`` (a box gives ``P(*names)``, any other leaf ``P()``),
- the per-device program as a jaxpr, so the init can run it without tracing the
  model a second time (flax traces are what grows with depth, not replays).

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh, shard_module_params
>>> import flax.linen as nn
>>> model = shard_module_params(nn.Dense, min_weight_size=0)(16)
>>> traced = trace_per_device(lambda r, x: model.init(r, x)["params"], make_mesh({"fsdp": 8}),
...                           (P(), P()), (jax.random.key(0), jnp.ones((2, 4))))
>>> traced.flat_specs, [s.shape for s in jax.tree.leaves(traced.local)]   # bias, kernel: 1/8 of each
([P('fsdp',), P(None, 'fsdp')], [(2,), (4, 2)])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.meta import Partitioned
from jax.extend.core import ClosedJaxpr
from jax.sharding import PartitionSpec

from .._layout import fit_problems
from .._types import PyTree, Specs

__all__ = ["Traced", "flat_specs_of", "specs_of", "trace_per_device"]


def specs_of(tree: PyTree, mesh=None) -> PyTree:
    """``P(*names)`` for each ``Partitioned`` box, ``P()`` for every other leaf.

    Unlike ``nn.get_partition_spec`` it gives ``P()`` (not ``None``) for Python
    scalars such as a train state's step counter, which shard_map outputs as arrays.

    With ``mesh``, a box whose names do not fit its value on the mesh gets ``P()``: an
    optimizer leaf inherits its parameter's box even where its shape is not the
    parameter's (Adafactor's factored row ``(rows,)`` of a ``(rows, cols)`` kernel, or a
    ``(1,)`` placeholder); such a leaf is small and is kept whole on every device.

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> from fsdp_tp import make_mesh
    >>> specs_of({"w": nn.Partitioned(jnp.ones((2, 4)), (None, "fsdp")), "step": 0, "extra": None})
    {'extra': None, 'step': P(), 'w': P(None, 'fsdp')}
    >>> box = lambda shape: nn.Partitioned(jnp.zeros(shape), ("fsdp", None))
    >>> specs_of({"moment": box((8, 4)), "row": box((8,)), "odd": box((3, 4))}, make_mesh({"fsdp": 8}))
    {'moment': P('fsdp', None), 'odd': P(), 'row': P()}
    """
    sizes = None if mesh is None else dict(mesh.shape)

    def spec(x):
        if not isinstance(x, Partitioned):
            return PartitionSpec()
        # A box around no array (optax.masked's MaskedNode for a masked-out param) keeps
        # its leafless structure, so the specs flatten like the state.
        if not jax.tree.leaves(x.value):
            return x
        wanted = x.get_partition_spec()
        if _is_array(x.value):
            return wanted if sizes is None else fitting(wanted, x.value)
        # A box around a pytree: an optimizer that keeps several arrays per parameter
        # (optax.sm3: one accumulator per dim) inherits the box around its list. Each array
        # is split like the parameter where that fits, else whole; the box stays, so the
        # specs keep the state's structure.
        return x.replace_boxed(jax.tree.map(lambda v: fitting(wanted, v), x.value))

    def fitting(wanted, value):
        shape = tuple(np.shape(value))
        if len(wanted) != len(shape) or fit_problems("", shape, wanted, sizes or {}):
            return PartitionSpec()
        return wanted

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, Partitioned))


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def flat_specs_of(tree: PyTree) -> list[PartitionSpec]:
    """One spec per array leaf of ``tree``, in ``jax.tree.leaves`` order (``None`` and
    empty subtrees hold no leaf and get no spec)."""
    return jax.tree.leaves(specs_of(tree), is_leaf=lambda x: isinstance(x, PartitionSpec))


@dataclass(frozen=True)
class Traced:
    """What one abstract trace of a per-device function tells."""

    local: PyTree  # the output, unboxed, each array leaf a local ShapeDtypeStruct
    specs: PyTree  # the PartitionSpec of each leaf, as specs_of gives it
    treedef: Any  # the output's structure, boxes included
    jaxpr: ClosedJaxpr  # the per-device program: flat args -> flat leaves

    @functools.cached_property
    def flat_specs(self) -> list[PartitionSpec]:
        """One spec per array leaf, in ``jax.tree.leaves`` order (computed once)."""
        return jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def trace_per_device(fn: Callable, mesh, in_specs: Specs, args: tuple, *, check_vma: bool = True) -> Traced:
    """Traces ``fn(*args)`` once per device under ``jax.shard_map`` over ``mesh``, abstractly.

    ``args`` may hold arrays or ``jax.ShapeDtypeStruct``s of global shape;
    ``mesh`` may be an ``AbstractMesh``.
    """
    captured: dict[str, Any] = {}

    def probe(*inner):
        # make_jaxpr is the trace itself: it runs fn once on abstract values and keeps the program.
        closed, out = jax.make_jaxpr(fn, return_shape=True)(*inner)
        captured["jaxpr"], captured["out"] = closed, out
        return ()  # nothing leaves: no out_specs, no replication claim needed

    jax.eval_shape(
        jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=(), check_vma=check_vma), *args
    )
    out = captured["out"]
    is_box = lambda x: isinstance(x, Partitioned)
    # A box around no array (optax.masked's MaskedNode) stays leafless, as in the state.
    local = jax.tree.map(lambda x: jax.tree.map(_struct, x.value if is_box(x) else x), out, is_leaf=is_box)
    return Traced(local, specs_of(out), jax.tree.structure(out), captured["jaxpr"])


def _struct(x) -> Any:
    # A Python scalar (a step counter) leaves shard_map as a JAX array: int32 or float32.
    dtype = getattr(x, "dtype", None) or jnp.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype)

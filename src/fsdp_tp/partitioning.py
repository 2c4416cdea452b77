"""Partition specs derived from the model itself, and checked against a mesh.

A train state built inside ``jax.shard_map`` carries its layout in its
``nn.Partitioned`` boxes. Tracing the init once, abstractly, yields the
``PartitionSpec`` of every leaf (:mod:`fsdp_tp._trace.per_device`); those specs then serve as the
init's ``out_specs`` and as the train step's ``in_specs``/``out_specs``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ._layout import check_fit
from ._trace.per_device import flat_specs_of, specs_of, trace_per_device
from ._tree import first_difference
from ._types import PyTree, Specs
from .errors import SpecError, SpecTreeMismatchError

__all__ = ["check_specs", "derive_specs", "flat_specs_of", "specs_of"]


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec) or x is None


def derive_specs(
    fn: Callable, mesh: Mesh | AbstractMesh, in_specs: Specs, *args, check_vma: bool = True
) -> PyTree:
    """The ``PartitionSpec`` tree of ``fn``'s output when run per device under ``shard_map``.

    ``fn`` is traced abstractly (``jax.eval_shape``: no FLOPs, no memory), with
    ``check_vma`` as given; boxed leaves give ``P(*names)``, plain leaves ``P()``.
    Typical use: the specs of a train state built by an init function.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> mesh = make_mesh({"fsdp": 8})
    >>> Dense = shard_module_params(nn.Dense, min_weight_size=0)
    >>> derive_specs(lambda x: Dense(16).init(jax.random.key(0), x), mesh, P("fsdp"), jnp.ones((8, 4)))
    {'params': {'bias': P('fsdp',), 'kernel': P(None, 'fsdp')}}
    """
    return trace_per_device(fn, mesh, in_specs, args, check_vma=check_vma).specs


def check_specs(tree: PyTree, specs: Specs, mesh: Mesh | AbstractMesh, what: str = "value") -> None:
    """Raises a clear error if ``specs`` is not a spec-tree prefix of ``tree`` that ``mesh`` divides.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> check_specs({"x": jnp.ones((6, 2))}, {"x": P("data")}, make_mesh({"data": 4, "fsdp": 2}), "batch")
    Traceback (most recent call last):
    ...
    fsdp_tp.errors.IndivisibleShapeError: batch['x']: dim 0 (size 6) of shape (6, 2) is not divisible by ...
    """
    spec_leaves, spec_def = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
    for spec_path, leaf in spec_leaves:
        if not _is_spec(leaf):  # a bare "data" would be read as one axis per character
            shown = f"P({leaf!r})" if isinstance(leaf, str) else "a PartitionSpec, e.g. P('data')"
            raise SpecError(
                f"{what}{jax.tree_util.keystr(tuple(spec_path))}: spec {leaf!r} is a "
                f"{type(leaf).__name__}, not a PartitionSpec; write {shown}."
            )
    try:
        subtrees = spec_def.flatten_up_to(tree)  # type: ignore[attr-defined]  # exists, untyped
    except (ValueError, TypeError):
        raise SpecTreeMismatchError(
            # Not jax's message: it prints the whole tree, arrays included.
            f"the specs given for the {what} do not match its structure "
            f"({first_difference(specs, tree, is_leaf=_is_spec, prefix=True)}). "
            f"Derive them from "
            f"the same function that builds the {what} (fsdp_tp.init_sharded returns them) instead "
            f"of writing them by hand."
        ) from None
    checks = [
        (
            what + jax.tree_util.keystr(tuple(spec_path) + tuple(leaf_path)),
            np.shape(leaf),
            spec or PartitionSpec(),
        )
        for (spec_path, spec), subtree in zip(spec_leaves, subtrees, strict=True)
        for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]
    ]
    check_fit(checks, mesh.shape, "change the spec (for a batch: the global batch size)")

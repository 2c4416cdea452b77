"""Partition specs derived from the model itself, and the sharded init and step built on them.

A train state built inside ``jax.shard_map`` carries its layout in its
``nn.Partitioned`` boxes. Tracing the init once, abstractly, yields the
``PartitionSpec`` of every leaf; those specs then serve as the init's
``out_specs`` and as the train step's ``in_specs``/``out_specs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, PartitionSpec

from ._axes import entry_axes
from ._types import PyTree, Specs
from .errors import IndivisibleShapeError, SpecTreeMismatchError

__all__ = [
    "check_specs",
    "derive_specs",
    "shard_step",
    "specs_of",
]


_REPLICATED = PartitionSpec()


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec) or x is None


def specs_of(tree: PyTree) -> PyTree:
    """``P(*names)`` for each ``nn.Partitioned`` box, ``P()`` for every other leaf.

    Unlike ``nn.get_partition_spec`` it gives ``P()`` (not ``None``) for Python
    scalars such as a train state's step counter, which shard_map outputs as arrays.

    >>> import flax.linen as nn, jax.numpy as jnp
    >>> specs_of({"w": nn.Partitioned(jnp.ones((2, 4)), (None, "fsdp")), "step": 0})
    {'step': P(), 'w': P(None, 'fsdp')}
    """

    def spec(x):
        if not isinstance(x, nn.Partitioned):
            return PartitionSpec()
        # A box around no array (optax.masked's MaskedNode for a masked-out param) keeps
        # its leafless structure, so the specs flatten like the state.
        return x.get_partition_spec() if jax.tree.leaves(x.value) else x

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def derive_specs(fn: Callable, mesh: Mesh, in_specs: Specs, *args, check_vma: bool = True) -> PyTree:
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
    captured: dict[str, Any] = {}

    def probe(*inner):
        # The specs are static metadata of the traced output; keep them and
        # return nothing, so no out_specs (and no replication claim) is needed.
        captured["specs"] = specs_of(fn(*inner))
        return ()

    jax.eval_shape(
        jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=(), check_vma=check_vma), *args
    )
    return captured["specs"]


def _check_leaf(where: str, shape: tuple, spec: PartitionSpec, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise SpecTreeMismatchError(
            f"{where}: spec {spec} names {len(spec)} dims but the value has shape {shape}; "
            f"give a spec with at most {len(shape)} entries."
        )
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise SpecTreeMismatchError(
                f"{where}: spec {spec} names mesh axis {unknown[0]!r}, but the mesh has axes "
                f"{dict(mesh.shape)}; use one of those names."
            )
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            raise IndivisibleShapeError(
                f"{where}: dim {dim} (size {shape[dim]}) of shape {shape} is not divisible by mesh "
                f"axes {axes} (size {parts}) of spec {spec}; make it a multiple of {parts} "
                f"(for a batch: the global batch size) or change the spec."
            )


def check_specs(tree: PyTree, specs: Specs, mesh: Mesh, what: str = "value") -> None:
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
    try:
        subtrees = spec_def.flatten_up_to(tree)  # type: ignore[attr-defined]  # exists, untyped
    except (ValueError, TypeError) as err:
        raise SpecTreeMismatchError(
            f"the specs given for the {what} do not match its structure: {err}. Derive them from "
            f"the same function that builds the {what} (fsdp_tp.derive_specs) instead of writing "
            f"them by hand."
        ) from None
    for (spec_path, spec), subtree in zip(spec_leaves, subtrees, strict=True):
        spec = PartitionSpec() if spec is None else spec
        for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            where = what + jax.tree_util.keystr(tuple(spec_path) + tuple(leaf_path))
            _check_leaf(where, tuple(getattr(leaf, "shape", ())), spec, mesh)


def shard_step(
    step_fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    mesh: Mesh,
    state_specs: PyTree,
    batch_specs: Specs,
    *,
    metrics_specs: Specs = _REPLICATED,
    check_vma: bool = True,
    donate_state: bool = True,
) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
    """Builds the jitted ``shard_map`` train step from a per-device ``step_fn(state, batch)``.

    ``step_fn`` returns ``(new_state, metrics)``; metrics are replicated
    (``pmean`` them over the batch axes) unless ``metrics_specs`` says otherwise.
    The state is donated, so the caller must not reuse the state it passed.
    When JAX rejects the state or batch, they are checked against their specs, so a
    mismatched tree or an indivisible batch fails with a message naming the leaf.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import TrainState, init_sharded, make_mesh, sync_gradients
    >>> mesh = make_mesh({"data": 8})
    >>> def init_fn(rng):
    ...     return TrainState.create(apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(1.0), rng=rng)
    >>> def step_fn(state, x):
    ...     loss, grads = jax.value_and_grad(lambda p: ((p["w"] - x) ** 2).mean())(state.params)
    ...     state = state.apply_gradients(grads=sync_gradients(grads, "data"))
    ...     return state, jax.lax.pmean(loss, "data")
    >>> state, specs = init_sharded(init_fn, mesh, P(), jax.random.key(0))
    >>> step = shard_step(step_fn, mesh, specs, P("data"))
    >>> state, loss = step(state, jnp.arange(8.0))   # w moves to 2 * mean(x) * lr = 7.0
    >>> float(loss), float(state.params["w"])
    (17.5, 7.0)
    """
    sharded = jax.jit(
        jax.shard_map(
            step_fn,
            mesh=mesh,
            in_specs=(state_specs, batch_specs),
            out_specs=(state_specs, metrics_specs),
            check_vma=check_vma,
        ),
        donate_argnums=(0,) if donate_state else (),
    )

    def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        try:
            return sharded(state, batch)
        except (ValueError, TypeError) as err:
            # A mismatched tree or an indivisible batch is rejected while tracing, before
            # anything runs or is donated: only then is it worth walking the trees to say
            # which leaf and which dim (no per-step cost on the happy path).
            check_specs(state, state_specs, mesh, "state")
            check_specs(batch, batch_specs, mesh, "batch")
            raise err

    step.lower = sharded.lower  # type: ignore[attr-defined]  # for HLO and memory analysis
    return step

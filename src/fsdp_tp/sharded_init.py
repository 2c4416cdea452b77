"""Sharded init: the train state built straight into its shardings, equal to the unsharded init.

One abstract trace of the sharded init (:mod:`fsdp_tp._trace.per_device`) gives the state's tree,
boxes and specs. Then either that per-device program runs under ``jax.shard_map`` (each
device computes a parameter in full and keeps its block), or, given ``twin_init_fn``,
the unsharded twin's init runs under ``jax.jit`` with the specs as ``out_shardings``, so
XLA computes only each device's blocks. Either way each model is traced once.

A train state's optimizer state is the exception: it is built by ``tx.init`` on the global
parameters (:mod:`fsdp_tp._optimizer`), never per device, so a transform whose state
depends on a parameter's full shape (Adafactor's factored moments) gets the state it
would have unsharded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ._init_watch import watched_init
from ._optimizer import (
    lower_optimizer_state,
    optimizer_state_shapes,
    with_optimizer_state,
    without_optimizer_state,
)
from ._trace.per_device import specs_of, trace_per_device
from ._types import PyTree, Specs
from .errors import SpecTreeMismatchError
from .partitioning import check_specs

__all__ = ["abstract_init", "init_sharded", "lower_init"]

# XLA's compile time grows faster than the program it compiles, so the init is cut into
# programs of at most this many leaves (each computes only its leaves' values; the bits are
# the same whatever the cut). Measured on the benchmark's unrolled GPT (fsdp 4 x tensor 2, 8
# CPU devices), 390 leaves: one program compiled in 15.4-16.4 s, 4 programs of ~98 leaves in
# 13.0 s, 3-6 programs in 12.4-13.4 s; at 8 layers (98 leaves) it stays one program.
_LEAVES_PER_PROGRAM = 100


def init_sharded(
    init_fn: Callable,
    mesh: Mesh,
    in_specs: Specs,
    *args,
    twin_init_fn: Callable | None = None,
    one_leaf_at_a_time: bool = False,
    check_vma: bool = True,
) -> tuple[PyTree, PyTree]:
    """Builds ``init_fn``'s state on ``mesh`` and returns ``(state, specs)``.

    ``init_fn(*args)`` builds the state per device (under ``jax.shard_map`` with
    ``in_specs``); its boxes say how each leaf is split. The state comes back as
    global arrays laid out by those specs.

    ``twin_init_fn`` (keyword only): the same state built with the unsharded twin
    of the model (same tree, same init: docs/design.md invariants 1 and 2). It then runs
    under ``jax.jit`` with the specs as ``out_shardings``: JAX's partitionable
    threefry draws each block's random bits where it lives, and no device computes
    a parameter in full. The result has ``init_fn``'s tree and boxes.

    The leaves are computed by programs of at most 100 leaves each (XLA's compile time
    grows faster than a program's size: a deep unrolled model compiles sooner in parts).
    ``one_leaf_at_a_time=True`` compiles one program per leaf (the same values, bit
    for bit): a device then holds at most its shards made so far plus one leaf's
    temporaries, under ``state / N + the largest parameter``, at the price of a
    compile per leaf (:func:`lower_init` gives the programs, to measure them).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> model, twin = shard_module_params(nn.Dense, min_weight_size=0)(8), nn.Dense(8)
    >>> args = (jax.random.key(0), jnp.ones((8, 4)))
    >>> params, specs = init_sharded(lambda r, x: model.init(r, x)["params"], mesh, (P(), P()), *args)
    >>> specs["kernel"], params["kernel"].value.shape   # global shape; each device holds (4, 2)
    (P(None, 'fsdp'), (4, 8))
    >>> params["kernel"].value.addressable_shards[0].data.shape
    (4, 2)
    >>> direct, _ = init_sharded(lambda r, x: model.init(r, x)["params"], mesh, (P(), P()), *args,
    ...                          twin_init_fn=lambda r, x: twin.init(r, x)["params"])
    >>> bool((direct["kernel"].value == params["kernel"].value).all())
    True
    """
    _require_init_fn(init_fn)
    traced, programs = init_programs(
        init_fn, mesh, in_specs, args, twin_init_fn, one_leaf_at_a_time, check_vma
    )
    leaves = [leaf for program in programs for leaf in program(*args)]
    state = with_optimizer_state(jax.tree.unflatten(traced.treedef, leaves), mesh)
    return state, specs_of(state, mesh)


def _require_init_fn(init_fn) -> None:
    """``init_fn`` is the function each device runs; a sharded NNX model, or anything else
    that is not a function, is named with what to pass."""
    if callable(init_fn):
        return
    name = type(init_fn).__name__
    fix = (
        "sharded.init (its parameters and other state) or sharded.state_init_fn(tx) (a train state)"
        if name == "ShardedModel"
        else "the per-device init, e.g. lambda rng, x: model.init(rng, x)['params']"
    )
    given = "" if name == "ShardedModel" else f" ({init_fn!r:.60})"
    raise TypeError(
        f"init_sharded: init_fn must be a function each device runs; got a {name}{given}: pass {fix}."
    )


def lower_init(
    init_fn: Callable,
    mesh: Mesh,
    in_specs: Specs,
    *args,
    twin_init_fn: Callable | None = None,
    one_leaf_at_a_time: bool = False,
    check_vma: bool = True,
) -> list[jax.stages.Lowered]:
    """The programs :func:`init_sharded` runs, lowered, in order (a train state's optimizer
    state last): compile one to read its ``memory_analysis()`` or its HLO. Same arguments
    as :func:`init_sharded`.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> model = shard_module_params(nn.Dense, min_weight_size=0)(64)
    >>> lowered = lower_init(lambda r, x: model.init(r, x)["params"], make_mesh({"fsdp": 8}), (P(), P()),
    ...                      jax.random.key(0), jnp.ones((2, 32)), one_leaf_at_a_time=True)
    >>> [low.compile().memory_analysis().output_size_in_bytes for low in lowered]  # 1/8 of each
    [32, 1024]
    """
    traced, programs = init_programs(
        init_fn, mesh, in_specs, args, twin_init_fn, one_leaf_at_a_time, check_vma
    )
    lowered = [program.lower(*args) for program in programs]
    # The optimizer's state is built from the global parameters: lower it from their shapes
    # (the lowered programs' outputs; tracing the programs again would only repeat them).
    leaves = [leaf for low in lowered for leaf in jax.tree.leaves(low.out_info)]
    return lowered + lower_optimizer_state(_laid_out(traced, leaves, mesh), mesh)


def abstract_init(
    init_fn: Callable, mesh: Mesh, in_specs: Specs, *args, check_vma: bool = True
) -> tuple[PyTree, PyTree]:
    """:func:`init_sharded`'s ``(state, specs)`` with ``jax.ShapeDtypeStruct`` leaves: each
    array's global shape, dtype and sharding, the same tree and boxes. Nothing is compiled,
    run or allocated: lower a step against it (``jax.jit(step).lower(state, batch)``) to read
    the compiled program's collectives or memory before building the state. Arguments as
    :func:`init_sharded`'s.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> model = shard_module_params(nn.Dense, min_weight_size=0)(64)
    >>> state, specs = abstract_init(lambda r, x: model.init(r, x)["params"], make_mesh({"fsdp": 8}),
    ...                              (P(), P()), jax.random.key(0), jnp.ones((2, 32)))
    >>> kernel = state["kernel"].value
    >>> kernel.shape, kernel.sharding.spec, kernel.sharding.shard_shape(kernel.shape)
    ((32, 64), P(None, 'fsdp'), (32, 8))
    """
    _require_init_fn(init_fn)
    traced, programs = init_programs(init_fn, mesh, in_specs, args, None, False, check_vma)
    # (each program evaluated on shapes: the traced init runs again abstractly, no model call)
    leaves = [leaf for program in programs for leaf in jax.eval_shape(program, *args)]
    state = optimizer_state_shapes(_laid_out(traced, leaves, mesh), mesh)
    return state, specs_of(state, mesh)


def _laid_out(traced, leaves: list, mesh) -> PyTree:
    """The init's tree of ``leaves``' shapes, each with its sharding on ``mesh``."""
    laid_out = [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
        for leaf, spec in zip(leaves, traced.flat_specs, strict=True)
    ]
    return jax.tree.unflatten(traced.treedef, laid_out)


def init_programs(init_fn, mesh, in_specs, args, twin_init_fn, one_leaf_at_a_time, check_vma):
    """The trace of the sharded init and the jitted programs that build its leaves."""
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"init_sharded: mesh must be a jax.sharding.Mesh (e.g. fsdp_tp.make_mesh(...)), got "
            f"{type(mesh).__name__} {mesh!r}. Arguments go (init_fn, mesh, in_specs, *args); the "
            f"unsharded twin's init goes by keyword: twin_init_fn=..."
        )
    if twin_init_fn is not None and not callable(twin_init_fn):
        raise TypeError(f"init_sharded: twin_init_fn must be a function like init_fn, got {twin_init_fn!r}.")
    check_specs(args, in_specs, mesh, "init argument")
    init_fn = without_optimizer_state(init_fn)
    with watched_init(mesh, check_vma):  # (a front end's layers checked against the model, after)
        traced = trace_per_device(init_fn, mesh, in_specs, args, check_vma=check_vma)
    count = len(traced.flat_specs)
    groups = _groups(count, 1 if one_leaf_at_a_time else _LEAVES_PER_PROGRAM)
    if twin_init_fn is None:
        programs = [
            jax.jit(
                jax.shard_map(
                    _picking(traced.jaxpr, group),
                    mesh=mesh,
                    in_specs=in_specs,
                    out_specs=[traced.flat_specs[i] for i in group],
                    check_vma=check_vma,
                )
            )
            for group in groups
        ]
        return traced, programs
    twin_init_fn = without_optimizer_state(twin_init_fn)
    twin = jax.make_jaxpr(lambda *inner: jax.tree.leaves(twin_init_fn(*inner)))(*args)
    if len(twin.out_avals) != count:
        raise SpecTreeMismatchError(
            f"init_sharded: twin_init_fn returns {len(twin.out_avals)} arrays, init_fn {count}; the twin "
            f"must build the same state with the unsharded model (same parameter tree, same optimizer)."
        )
    shardings = [NamedSharding(mesh, spec) for spec in traced.flat_specs]
    return traced, [
        jax.jit(_picking(twin, group), out_shardings=[shardings[i] for i in group]) for group in groups
    ]


def _groups(count: int, most: int) -> list[list[int]]:
    """``range(count)`` cut into the fewest runs of at most ``most`` leaves, of near-equal size.

    >>> [len(group) for group in _groups(390, 100)], _groups(98, 100) == [list(range(98))], _groups(3, 1)
    ([97, 98, 97, 98], True, [[0], [1], [2]])
    """
    programs = max(1, -(-count // most))  # no leaves: one program that returns none
    bounds = [i * count // programs for i in range(programs + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _picking(jaxpr, group: list[int]):
    """A function of the init's arguments that runs a traced program (no model is traced
    again) and keeps the leaves in ``group``; XLA drops what they do not need (the other
    leaves' random bits)."""
    run = jaxpr_as_fun(jaxpr)

    def pick(*args):
        leaves = run(*jax.tree.leaves(args))
        return [leaves[i] for i in group]

    return pick

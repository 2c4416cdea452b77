"""Sharded init: the train state built straight into its shardings, equal to the unsharded init.

:func:`init_sharded` runs the sharded model's init per device under
``shard_map`` (each device computes a parameter in full, keeps its block);
:func:`init_direct` runs the unsharded twin's init under ``jax.jit`` with the
derived ``out_shardings``, so XLA computes only each device's blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ._types import PyTree, Specs
from .errors import SpecTreeMismatchError
from .partitioning import _is_spec, check_specs, derive_specs, specs_of

__all__ = ["direct_init_programs", "init_direct", "init_sharded", "lower_init"]


def init_sharded(
    init_fn: Callable, mesh: Mesh, in_specs: Specs, *args, check_vma: bool = True
) -> tuple[PyTree, PyTree]:
    """Runs ``init_fn`` per device under ``shard_map`` and returns ``(state, specs)``.

    The state comes back as global arrays laid out by the derived specs; no
    device ever holds more than its shards plus the parameter being sliced.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> model = shard_module_params(nn.Dense, min_weight_size=0)(8)
    >>> init_fn = lambda rng, x: model.init(rng, x)["params"]
    >>> params, specs = init_sharded(init_fn, mesh, (P(), P(("data", "fsdp"))), jax.random.key(0),
    ...                              jnp.ones((8, 4)))
    >>> specs["kernel"], params["kernel"].value.shape   # global shape; each device holds (4, 2)
    (P(None, 'fsdp'), (4, 8))
    >>> params["kernel"].value.addressable_shards[0].data.shape
    (4, 2)
    """
    init, structure, _ = _flat_init(init_fn, mesh, in_specs, args, check_vma)
    leaves = init(*args)  # traces flat_init, which records the treedef
    state = jax.tree.unflatten(structure["treedef"], leaves)
    return state, specs_of(state)


def lower_init(init_fn: Callable, mesh: Mesh, in_specs: Specs, *args, check_vma: bool = True):
    """The ``jax.stages.Lowered`` init that :func:`init_sharded` runs: compile it to read its
    ``memory_analysis()`` (no device ever holds the whole state) or its HLO.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> model = shard_module_params(nn.Dense, min_weight_size=0)(64, use_bias=False)
    >>> lowered = lower_init(lambda r, x: model.init(r, x)["params"], make_mesh({"data": 2, "fsdp": 4}),
    ...                      (P(), P()), jax.random.key(0), jnp.ones((2, 32)))
    >>> lowered.compile().memory_analysis().output_size_in_bytes   # 32 * 64 * 4 bytes / 4 devices
    2048
    """
    init, _, _ = _flat_init(init_fn, mesh, in_specs, args, check_vma)
    return init.lower(*args)


def init_direct(
    twin_init_fn: Callable,
    init_fn: Callable,
    mesh: Mesh,
    in_specs: Specs,
    *args,
    check_vma: bool = True,
    one_leaf_at_a_time: bool = False,
) -> tuple[PyTree, PyTree]:
    """Like :func:`init_sharded`, but each device computes only its own blocks.

    ``twin_init_fn`` builds the same state with the unsharded twin of the
    model (same tree, same init: DESIGN.md invariants 1 and 2); it runs under
    ``jax.jit`` with ``out_shardings`` from the specs of ``init_fn``, so XLA
    partitions the init (JAX's partitionable threefry draws each block's
    random bits where it lives) and no device materializes the whole state.
    The result has ``init_fn``'s tree and boxes, ready for the sharded step.

    In one program XLA may keep several parameters' random-bit temporaries alive
    at once. ``one_leaf_at_a_time=True`` compiles one program per leaf instead
    (the same values, bit for bit): a device then holds at most its shards made
    so far plus one leaf's temporaries, i.e. under ``state / N + the largest
    parameter``, at the price of a compile per leaf (:func:`direct_init_programs`
    gives the programs, to measure them).

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh, shard_module_params
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> sharded, twin = shard_module_params(nn.Dense, min_weight_size=0)(64), nn.Dense(64)
    >>> args = (jax.random.key(0), jnp.ones((2, 32)))
    >>> direct, specs = init_direct(lambda r, x: twin.init(r, x)["params"],
    ...                             lambda r, x: sharded.init(r, x)["params"], mesh, (P(), P()), *args)
    >>> via_shard_map, _ = init_sharded(lambda r, x: sharded.init(r, x)["params"], mesh, (P(), P()), *args)
    >>> specs["kernel"], bool((direct["kernel"].value == via_shard_map["kernel"].value).all())
    (P(None, 'fsdp'), True)
    """
    programs, treedef = _direct_programs(
        twin_init_fn, init_fn, mesh, in_specs, args, check_vma, one_leaf_at_a_time
    )
    leaves = [leaf for program in programs for leaf in program(*args)]
    state = jax.tree.unflatten(treedef, leaves)  # the twin's leaves fill the sharded tree
    return state, specs_of(state)


def direct_init_programs(
    twin_init_fn: Callable,
    init_fn: Callable,
    mesh: Mesh,
    in_specs: Specs,
    *args,
    check_vma: bool = True,
    one_leaf_at_a_time: bool = False,
) -> list:
    """The jitted programs :func:`init_direct` runs, in order; each returns a list of leaves.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh, shard_module_params
    >>> sharded, twin = shard_module_params(nn.Dense, min_weight_size=0)(64), nn.Dense(64)
    >>> args = (jax.random.key(0), jnp.ones((2, 32)))
    >>> programs = direct_init_programs(lambda r, x: twin.init(r, x)["params"],
    ...                                 lambda r, x: sharded.init(r, x)["params"],
    ...                                 make_mesh({"fsdp": 8}), (P(), P()), *args, one_leaf_at_a_time=True)
    >>> [p.lower(*args).compile().memory_analysis().output_size_in_bytes for p in programs]  # 1/8 of each
    [32, 1024]
    """
    programs, _ = _direct_programs(twin_init_fn, init_fn, mesh, in_specs, args, check_vma, one_leaf_at_a_time)
    return programs


def _direct_programs(twin_init_fn, init_fn, mesh, in_specs, args, check_vma: bool, one_leaf_at_a_time: bool):
    # The sharded init gives the specs and, traced abstractly, the tree with its boxes.
    sharded, structure, flat_specs = _flat_init(init_fn, mesh, in_specs, args, check_vma)
    jax.eval_shape(sharded, *args)
    shardings = [NamedSharding(mesh, spec) for spec in flat_specs]
    leaves = jax.eval_shape(lambda *inner: jax.tree.leaves(twin_init_fn(*inner)), *args)
    if len(leaves) != len(flat_specs):
        raise SpecTreeMismatchError(
            f"init_direct: twin_init_fn returns {len(leaves)} arrays, init_fn {len(flat_specs)}; the twin "
            f"must build the same state with the unsharded model (same parameter tree, same optimizer)."
        )
    groups = [[i] for i in range(len(leaves))] if one_leaf_at_a_time else [list(range(len(leaves)))]

    def program(group: list[int]):
        # XLA drops what the group's outputs do not need: the other leaves' random bits.
        pick = lambda *inner: [jax.tree.leaves(twin_init_fn(*inner))[i] for i in group]
        return jax.jit(pick, out_shardings=[shardings[i] for i in group])

    return [program(group) for group in groups], structure["treedef"]


def _flat_init(init_fn: Callable, mesh: Mesh, in_specs: Specs, args: tuple, check_vma: bool):
    check_specs(args, in_specs, mesh, "init argument")
    # One spec per array leaf (a box holds one array), so the init's out_specs
    # do not depend on static metadata: an optimizer built inside init_fn is a
    # new object on every trace, and would not match a spec tree from another.
    flat_specs = jax.tree.leaves(
        derive_specs(init_fn, mesh, in_specs, *args, check_vma=check_vma), is_leaf=_is_spec
    )
    structure: dict[str, Any] = {}

    def flat_init(*inner):
        leaves, structure["treedef"] = jax.tree.flatten(init_fn(*inner))
        return leaves

    init = jax.jit(
        jax.shard_map(flat_init, mesh=mesh, in_specs=in_specs, out_specs=flat_specs, check_vma=check_vma)
    )
    return init, structure, flat_specs

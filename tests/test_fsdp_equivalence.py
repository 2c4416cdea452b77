"""docs/design.md invariants 1-6 for data parallelism and FSDP, against the unsharded run."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp_tp
from fsdp_tp.bench.baselines import tutorial_sync_gradients
from fsdp_tp.testing import Reference
from tests.conftest import MESHES, WIDTHS, mesh_of, replicated_ok
from tests.equivalence import Case, check_equivalence
from tests.models import MLP, Block, ScanMLP


def sum_assuming_sync(grads, axis_names):
    """Divides where it should pmean: right only if JAX had summed (check_vma=True)."""
    size = jax.lax.axis_size(axis_names)
    return jax.tree.map(
        lambda g: g / size if not isinstance(g, nn.Partitioned) else g,
        grads,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )


@st.composite
def mlp_cases(draw):
    data, fsdp = draw(st.sampled_from(MESHES))
    features = tuple(draw(st.lists(WIDTHS, min_size=1, max_size=4)))
    use_bias = draw(st.booleans())
    strategy = draw(st.sampled_from(["fsdp", "dp"]))
    dense = nn.Dense
    if strategy == "fsdp":
        min_size = draw(st.sampled_from([0, 8, 64, 2**18]))
        dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=min_size)
    return Case(
        model=MLP(features, use_bias, dense),
        reference=MLP(features, use_bias),
        mesh=mesh_of(data, fsdp),
        batch_axes=("data", "fsdp"),
        check_vma=draw(st.booleans()),
        in_dim=draw(WIDTHS),
        out_dim=features[-1],
        seed=draw(st.integers(0, 2**16)),
    )


@replicated_ok
@given(mlp_cases())
def test_mlp_equals_unsharded(case):
    check_equivalence(case)


EVERY_MESH = Reference()  # (one unsharded run for the meshes and modes below, a test process)


@replicated_ok
@pytest.mark.parametrize("check_vma", [True, False])
def test_every_mesh_and_both_modes(check_vma):
    """The drawn cases above are few in CI; this pins one FSDP case per mesh and mode, each
    against the one unsharded run (a Reference: computed by the first, read by the others)."""
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=0)
    for data, fsdp in MESHES:
        check_equivalence(
            Case(
                MLP((16, 8), True, dense),
                MLP((16, 8), True),
                mesh_of(data, fsdp),
                ("data", "fsdp"),
                check_vma,
                in_dim=12,
                out_dim=8,
            ),
            steps=1,
            reference=EVERY_MESH,
        )
    assert EVERY_MESH.computed == 1


@replicated_ok
@pytest.mark.parametrize(
    ("check_vma", "wrong_sync"), [(True, tutorial_sync_gradients), (False, sum_assuming_sync)]
)
def test_negative_control_wrong_sync_is_caught(check_vma, wrong_sync):
    """The property must fail on a sync that ignores how the gradient was reduced."""
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=64)
    case = Case(
        MLP((16, 4), True, dense),
        MLP((16, 4), True),
        mesh_of(2, 4),
        ("data", "fsdp"),
        check_vma,
        in_dim=8,
        out_dim=4,
    )
    with pytest.raises(AssertionError, match="grads"):
        check_equivalence(case, sync=wrong_sync)


@replicated_ok
@settings(max_examples=max(2, settings().max_examples // 2))
@given(
    mesh=st.sampled_from(MESHES[1:]),
    check_vma=st.booleans(),
    depth=st.integers(1, 3),
    width=st.sampled_from([8, 16, 12]),
)
def test_scan_over_remat_blocks_equals_unsharded(mesh, check_vma, depth, width):
    shard = lambda target: fsdp_tp.shard_module_params(target, "fsdp", min_weight_size=0)
    model = ScanMLP(width, depth, out_dim=4, dense=shard(nn.Dense), block=shard(Block))
    reference = ScanMLP(width, depth, out_dim=4)
    check_equivalence(
        Case(model, reference, mesh_of(*mesh), ("data", "fsdp"), check_vma, in_dim=6, out_dim=4)
    )


@replicated_ok
@pytest.mark.parametrize("check_vma", [True, False])
def test_transform_applied_for_two_axes_equals_unsharded(check_vma):
    """Sharding over fsdp, then over data: every device holds 1/8 of each kernel."""
    dense = fsdp_tp.shard_module_params(
        fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=0), "data", min_weight_size=0
    )
    case = Case(
        MLP((16, 8), True, dense),
        MLP((16, 8), True),
        mesh_of(2, 4),
        ("data", "fsdp"),
        check_vma,
        in_dim=12,
        out_dim=8,
    )
    check_equivalence(case)
    specs = fsdp_tp.partitioning.derive_specs(
        lambda r, x: dense(16).init(r, x)["params"],
        case.mesh,
        (jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(case.batch_axes)),
        jax.random.key(0),
        jax.numpy.ones((16, 12)),
        check_vma=check_vma,
    )
    assert specs["kernel"] == jax.sharding.PartitionSpec("data", "fsdp")


@pytest.mark.parametrize("check_vma", [True, False])
def test_modules_with_setup_are_sharded_and_gathered_in_their_own_scope(check_vma):
    """Regression: a wrapped method ran setup() outside the mapped scope, on the raw shards."""
    from tests.models import SetupLayer

    layer = fsdp_tp.shard_module_params(SetupLayer, "fsdp", min_weight_size=0)
    check_equivalence(
        Case(
            model=MLP((8, 16), dense=lambda width, use_bias: layer(width)),
            reference=MLP((8, 16), dense=lambda width, use_bias: SetupLayer(width)),
            mesh=mesh_of(2, 4),
            batch_axes=("data", "fsdp"),
            check_vma=check_vma,
            in_dim=6,
            out_dim=16,
        )
    )

"""Issue 33: Flax NNX models get the library's promise, on the same core as Linen."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import meta
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx
from fsdp_tp._check.driver import switched_off
from fsdp_tp.errors import RuleError
from fsdp_tp.nnx._read import ReadPlan
from fsdp_tp.testing import NNXSharded as Sharded
from fsdp_tp.testing import NNXTwin as Twin
from tests.conftest import mesh_of
from tests.equivalence import Case, check_equivalence
from tests.nnx_models import MLPStack, NormDropNet


def _make(scan: bool):
    return lambda rngs: MLPStack(4, 8, 4, 2, scan=scan, rngs=rngs)


def _rules(scan: bool):
    return [("blocks/.*kernel$", P(None, "fsdp") if scan else P("fsdp")), ("kernel$", P("fsdp"))]


@pytest.mark.parametrize("scan, check_vma", [(False, True), (True, False), (False, False), (True, True)])
def test_fsdp_by_rules_equals_unsharded(scan, check_vma):
    make = _make(scan)
    case = Case(Sharded(make, _rules(scan)), Twin(make), mesh_of(2, 4, 1), ("data", "fsdp"), check_vma, 4, 4)
    check_equivalence(case)


# (data, fsdp, tensor) over 8 devices: FSDP alone, with data parallelism, with Megatron TP.
NNX_MESHES = [(1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2), (4, 1, 2), (1, 2, 4)]


def _fsdp_tp_rules(scan: bool) -> tuple[list, list]:
    """Storage rules that split over fsdp the dim the tp rules leave whole, and the tp rules:
    each block's up column-parallel, its down row-parallel (a stacked block: layer dim first)."""
    lead = (None,) if scan else ()
    storage = [
        (r"blocks/.*up/kernel$", P(*lead, "fsdp", None)),
        (r"blocks/.*down/kernel$", P(*lead, None, "fsdp")),
        (r"^(embed|head)/kernel$", P("fsdp")),
    ]
    tp = [
        (r"blocks(/\d+)?/up$", fsdp_tp.tp.ColumnParallel()),
        (r"blocks(/\d+)?/down$", fsdp_tp.tp.RowParallel()),
    ]
    return storage, tp


@given(
    mesh=st.sampled_from(NNX_MESHES),
    scan=st.booleans(),
    check_vma=st.booleans(),
    layers=st.integers(1, 3),
    widths=st.sampled_from([(8, 8, 4), (16, 8, 2), (8, 16, 4)]),
    seed=st.integers(0, 2**16),
)
def test_fsdp_by_rules_with_megatron_tp_equals_unsharded(mesh, scan, check_vma, layers, widths, seed):
    """Issue 33 point 6: invariants 1-6 drawn for an NNX model (a loop of blocks or an
    nnx.scan stack) on any of the meshes: the same tree, init bit for bit, outputs, loss,
    gradients and parameters after 3 SGD and 3 AdamW steps, in both check_vma modes. The
    negative controls below (a gather that slices the gradient) and test_tp_rules' (a row
    bias added on every device, no f) fail the same checks."""
    _check_fsdp_tp(mesh, scan, check_vma, layers, widths, seed)


def _check_fsdp_tp(mesh, scan, check_vma, layers, widths, seed=0):
    d_in, d, d_out = widths
    make = lambda rngs: MLPStack(d_in, d, d_out, layers, scan=scan, rngs=rngs)
    storage, tp = _fsdp_tp_rules(scan)
    sharded = Sharded(make, storage, tp_rules=tp if mesh[2] > 1 else ())
    case = Case(sharded, Twin(make), mesh_of(*mesh), ("data", "fsdp"), check_vma, d_in, d_out, seed=seed)
    check_equivalence(case)


def test_negative_control_a_row_layer_without_its_sum(monkeypatch):
    """The property above on a TP mesh, with each row layer's partial products left unsummed
    over tensor: the outputs differ, and the check says so."""
    from fsdp_tp import tp

    def unsummed(self, method, run, layer, args, kwargs):
        bias = layer.bias() if layer.use_bias and layer.bias is not None else None
        return tp.pieces.add_bias_once(run(*args, **kwargs), bias, self.axis, dtype=layer.dtype)

    monkeypatch.setattr(tp.RowParallel, "around", unsummed)
    with pytest.raises(AssertionError, match="output"), switched_off():
        _check_fsdp_tp((2, 2, 2), scan=True, check_vma=False, layers=2, widths=(8, 8, 4))
    # The plan check refuses it before anything trains: the bias meets the partial sums.
    with pytest.raises(RuleError, match=r"RowParallel\(\).*add adds a value whole on every device"):
        _check_fsdp_tp((2, 2, 2), scan=True, check_vma=False, layers=2, widths=(8, 8, 4))


def test_a_rule_that_splits_a_scanned_stack_s_layer_dim_is_named():
    """An nnx.vmap stack's layer dim carries no mark; nnx.scan fails on it with jax's
    "different leading axis sizes". The error names the rules' first-dim splits and the fix."""
    make = _make(scan=True)  # 2 stacked layers, split over fsdp 2
    sharded = Sharded(make, [("kernel$", P("fsdp"))])
    case = Case(sharded, Twin(make), mesh_of(4, 2, 1), ("data", "fsdp"), True, 4, 4)
    named = (
        r"Rules split the first dim of blocks/down/kernel, blocks/up/kernel, .*start those specs with None"
    )
    with pytest.raises(fsdp_tp.errors.RuleError, match=named):
        check_equivalence(case)


def test_negative_control_a_gather_that_slices_the_gradient(monkeypatch):
    """A read whose backward keeps this device's slice over the batch axes (a gather without
    FSDP's mean reduce-scatter): each device's gradient is its own batch shard's, not the mean."""
    original = ReadPlan.read
    monkeypatch.setattr(
        ReadPlan,
        "read",
        lambda self, block: original(dataclasses.replace(self, batch_axes=frozenset()), block),
    )
    make = _make(False)
    case = Case(Sharded(make, _rules(False)), Twin(make), mesh_of(2, 4, 1), ("data", "fsdp"), False, 4, 4)
    with pytest.raises(AssertionError, match="grads"):
        check_equivalence(case)


def _norm_drop_step(check_vma: bool):
    """The whole path of a user: state_init_fn -> init_sharded -> shard_step, on a model with
    BatchNorm statistics and dropout rngs (model_state), data 2 x fsdp 4."""
    mesh = mesh_of(2, 4, 1)
    batch = ("data", "fsdp")
    sharded = fsdp_tp.nnx.shard_by_rules(lambda rngs: NormDropNet(4, 8, 4, rngs), [("kernel$", P("fsdp"))])
    state, specs = fsdp_tp.init_sharded(
        sharded.state_init_fn(optax.sgd(0.1)), mesh, P(), jax.random.key(0), check_vma=check_vma
    )

    def step_fn(state, x):
        def loss_fn(params):
            model = sharded.merge(params, state.model_state)
            loss = jnp.mean(model(x) ** 2)
            return loss, sharded.model_state(model)

        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        # each device's statistics of its shard, averaged (rng keys and counts are the same everywhere)
        model_state["BatchStat"] = fsdp_tp.gradients.batch_mean(model_state["BatchStat"], batch)
        return fsdp_tp.sync_gradients(grads, batch), jax.lax.pmean(loss, batch), model_state

    return state, fsdp_tp.shard_step(step_fn, mesh, specs, P(batch), check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_step_updates_batch_statistics_and_rng_counts_as_the_twin(check_vma):
    """BatchNorm's running mean after one step is the twin's (each device's statistics of its
    batch shard, averaged: the global batch's), and the dropout stream advanced by one draw.
    The model normalizes each shard by its own statistics (no ``axis_name``), another function
    than the unsharded model's: the whole step's check refuses it at the norm's line (issue 99);
    off, the step's model state is what this test reads."""
    x = jax.random.normal(jax.random.key(1), (16, 4))
    state, step = _norm_drop_step(check_vma)
    assert jax.tree.leaves(state.model_state["BatchStat"])  # mean and var, as the model holds them
    with pytest.raises(
        RuleError, match=r"nnx_models.py:\d+ \(NormDropNet.__call__\).*reads the partial sums"
    ):
        step(state, x)
    with switched_off():
        state, _ = step(state, x)

    twin = NormDropNet(4, 8, 4, nnx.Rngs(0))
    twin(x)  # one training call: its statistics move as the sharded step's did
    np.testing.assert_allclose(
        np.asarray(state.model_state["BatchStat"]["norm"]["mean"]),
        np.asarray(twin.norm.mean[...]),
        rtol=1e-6,
        atol=1e-7,
    )
    counts = [int(c) for c in jax.tree.leaves(state.model_state["RngCount"])]
    assert counts == [int(c) for c in jax.tree.leaves(nnx.state(twin, nnx.RngCount))] == [1]


def test_each_batch_shard_draws_its_own_dropout_mask():
    """The same rows on every device: the data shards' dropout masks differ (a key folded over
    the batch axes), so data parallelism does not repeat one mask N times."""
    sharded = fsdp_tp.nnx.shard_by_rules(lambda rngs: NormDropNet(4, 8, 4, rngs))
    params, model_state = jax.jit(sharded.init)(jax.random.key(0))
    mesh = mesh_of(2, 4, 1)
    x = jnp.ones((8, 4))  # every device gets these 8 rows

    def masks(params, model_state, x):
        model = sharded.merge(params, model_state)
        return model.drop(jnp.ones_like(x))[None]

    out = jax.jit(
        jax.shard_map(
            masks, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P(("data", "fsdp")), check_vma=False
        )
    )(params, model_state, x)
    assert len({np.asarray(m).tobytes() for m in out}) == 8


class Annotated(nnx.Module):
    """A kernel annotated as NNX users do (``nnx.with_partitioning``): with mesh axes, or
    with logical names."""

    def __init__(self, names: tuple, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        self.up = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.up(x))


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize(
    "names, logical, expected",
    [
        ((None, "fsdp"), None, P(None, "fsdp")),
        (("embed", "mlp"), [("mlp", "fsdp"), ("embed", None)], P(None, "fsdp")),
    ],
    ids=["mesh-axes", "logical-names"],
)
def test_the_models_own_annotations_lay_it_out_where_no_rule_matches(names, logical, expected, eager):
    """Mesh-axis annotations are taken as they are, logical names go through logical_axis_rules
    (flax's semantics), a rule wins over an annotation; the init equals the unsharded one bit
    for bit whether flax's eager sharding is on or off around the caller."""
    make = lambda rngs: Annotated(names, rngs)
    with nnx.use_eager_sharding(eager):
        sharded = fsdp_tp.nnx.shard_by_rules(make, [("up/bias$", P("fsdp"))], logical_axis_rules=logical)
        params, specs = fsdp_tp.init_sharded(
            lambda r: sharded.init(r)[0], mesh_of(2, 4, 1), P(), jax.random.key(0)
        )
    assert specs["up"] == {"kernel": expected, "bias": P("fsdp")}
    with nnx.use_eager_sharding(False):
        twin = nnx.state(make(nnx.Rngs(0)), nnx.Param)
    for path, variable in nnx.to_flat_state(twin):
        leaf = params[path[0]][path[1]]
        np.testing.assert_array_equal(np.asarray(getattr(leaf, "value", leaf)), np.asarray(variable[...]))


def _per_device_bytes(tree) -> int:
    leaves = jax.tree.leaves(meta.unbox(tree))
    return sum(
        leaf.addressable_shards[0].data.nbytes for leaf in leaves if hasattr(leaf, "addressable_shards")
    )


def test_plan_and_checkpoints_take_an_nnx_state_restored_on_another_mesh(tmp_path):
    """make_plan counts the NNX state's bytes per device exactly as init_sharded lays it out;
    Checkpoints saves it on data 2 x fsdp 4 and restores it on data 4 x fsdp 2 (another layout of the
    same global arrays), bit for bit."""
    make = _make(True)
    sharded = fsdp_tp.nnx.shard_by_rules(make, _rules(True))
    init = sharded.state_init_fn(optax.adamw(1e-2))
    saved_mesh, other_mesh = mesh_of(2, 4, 1), mesh_of(4, 2, 1)
    state, _ = fsdp_tp.init_sharded(init, saved_mesh, P(), jax.random.key(0))
    plan = fsdp_tp.make_plan(init, saved_mesh, P(), jax.random.key(0))
    assert plan.param_bytes == _per_device_bytes(state.params)
    assert plan.optimizer_bytes == _per_device_bytes(state.opt_state)

    like, _ = fsdp_tp.init_sharded(init, other_mesh, P(), jax.random.key(1))
    with fsdp_tp.Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(1, state)
        checkpoints.wait()
        restored, _ = checkpoints.restore(like)
    plain = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    got_leaves, want_leaves = jax.tree.leaves(meta.unbox(restored)), jax.tree.leaves(meta.unbox(state))
    for got, want in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(plain(got)), np.asarray(plain(want)))
    kernel = restored.params["blocks"]["up"]["kernel"]
    assert kernel.value.sharding.mesh.shape == other_mesh.shape

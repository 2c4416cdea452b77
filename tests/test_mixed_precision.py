"""Mixed-precision FSDP gathers (issue 15 point 5): parameters all-gathered in a narrower
dtype, gradients reduce-scattered in f32 or in that dtype, as PyTorch FSDP2's policy does.

What is exact here: the bytes on the wire, and the equality with the unsharded twin that
computes with the same casts (its large parameters rounded to bf16 on the way in, the
gradient passed straight through, as the gather's backward pass does)."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives
from fsdp_tp.testing import NNXSharded
from fsdp_tp.testing import NNXTwin as Twin
from tests.conftest import BATCH_AXES, mesh_of, total
from tests.equivalence import Case, batches, check_equivalence, step_program, train_state
from tests.models import MLP
from tests.nnx_models import MLPStack
from tests.test_fsdp_equivalence import MESHES, WIDTHS, replicated_ok
from tests.test_memory_and_communication import BIAS_BYTES, FEATURES, IN_DIM, KERNEL_BYTES, MIN_SIZE
from tests.test_memory_and_communication import step_collectives as _fsdp_step_collectives

BF16 = jnp.bfloat16


def _dense(policy, dtype=None):
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", MIN_SIZE, mixed_precision=policy)
    return functools.partial(dense, dtype=dtype) if dtype is not None else dense


def _case(policy, twin_casts: bool, check_vma: bool, shape=(2, 4)) -> Case:
    return Case(
        model=MLP(FEATURES, True, _dense(policy)),
        reference=MLP(FEATURES),
        twin_reads=fsdp_tp.MixedPrecision(BF16).round if twin_casts else lambda params: params,
        mesh=mesh_of(*shape),
        batch_axes=BATCH_AXES,
        check_vma=check_vma,
        in_dim=IN_DIM,
        out_dim=FEATURES[-1],
    )


@st.composite
def mixed_cases(draw):
    """Any FSDP MLP and mesh (widths that no axis divides included: those kernels stay
    whole, and are read rounded all the same), gathered in bf16, reduced in f32."""
    data, fsdp = draw(st.sampled_from(MESHES))
    features = tuple(draw(st.lists(WIDTHS, min_size=1, max_size=3)))
    dense = fsdp_tp.shard_module_params(
        nn.Dense, "fsdp", draw(st.sampled_from([0, 64, 2**18])), mixed_precision=fsdp_tp.MixedPrecision(BF16)
    )
    return Case(
        model=MLP(features, True, dense),
        reference=MLP(features),
        twin_reads=fsdp_tp.MixedPrecision(BF16).round,
        mesh=mesh_of(data, fsdp),
        batch_axes=BATCH_AXES,
        check_vma=draw(st.booleans()),
        in_dim=draw(WIDTHS),
        out_dim=features[-1],
        seed=draw(st.integers(0, 2**16)),
    )


@replicated_ok
@settings(max_examples=max(2, settings().max_examples // 2))
@given(mixed_cases())
def test_equals_the_twin_computing_with_the_same_casts(case):
    """Invariants 1-5 at the f32 tolerances (init, output, loss, gradients, SGD and AdamW
    steps) against the twin computing on ``MixedPrecision.round(params)``, on every mesh."""
    check_equivalence(case)


def _by_rules(api: str, policy) -> Case:
    """The twin-with-casts case of a model laid out by ``shard_by_rules`` over the whole model:
    Linen's MLP, or an NNX stack of residual blocks (LayerNorm, Linear, gelu, Linear) in
    ``nnx.scan`` over ``nnx.remat``, its kernels split over fsdp, its biases and norms whole."""
    case = _case(policy, True, False)
    if api == "linen":
        rules = [("Dense_0/kernel", P(None, "fsdp")), ("Dense_1/kernel", P("fsdp", None))]
        model = fsdp_tp.shard_by_rules(MLP, rules, mixed_precision=policy)(FEATURES)
        return dataclasses.replace(case, model=model)
    make = lambda rngs: MLPStack(IN_DIM, 16, FEATURES[-1], 2, scan=True, rngs=rngs)
    rules = [("blocks/.*kernel$", P(None, None, "fsdp")), ("kernel$", P(None, "fsdp"))]
    model = NNXSharded(make, rules, mixed_precision=policy)
    return dataclasses.replace(case, model=model, reference=Twin(make))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_rules_gather_the_same_way(api):
    """``shard_by_rules`` of either front end: the kernels gathered in bf16, every other
    parameter read rounded all the same, equal to the twin computing on the rounded
    parameters (invariants 1-5 at the f32 tolerances)."""
    check_equivalence(_by_rules(api, fsdp_tp.MixedPrecision(BF16)))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_negative_control_the_twin_without_the_casts_differs(api):
    case = _by_rules(api, fsdp_tp.MixedPrecision(BF16))
    with pytest.raises(AssertionError):
        check_equivalence(dataclasses.replace(case, twin_reads=lambda params: params), steps=1)


def _lowered_by_rules(api: str, policy) -> list:
    """The collectives :func:`_by_rules`'s train step asks for (lowered: see _step_collectives)."""
    case = _by_rules(api, policy)
    x, y = next(batches(case, 1))
    rng = jax.random.key(0)
    init = lambda r, x: case.model.init(r, x)["params"]
    params, _ = fsdp_tp.init_sharded(init, case.mesh, (P(), P(BATCH_AXES)), rng, x, check_vma=False)
    state, specs = train_state(case.comparison, optax.sgd(0.1), params, rng)
    return parse_collectives(step_program(case, specs).lower(state, (x, y)).as_text(dialect="hlo"))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_by_rules_gathers_move_half_the_bytes(api):
    """Either front end: the same gathers and reduce-scatters as in f32, the gathers in bf16."""
    found, f32 = (_lowered_by_rules(api, policy) for policy in (fsdp_tp.MixedPrecision(BF16), None))
    for kind in ("all-gather", "reduce-scatter"):
        assert total(found, kind, "operands") == total(f32, kind, "operands") > 0, kind
    assert total(found, "all-gather") * 2 == total(f32, "all-gather")
    assert total(found, "reduce-scatter") == total(f32, "reduce-scatter")  # reduced in f32


def _step_collectives(policy, check_vma: bool):
    return _fsdp_step_collectives((2, 4), check_vma, policy, lowered=True)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("reduce_dtype", [jnp.float32, BF16])
def test_gathers_move_half_the_bytes_and_reduce_in_the_chosen_dtype(reduce_dtype, check_vma):
    found = _step_collectives(fsdp_tp.MixedPrecision(BF16, reduce_dtype), check_vma)
    f32 = _step_collectives(None, check_vma)
    # One all-gather per sharded kernel and one reduce-scatter per kernel gradient, as in f32.
    assert total(found, "all-gather", "operands") == total(found, "reduce-scatter", "operands") == 3
    assert total(found, "all-gather") * 2 == total(f32, "all-gather") == KERNEL_BYTES // 4
    reduce_itemsize = jnp.dtype(reduce_dtype).itemsize
    assert total(found, "reduce-scatter") == KERNEL_BYTES * reduce_itemsize // 4
    # Replicated (bias) gradients and kernel shards over `data`: all-reduced in f32, unchanged.
    assert total(found, "all-reduce", min_group=2) == total(f32, "all-reduce", min_group=2)
    assert total(f32, "all-reduce", min_group=2) == BIAS_BYTES + KERNEL_BYTES // 4


def _loss_and_grads(policy, dense_dtype, check_vma: bool):
    mesh = mesh_of(2, 4)
    model = MLP(FEATURES, True, _dense(policy, dense_dtype))
    x = jax.random.normal(jax.random.key(1), (16, IN_DIM))
    params, specs = fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"],
        mesh,
        (P(), P(BATCH_AXES)),
        jax.random.key(0),
        x,
        check_vma=check_vma,
    )

    def fb(params, x):
        loss, grads = jax.value_and_grad(lambda p: (model.apply({"params": p}, x) ** 2).mean())(params)
        return jax.lax.pmean(loss, BATCH_AXES), fsdp_tp.sync_gradients(grads, BATCH_AXES)

    step = jax.shard_map(
        fb, mesh=mesh, in_specs=(specs, P(BATCH_AXES)), out_specs=(P(), specs), check_vma=check_vma
    )
    return jax.jit(step)(params, x)


@pytest.mark.parametrize("check_vma", [True, False])
def test_bf16_compute_gathering_bf16_and_reducing_f32_is_bit_identical(check_vma):
    """A model that computes in bf16 casts each gathered kernel to bf16 anyway: casting the
    shard before the gather moves half the bytes and changes no bit of loss or gradient."""
    plain = _loss_and_grads(None, BF16, check_vma)
    mixed = _loss_and_grads(fsdp_tp.MixedPrecision(BF16, jnp.float32), BF16, check_vma)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Negative control: reducing in bf16 rounds the gradient, so the same check fails.
    rounded = _loss_and_grads(fsdp_tp.MixedPrecision(BF16, BF16), BF16, check_vma)
    differs = [
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(rounded), jax.tree.leaves(plain), strict=True)
    ]
    assert any(differs)


def test_bf16_reduction_stays_within_its_rounding():
    """Reduced in bf16, a kernel gradient is the f32 one up to bf16 rounding: fsdp=4 partials,
    each rounded once (unit roundoff 2**-9), summed in 3 rounded adds: at most 7 * 2**-9,
    about 4 * 2**-8, of the largest partial (seen: 0.78 * 2**-8). In f32 nothing rounds."""
    f32 = _loss_and_grads(fsdp_tp.MixedPrecision(BF16, jnp.float32), None, True)[1]
    bf16 = _loss_and_grads(fsdp_tp.MixedPrecision(BF16, BF16), None, True)[1]
    for a, b in zip(jax.tree.leaves(nn.unbox(bf16)), jax.tree.leaves(nn.unbox(f32)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype == np.float32
        if a.size > MIN_SIZE:
            assert not np.array_equal(a, b)  # the reduction did run in bf16
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * 2**-8 * np.abs(b).max())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gather_dtype": jnp.int8}, r"gather_dtype int8 is not a floating dtype"),
        ({"gather_dtype": BF16, "reduce_dtype": "int32"}, r"reduce_dtype int32 is not a floating dtype"),
        ({"gather_dtype": "bf17"}, r"gather_dtype 'bf17' is not a dtype"),
    ],
)
def test_a_policy_that_is_not_floating_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsdp_tp.MixedPrecision(**kwargs)


def test_a_policy_where_none_goes_is_refused():
    with pytest.raises(
        TypeError, match=r"shard_module_params: mixed_precision must be a fsdp_tp.MixedPrecision"
    ):
        fsdp_tp.shard_module_params(nn.Dense, mixed_precision="bf16")
    with pytest.raises(ValueError, match=r"Layout: .* casts what FSDP gathers, but fsdp is None"):
        fsdp_tp.models.Layout(mixed_precision=fsdp_tp.MixedPrecision())

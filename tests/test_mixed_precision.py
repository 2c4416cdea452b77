"""Mixed-precision FSDP gathers (issue 15 point 5): parameters all-gathered in a narrower
dtype, gradients reduce-scattered in f32 or in that dtype, as PyTorch FSDP2's policy does;
and in 8 bits with a scale per parameter (issue 60: ``float8_e4m3fn``, ``float8_e5m2``).

What is exact here: the bytes on the wire, and the equality with the unsharded twin that
computes with the same casts (its large parameters rounded to bf16 on the way in, the
gradient passed straight through, as the gather's backward pass does)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

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
from fsdp_tp.sharded_init import abstract_init
from fsdp_tp.testing import NNXSharded
from fsdp_tp.testing import NNXTwin as Twin
from tests.conftest import BATCH_AXES, MESHES, WIDTHS, mesh_of, replicated_ok, total
from tests.equivalence import Case, batches, check_equivalence, step_program, train_state
from tests.fsdp_mlp import BIAS_BYTES, FEATURES, IN_DIM, KERNEL_BYTES, MIN_SIZE
from tests.fsdp_mlp import step_collectives as fsdp_step_collectives
from tests.models import MLP
from tests.nnx_models import MLPStack

BF16 = jnp.bfloat16


def _dense(policy, dtype=None):
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", MIN_SIZE, mixed_precision=policy)
    return functools.partial(dense, dtype=dtype) if dtype is not None else dense


def _case(policy, twin_casts: bool, check_vma: bool, shape=(2, 4)) -> Case:
    return Case(
        model=MLP(FEATURES, True, _dense(policy)),
        reference=MLP(FEATURES),
        twin_reads=policy.round if twin_casts and policy is not None else lambda params: params,
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
    # (the parameters' and the state's shapes: all lowering needs)
    params, _ = abstract_init(init, case.mesh, (P(), P(BATCH_AXES)), rng, x, check_vma=False)
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
    return fsdp_step_collectives((2, 4), check_vma, policy, lowered=True)


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


# ---- 8-bit gathers (issue 60): one byte an element on the wire, one scale per parameter ----

FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@pytest.mark.parametrize("dtype", FP8, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_fp8_gathers_equal_the_twin_on_the_same_rounding(api, dtype):
    """Invariants 1-5 at the f32 tolerances (outputs, loss, gradients, SGD and AdamW steps)
    against the twin computing on ``policy.round(params)``: each parameter scaled by its own
    largest magnitude, the sharded one by the max over its shards (both front ends; Linen's
    MLP, NNX's stack in ``nnx.scan`` over ``nnx.remat``)."""
    check_equivalence(_by_rules(api, fsdp_tp.MixedPrecision(dtype)))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_negative_control_the_twin_rounding_to_bf16_differs_from_fp8_gathers(api):
    case = _by_rules(api, fsdp_tp.MixedPrecision(jnp.float8_e4m3fn))
    with pytest.raises(AssertionError):
        check_equivalence(dataclasses.replace(case, twin_reads=fsdp_tp.MixedPrecision(BF16).round), steps=1)


_SHARDS = st.sampled_from([(2, "fsdp"), (4, "fsdp"), (8, "fsdp")])


@st.composite
def _parameters(draw):
    """A parameter of any shape whose dim 0 the shard count divides, with values from every
    range a scale must survive: zeros, one huge value among small ones, subnormals, normals."""
    shards, _ = draw(_SHARDS)
    shape = (shards * draw(st.integers(1, 3)), *draw(st.lists(st.integers(1, 5), max_size=2)))
    kind = draw(st.sampled_from(["zeros", "one huge", "subnormal", "normal"]))
    values = jax.random.normal(jax.random.key(draw(st.integers(0, 2**16))), shape)
    if kind == "zeros":
        values = jnp.zeros(shape)
    elif kind == "one huge":
        values = values.at[(draw(st.integers(0, shape[0] - 1)),) + (0,) * (len(shape) - 1)].set(3e38)
    elif kind == "subnormal":
        values = values * 1e-39
    return shards, values


@settings(max_examples=max(4, settings().max_examples))
@given(_parameters(), st.sampled_from(FP8))
def test_the_scale_and_the_rounding_are_the_unsharded_ones(parameter, dtype):
    """Gathered from any number of shards, a parameter reads bit for bit what
    ``policy.round`` gives the whole one (the scale: the max over the shards of each one's
    largest magnitude), and its gradient passes straight through (the mean over the batch)."""
    from flax.core.meta import Partitioned

    from fsdp_tp.collectives._gather import gather_box

    shards, values = parameter
    policy = fsdp_tp.MixedPrecision(dtype)
    mesh = fsdp_tp.make_mesh({"data": 8 // shards, "fsdp": shards})

    def read(block):
        box = Partitioned(block, ("fsdp",) + (None,) * (block.ndim - 1))
        return gather_box(box, frozenset({"fsdp"}), frozenset({"fsdp"}), precision=policy)

    sharded = jax.jit(jax.shard_map(read, mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False))
    np.testing.assert_array_equal(np.asarray(sharded(values)), np.asarray(policy.round(values)))
    grad = jax.jit(
        jax.shard_map(
            jax.grad(lambda b: (read(b) * 3.0).sum()),
            mesh=mesh,
            in_specs=P("fsdp"),
            out_specs=P("fsdp"),
            check_vma=False,
        )
    )
    np.testing.assert_array_equal(np.asarray(grad(values)), np.full(values.shape, 3.0))


def test_negative_control_a_scale_from_the_shard_alone_is_not_the_unsharded_one():
    """Each shard scaled by its own largest magnitude reads another parameter: the property
    above can fail."""
    values = jnp.concatenate([jnp.full((4,), 1.0 + 2**-5), jnp.full((4,), 100.0)])
    policy = fsdp_tp.MixedPrecision(jnp.float8_e4m3fn)
    per_shard = jnp.concatenate([policy.round(values[:4]), policy.round(values[4:])])
    assert not np.array_equal(np.asarray(per_shard), np.asarray(policy.round(values)))


def _rows(operand_type: str) -> int:
    """How many rows (every dim but the last) an HLO operand type such as ``u8[16,4]{1,0}`` has."""
    dims = [int(d) for d in re.match(r"\w+\[([\d,]*)\]", operand_type).group(1).split(",") if d]
    return math.prod(dims[:-1])


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_fp8_gathers_move_one_byte_an_element_plus_a_scale_a_row(api):
    """The parameters' all-gathers are uint8 (XLA:CPU would widen an f8 gather to f16): the
    same gathers as f32's, a quarter of the bytes; each gathered row's scale crosses once
    (an f32, gathered with its row or maxed over the axis that splits the row); the
    reduce-scatters are f32's, unchanged."""
    found = _lowered_by_rules(api, fsdp_tp.MixedPrecision(jnp.float8_e4m3fn))
    f32 = _lowered_by_rules(api, None)
    values = [c for c in found if c.kind == "all-gather" and c.operand_types[0].startswith("u8[")]
    scales = [
        c
        for c in found
        if c.kind in ("all-gather", "all-reduce") and re.match(r"f32\[[\d,]*,1\]", c.operand_types[0])
    ]
    gathers = [c for c in found if c.kind == "all-gather"]
    assert all(c in values or c in scales for c in gathers), (
        "an all-gather that is neither the bits nor their scales"
    )
    assert len(values) == total(f32, "all-gather", "operands") > 0
    assert sum(c.operand_bytes for c in values) * 4 == total(f32, "all-gather")
    assert sum(c.operand_bytes for c in scales) == sum(4 * _rows(c.operand_types[0]) for c in values)
    assert total(found, "reduce-scatter") == total(f32, "reduce-scatter")


def test_the_benchmarks_wire_table_at_small_sizes():
    """The benchmark's per-element table (fsdp_tp.bench.precision_rows) on the small Llama, exact:
    over fsdp 4 a ring moves 3/4 of an array a device, so each FSDP-split element costs 3/4 of
    its gather dtype's bytes to gather and 3/4 of its reduce dtype's to reduce-scatter; 8 bits
    add their scales (one f32 a row) and stay under 3 bytes an element with bf16 reductions."""
    from fsdp_tp.bench.precision_rows import wire
    from fsdp_tp.models.llama import SIZES as SMALL

    widths = {"f32 / f32": (4, 4), "bf16 / f32": (2, 4), "bf16 / bf16": (2, 2), "fp8 / bf16": (1, 2)}
    for label, (gathered, reduced) in widths.items():
        row = wire(label, SMALL)
        assert row.fsdp == 4 and row.elements > 0
        assert (row.gathers, row.reduce_scatters) == (
            0.75 * gathered * row.elements,
            0.75 * reduced * row.elements,
        )
        assert (row.scales > 0) == (label == "fp8 / bf16"), row
    assert row.per_element < 3, row

"""Mixture of experts (issue 59): routing as the unsharded model routes, and the MoE language
model laid out over the batch axes and FSDP equal to its unsharded twin, Linen and NNX."""

from __future__ import annotations

import contextlib
import functools
import re
import warnings

import flax.linen as nn_linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import fsdp_tp.models._mixture as mixture_module
import fsdp_tp.tp._experts as experts_module
import fsdp_tp.tp._find.experts as expert_plan
import fsdp_tp.train
from fsdp_tp import TrainState, make_mesh, make_plan, shard_by_rules
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import operand_count, parse_collectives
from fsdp_tp.bench.lm_step import lowered_lm_step
from fsdp_tp.bench.moe_rows import MOE_SIZES as MOE_BENCH_SIZES
from fsdp_tp.bench.moe_rows import PLANS, WITHIN, measure_moe, moe_section
from fsdp_tp.errors import IndivisibleShapeError, LayerLeftWholeWarning, RuleError
from fsdp_tp.linen import find_tp_rules as linen_find_tp_rules
from fsdp_tp.models.llama import RULES
from fsdp_tp.models.moe import LinenMoE, MoELM, NNXMoELM
from fsdp_tp.nnx import find_tp_rules as nnx_find_tp_rules
from fsdp_tp.routing import capacity, combine, dispatch, route
from fsdp_tp.testing import check_sharded
from fsdp_tp.tp import ColumnParallel, ExpertParallel, RowParallel, register_einsum
from tests.refusals import named_fix, role_named


def reference_routing(logits: np.ndarray, k: int, slots: int | None, lower_first: bool = True):
    """Token-choice top-k written out: each token's k most probable experts (a tie to the lower
    index, or the higher with ``lower_first=False``), every first choice before any second, an
    expert's choices past ``slots`` dropped. Returns (chosen, kept, position), each (tokens, k)."""
    tokens, experts = logits.shape
    order = np.arange(experts) if lower_first else np.arange(experts)[::-1]
    chosen = np.array([order[np.argsort(-row[order], kind="stable")][:k] for row in logits]).reshape(
        tokens, k
    )
    taken, kept, position = np.zeros(experts, int), np.zeros((tokens, k), bool), np.zeros((tokens, k), int)
    for j in range(k):
        for t in range(tokens):
            e = chosen[t, j]
            position[t, j], kept[t, j] = taken[e], slots is None or taken[e] < slots
            taken[e] += 1
    return chosen, kept, position


@st.composite
def routings(draw):
    experts = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, experts)))
    tokens = draw(st.integers(1, 12))
    factor = draw(st.sampled_from([None, 0.5, 1.0, 1.25, 2.0]))
    # Small integers: ties between experts are frequent (equal logits, equal probabilities).
    logits = draw(st.lists(st.integers(-2, 2), min_size=tokens * experts, max_size=tokens * experts))
    return np.array(logits, np.float32).reshape(tokens, experts), k, factor


@functools.partial(jax.jit, static_argnums=(1, 2))
def _routed(logits, k: int, slots: int | None, x):
    """Route, dispatch, and combine of the buffers each expert e multiplies by e + 1, in one
    program, as a model runs them (under jit: one compile an example, not one an op)."""
    r = route(logits, k, slots)
    buffers = dispatch(x, r)
    scale = jnp.arange(1.0, logits.shape[-1] + 1)[:, None, None]
    return r, buffers, combine(buffers * scale, r)


@settings(max_examples=40, deadline=None)
@given(routings())
def test_routing_is_token_choice_top_k_with_capacity(case):
    """Route, dispatch and combine against the routing written out: the same experts (ties to
    the lower index), the same kept choices, each kept token in its slot, and each token's output
    its kept choices' expert outputs times their weights."""
    logits, k, factor = case
    tokens, experts = logits.shape
    slots = capacity(tokens, k, experts, factor)
    x = np.random.default_rng(0).normal(size=(tokens, 3)).astype(np.float32)  # (read back row by row)
    r, buffers, combined = _routed(logits, k, slots, x)
    chosen, kept, position = reference_routing(logits, k, slots)
    np.testing.assert_array_equal(r.chosen, chosen)
    np.testing.assert_array_equal(r.kept, kept)
    buffers = np.asarray(buffers)
    for t, j in zip(*np.nonzero(kept), strict=True):
        np.testing.assert_array_equal(buffers[chosen[t, j], position[t, j]], x[t])
    assert np.count_nonzero(np.abs(buffers).sum(-1)) == kept.sum()  # nothing else in the buffers
    scale = np.arange(1.0, experts + 1)  # expert e multiplies by e + 1
    want = (np.asarray(r.weights) * kept * scale[chosen]).sum(-1)[:, None] * x
    np.testing.assert_allclose(combined, want, rtol=1e-6, atol=1e-6)


def test_negative_control_a_tie_broken_the_other_way_is_caught():
    logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]], np.float32)
    chosen, _, _ = reference_routing(logits, 1, None, lower_first=False)
    assert not np.array_equal(np.asarray(route(jnp.asarray(logits), 1).chosen), chosen)


SIZES = dict(layers=2)
TOKENS = jax.random.randint(jax.random.key(1), (8, 8), 0, 32)
STORAGE = [
    (r"experts/(gate|up)/kernel$", P("fsdp")),  # the expert dim split over fsdp
    (r"experts/down/kernel$", P(None, "fsdp")),  # the hidden dim
    (r"embedding$", P(None, "fsdp")),
]
MESH = {"data": 2, "fsdp": 4}


def lm_loss(out, targets):
    logits, aux = out
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() + aux


def _model(api: str, remat: str = "none", **sizes):
    sizes, wide = {**SIZES, **sizes}, jnp.float64  # (check_sharded computes in float64)
    if api == "linen":
        return MoELM(sizes, wide, remat=remat)
    return lambda rngs: NNXMoELM(rngs, wide, remat=remat, **sizes)


def _rematerialized(jaxpr) -> int:
    """The regions ``jax.checkpoint`` recomputes in ``jaxpr``, at any depth."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("checkpoint", "remat", "remat2")
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # (a closed jaxpr's)
                count += _rematerialized(inner) if hasattr(inner, "eqns") else 0
    return count


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_moe_lm_rematerializes_each_block_as_its_remat_says(api):
    """The gradient's trace holds one rematerialized region per block under "full" and "dots",
    none under "none" (the negative control: the count reads the model's setting)."""

    def gradient(remat: str):  # (traced on the parameters' shapes: no init runs)
        if api == "linen":
            linen = MoELM(SIZES, remat=remat)
            params = jax.eval_shape(linen.init, jax.random.key(0), TOKENS)["params"]
            loss = lambda p: lm_loss(linen.apply({"params": p}, TOKENS), TOKENS)
        else:
            graphdef, params = nnx.split(nnx.eval_shape(lambda: NNXMoELM(nnx.Rngs(0), remat=remat, **SIZES)))
            loss = lambda p: lm_loss(nnx.merge(graphdef, p)(TOKENS), TOKENS)
        return jax.make_jaxpr(jax.grad(loss))(params).jaxpr

    found = {remat: _rematerialized(gradient(remat)) for remat in ("none", "full", "dots")}
    assert found == {"none": 0, "full": SIZES["layers"], "dots": SIZES["layers"]}, found


@pytest.mark.parametrize(
    "api, sizes",
    [
        pytest.param("linen", dict(shared_hidden=8), id="linen-dropless-shared"),
        pytest.param("nnx", dict(capacity_factor=1.0, shared_hidden=8), id="nnx-capacity-shared"),
    ],
)
def test_the_moe_lm_over_data_and_fsdp_is_its_unsharded_twin(api, sizes):
    """Invariants 1-5 (init, outputs with the aux losses, loss, gradients, SGD and AdamW steps)
    for the MoE LM with its experts stored split over fsdp and gathered: dropless and at
    capacity 1.0 (tokens dropped), with a shared expert (top-1, every other layer and
    check_vma off: in the expert-parallel and composition cases below)."""
    check_sharded(_model(api, **sizes), (TOKENS, TOKENS), lm_loss, MESH, STORAGE, steps=2)


def _per_shard_balance(fractions, probs, batch_axes=()):
    return probs.shape[-1] * jnp.sum(jax.lax.stop_gradient(fractions) * probs)


def test_negative_control_a_load_balancing_loss_not_the_global_batchs_is_caught(monkeypatch):
    """A mean of per-device losses (each device's f and P multiplied, then averaged): another loss,
    refused before the first step where the product reads each device's share of the batch's
    routing fractions (issue 99: the whole step's check); the check off, the harness sees it."""
    monkeypatch.setattr(mixture_module, "load_balancing_loss", _per_shard_balance)
    run = lambda check_vma: check_sharded(
        _model("linen"), (TOKENS, TOKENS), lm_loss, MESH, STORAGE, steps=1, optimizers={}, check_vma=check_vma
    )
    for check_vma in (True, False):
        with pytest.raises(
            RuleError, match=r"test_moe.py:\d+ \(_per_shard_balance\).*reads the partial sums"
        ):
            run(check_vma)
        with switched_off(), pytest.raises(AssertionError, match=r"output\[1\]: 1 of 1 elements"):
            run(check_vma)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            functools.partial(LinenMoE, group_rows=2),
            "group_rows=2 rows a group, but this device's batch has 1 rows",
        ),
        (functools.partial(LinenMoE, capacity_factor=0.0), "capacity factor 0.0"),
        (functools.partial(LinenMoE, top_k=5), "k=5 over 4 experts"),
    ],
)
def test_a_moe_that_cannot_route_is_refused_with_the_fix(make, message):
    x = jnp.ones((8, 4, 16))
    with pytest.raises(ValueError, match=message):
        check_sharded(
            make(), (x, x), lambda out, y: jnp.mean((out[0] - y) ** 2), MESH, steps=1, optimizers={}
        )


# Expert parallelism: the experts' einsums split on their expert letter over `expert`, which
# splits the batch too; gate and up receive the dispatched buffers, down sends them back.
EP = [(r"experts/(gate|up)$", ExpertParallel()), (r"experts/down$", ExpertParallel(returns=True))]
EP_STORAGE = [  # FSDP on the dim the expert split leaves (d), the embedding's on its model dim
    (r"experts/(gate|up)/kernel$", P(None, "fsdp")),
    (r"experts/down/kernel$", P(None, None, "fsdp")),
    (r"embedding$", P(None, "fsdp")),
]


@pytest.mark.parametrize(
    "api, mesh, sizes",
    [
        pytest.param("linen", {"data": 2, "expert": 4}, {}, id="linen-data2-expert4-dropless"),
        pytest.param(
            "nnx",
            {"data": 2, "fsdp": 2, "expert": 2},
            dict(capacity_factor=1.25, shared_hidden=8),
            id="nnx-data2-fsdp2-expert2-capacity-shared",
        ),
        pytest.param(
            "nnx",
            {"fsdp": 2, "expert": 4},
            dict(top_k=1, check_vma=False),
            id="nnx-fsdp2-expert4-dropless-top1-unchecked",
        ),
    ],
)
def test_expert_parallel_moe_lm_is_its_unsharded_twin(api, mesh, sizes):
    """Invariants 1-5 with the experts split over `expert` and tokens sent to them by
    all_to_all (composed with FSDP on the experts' model dim): the router's and the experts'
    gradients the unsharded model's, dropped tokens its dropped tokens."""
    check_vma = sizes.pop("check_vma", True)
    storage = EP_STORAGE if "fsdp" in mesh else []
    axes = tuple(a for a in ("data", "fsdp", "expert") if a in mesh)
    model = _model(api, **sizes)
    check_sharded(
        model,
        (TOKENS, TOKENS),
        lm_loss,
        mesh,
        storage,
        tp_rules=EP,
        batch_axes=axes,
        steps=2,
        check_vma=check_vma,
    )


def test_negative_control_experts_gradients_left_as_every_devices_sum_are_caught(monkeypatch):
    """Without the role's 1/n on the experts' gradients (each device's kernel meets every
    device's tokens; the sync leaves a split parameter alone on its axis)."""
    monkeypatch.setattr(experts_module, "_cotangent_times", lambda x, factor: x)
    with pytest.raises(AssertionError, match=r"grads.*experts"):
        check_sharded(
            _model("linen"), (TOKENS, TOKENS), lm_loss, {"data": 2, "expert": 4}, [], tp_rules=EP,
            batch_axes=("data", "expert"), steps=1, optimizers={},
        )  # fmt: skip


def test_negative_control_a_combine_without_the_return_all_to_all_is_caught():
    """down left without returns=True: the buffers stay on the experts' devices and the
    combine reads another layout. The plan check refuses it; switched off, the equality does."""
    no_return = [(r"experts/(gate|up|down)$", ExpertParallel())]
    run = lambda: check_sharded(
        _model("linen"), (TOKENS, TOKENS), lm_loss, {"data": 2, "expert": 4}, [], tp_rules=no_return,
        batch_axes=("data", "expert"), steps=1, optimizers={},
    )  # fmt: skip
    with pytest.raises(
        RuleError, match=r"No ExpertParallel layer has returns=True.*ExpertParallel\(returns=True\)"
    ):
        run()
    with switched_off(), pytest.raises((AssertionError, ValueError, TypeError)):
        run()


def test_returns_on_every_expert_layer_is_refused_naming_the_last_layer_alone():
    """Issue 82 point 4: returns=True on gate and up as well as down was accepted (equal
    numbers, 20 all_to_alls where 8 do, 3.25x the bytes): gate's and up's outputs went back to
    the tokens' devices and down took them straight back. Refused, naming down alone; EP (down
    alone returns) is the plan the tests above prove."""
    every = [(r"experts/(gate|up|down)$", ExpertParallel(returns=True))]
    with pytest.raises(
        RuleError, match=r"experts/gate, block_0/moe/experts/up.* return their outputs"
    ) as refused:
        check_sharded(
            _model("linen"), (TOKENS, TOKENS), lm_loss, {"data": 2, "expert": 4}, [], tp_rules=every,
            batch_axes=("data", "expert"), steps=1, optimizers={},
        )  # fmt: skip
    named_fix(
        refused, "Fix: returns=True on the bank's last layer alone, the one whose output the combine reads"
    )
    named_fix(refused, "(block_0/moe/experts/down, block_1/moe/experts/down)")
    assert [p for p, r in EP if r.returns] == [r"experts/down$"]  # (the fix: EP, proved equal above)


def test_expert_parallel_is_refused_where_the_expert_axis_does_not_split_the_batch():
    with pytest.raises(RuleError, match="'expert' must split the batch") as refused:
        check_sharded(
            _model("linen"), (TOKENS, TOKENS), lm_loss, {"data": 2, "expert": 4}, [], tp_rules=EP,
            batch_axes=("data",), steps=1, optimizers={},
        )  # fmt: skip
    # (the fix, batch_axes=("data", "expert") with EP on this mesh, is the run proved equal above)
    named_fix(refused, "Split the batch over 'expert' too (batch_specs P(('data', 'expert')))")


def test_expert_parallel_moves_each_buffer_once_each_way_and_never_gathers_an_expert():
    """HLO of the train step on fsdp 2 x expert 4: per MoE layer four all_to_alls over the 4
    devices of `expert` (the buffers there and back, forward and backward; gate and up share
    one), each of one device's buffers (groups, E, capacity, d); every all-gather is FSDP's
    (over 2 devices): no expert weight gathered over `expert`."""
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    axes = ("fsdp", "expert")
    sizes = {**SIZES, "capacity_factor": 1.0}
    model = shard_by_rules(MoELM, EP_STORAGE, batch_axes=axes, tp_rules=EP)(sizes)
    lowered = lowered_lm_step(model, mesh, axes, TOKENS, with_aux=True).lowered  # (its loss: lm_loss's)
    found = parse_collectives(lowered.as_text(dialect="hlo"))
    to_all = [c for c in found if c.kind == "all-to-all"]
    groups, tokens_per_group = 1, 8  # a device's 1 row of 8 tokens: one group
    buffer = groups * 4 * capacity(tokens_per_group, 2, 4, 1.0) * 16 * 4  # (G, E, C, d) in f32
    moe_layers = SIZES["layers"]
    assert {c.group_size for c in to_all} == {4}
    assert sum(c.executions for c in to_all) == 4 * moe_layers, [c.operand_types for c in to_all]
    assert all(c.operand_bytes == buffer for c in to_all), [c.operand_types for c in to_all]
    assert {c.group_size for c in found if c.kind == "all-gather"} == {2}


# Each expert's hidden dim over `tensor` (gate and up column, down row): on every device, or on the
# experts' devices of `expert` (ExpertParallel(within=...)).
MEGATRON_EXPERTS = [(r"experts/(gate|up)$", ColumnParallel()), (r"experts/down$", RowParallel())]
EP_WITHIN = [
    (r"experts/(gate|up)$", ExpertParallel(within=ColumnParallel())),
    (r"experts/down$", ExpertParallel(returns=True, within=RowParallel())),
]
PLACED = {  # (mesh, batch axes, tp rules): `tensor` the only axis of size 2
    "experts-over-tensor": ({"data": 4, "tensor": 2}, ("data",), MEGATRON_EXPERTS),
    "experts-over-expert-hidden-over-tensor": ({"expert": 4, "tensor": 2}, ("expert",), EP_WITHIN),
}


def _collectives(placed: str) -> list:
    """The collectives of the MoE LM's step under one of ``PLACED``, attention whole."""
    mesh, axes, rules = PLACED[placed]
    sizes = {**SIZES, "capacity_factor": 1.0}
    model = shard_by_rules(MoELM, [], batch_axes=axes, tp_rules=rules)(sizes)
    lowered = lowered_lm_step(model, make_mesh(mesh), axes, TOKENS, with_aux=True).lowered
    return parse_collectives(lowered.as_text(dialect="hlo"))


@pytest.mark.parametrize("placed", PLACED)
def test_megatron_inside_the_experts_all_reduces_once_each_way_per_layer(placed, monkeypatch):
    """HLO of the train step: over `tensor`, per MoE layer one all-reduce forward (down's sum)
    and one backward (gate's and up's input gradients summed first), each of one device's
    dispatched buffer (groups, E, capacity, d) in f32 (on the experts' devices: the groups of
    every device of `expert`, its experts); nothing else over `tensor`, no weight gathered; with
    an expert axis, its four all_to_alls per layer. Negative control: without the shared *f*,
    gate and up each all-reduce theirs."""
    groups, tokens_per_group = 2, 8  # a device's 2 rows of 8 tokens, a group per row
    buffer = groups * 4 * capacity(tokens_per_group, 2, 4, 1.0) * 16 * 4
    found = _collectives(placed)
    over_tensor = [c for c in found if c.group_size == 2]
    assert {c.kind for c in over_tensor} == {"all-reduce"}, over_tensor
    assert operand_count(over_tensor, "all-reduce", 2) == 2 * SIZES["layers"]
    assert {c.operand_bytes for c in over_tensor} == {buffer}, [c.operand_types for c in over_tensor]
    to_all = [c for c in found if c.kind == "all-to-all"]
    assert sum(c.executions for c in to_all) == (4 * SIZES["layers"] if "expert" in PLACED[placed][0] else 0)
    assert {c.group_size for c in to_all} <= {4} and all(c.operand_bytes == buffer for c in to_all)
    assert not [c for c in found if c.kind == "all-gather"], found

    monkeypatch.setattr(fsdp_tp.train, "shared_column_inputs", contextlib.nullcontext)
    unshared = [c for c in _collectives(placed) if c.group_size == 2]
    assert operand_count(unshared, "all-reduce", 2) == 3 * SIZES["layers"]


@pytest.mark.parametrize(
    "api, mesh, tp, axes, remat, check_vma",
    [
        pytest.param(
            "linen",
            {"data": 2, "expert": 2, "tensor": 2},
            [*RULES, *EP_WITHIN],
            ("data", "expert"),
            "full",
            False,
            id="linen-megatron-attention-and-mlp-with-ep-and-tensor-within-remat-full-unchecked",
        ),
        pytest.param(
            "nnx",
            {"fsdp": 2, "expert": 2, "tensor": 2},
            [*RULES[:4], *EP_WITHIN],
            ("fsdp", "expert"),
            "dots",
            True,
            id="nnx-fsdp-expert-tensor-megatron-attention-with-ep-and-tensor-within-remat-dots",
        ),
        pytest.param(
            *("nnx", {"data": 4, "tensor": 2}, "auto", ("data",), "none", True),
            id="nnx-auto-experts-over-tensor",
        ),
        pytest.param(
            "linen",
            {"data": 2, "expert": 2, "tensor": 2},
            "auto",
            ("data", "expert"),
            "none",
            True,
            id="linen-auto-experts-over-expert-megatron-over-tensor",
        ),
        pytest.param(
            *("nnx", {"data": 2, "expert": 4}, "auto", ("data", "expert"), "none", True),
            id="nnx-auto-experts-alone",
        ),
    ],
)
def test_moe_lm_composes_with_tensor_parallelism(api, mesh, tp, axes, remat, check_vma):
    """On data x expert x tensor, Megatron's attention and dense MLP (every other layer) over
    `tensor` beside expert parallelism, each expert's hidden dim split over `tensor` on its
    device; on fsdp x expert x tensor, Megatron's attention, the experts expert-parallel, their
    hidden dim over `tensor` and their model dim FSDP-split (a kernel on three axes); on data x tensor,
    tp_rules="auto" splits each expert's hidden dim over `tensor` (gate and up column, down row)
    and leaves the routers whole (a softmax reads them whole: its warning silenced); with an
    expert axis that splits the batch, "auto" puts the experts on it (expert parallel, the
    tokens sent back by down) and Megatron's attention and each expert's hidden dim (within) on
    `tensor` where the mesh has one. The
    first two with each block rematerialized (the roles' collectives recomputed in the backward),
    the first with check_vma off."""
    dense = tp != "auto" and len(tp) == len(RULES) + len(EP_WITHIN)  # (the rules of a dense MLP too)
    model = _model(api, remat, capacity_factor=1.0, moe_every=2 if dense else 1)
    storage = EP_STORAGE if "fsdp" in mesh else []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=LayerLeftWholeWarning)
        check_sharded(
            model, (TOKENS, TOKENS), lm_loss, mesh, storage, tp_rules=tp, batch_axes=axes, steps=2,
            check_vma=check_vma,
        )  # fmt: skip


@pytest.mark.parametrize(
    "within, message",
    [
        (ColumnParallel(sequence_dim=1), "within is each expert's Megatron split over another axis"),
        (ColumnParallel(axis="expert"), "on an axis other than 'expert'"),
        (ExpertParallel(axis="tensor"), "ColumnParallel() for gate and up, RowParallel() for down"),
    ],
)
def test_a_split_within_the_experts_that_cannot_work_is_refused_with_the_fix(within, message):
    with pytest.raises(RuleError, match=re.escape(message)) as refused:
        ExpertParallel(within=within)
    fixed = role_named(refused, r"ExpertParallel\(within=ColumnParallel\(axis='tensor'\)\)")
    assert fixed.within == ColumnParallel(axis="tensor")


def test_the_plan_finder_splits_each_experts_hidden_dim_and_leaves_the_router_whole():
    """What "auto" runs above: Megatron inside the experts (their hidden letter), the router
    whole with the softmax's reason."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=LayerLeftWholeWarning)
        plan = nnx_find_tp_rules(NNXMoELM(nnx.Rngs(0), layers=1), jnp.zeros((2, 8), jnp.int32), size=2)
    text = str(plan)
    for line in (
        '(r"^blocks/0/moe/experts/gate$", ColumnParallel()),',
        '(r"^blocks/0/moe/experts/up$", ColumnParallel()),',
        '(r"^blocks/0/moe/experts/down$", RowParallel()),',
    ):
        assert line in text, text
    assert "#   blocks/0/moe/router: blocks/0/moe/router/kernel split on dim -1: reduce_max" in text


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_plan_finder_puts_experts_on_the_expert_axis_and_down_sends_them_back(api):
    """With expert_size, each expert einsum is expert-parallel; the one whose result no other
    expert einsum reads (down) returns the tokens; with size, beside Megatron's attention and
    with each expert's hidden dim over the tensor axis within (gate and up column, down row);
    alone without it."""
    ids = jnp.zeros((2, 8), jnp.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=LayerLeftWholeWarning)
        if api == "nnx":
            plans = [nnx_find_tp_rules(NNXMoELM(nnx.Rngs(0), layers=1), ids, size=2, expert_size=2)]
            plans.append(nnx_find_tp_rules(NNXMoELM(nnx.Rngs(0), layers=1), ids, expert_size=4))
            prefix = "blocks/0"
        else:
            plans = [linen_find_tp_rules(MoELM({"layers": 1}), ids, size=2, expert_size=2)]
            plans.append(linen_find_tp_rules(MoELM({"layers": 1}), ids, expert_size=4))
            prefix = "block_0"
    for plan, with_tensor in zip(plans, (True, False), strict=True):
        column, row = ("within=ColumnParallel()", ", within=RowParallel()") if with_tensor else ("", "")
        experts = [
            f'(r"^{prefix}/moe/experts/gate$", ExpertParallel({column})),',
            f'(r"^{prefix}/moe/experts/up$", ExpertParallel({column})),',
            f'(r"^{prefix}/moe/experts/down$", ExpertParallel(returns=True{row})),',
        ]
        text = str(plan)
        assert all(line in text for line in experts), text
        assert (f'(r"^{prefix}/attn/q$", ColumnParallel()),' in text) is with_tensor, text
    assert f"#   {prefix}/attn/q: the mesh has no tensor axis" in str(plans[1])


def test_negative_control_an_expert_bank_that_never_sends_the_tokens_back_is_refused(monkeypatch):
    """Read as if every expert layer passed its result on (none returns): the plan check
    refuses the plan (the combine reads the experts' devices' buffers as its own), naming the
    line of the model that fails."""
    monkeypatch.setattr(expert_plan, "_passes_on", lambda *_: True)
    ids = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(RuleError, match=r"fails on each device's slices at src/fsdp_tp/models/_mixture.py"):
        nnx_find_tp_rules(NNXMoELM(nnx.Rngs(0), layers=1), ids, expert_size=4)


def test_the_benchmarks_expert_parallel_rows_at_small_sizes():
    """The benchmark's figures (fsdp_tp.bench.moe_rows) on fsdp 2 x expert 4: expert
    parallelism's all_to_alls are the minimum, it gathers nothing over `expert` and sends
    less over it than the experts stored split and gathered, at the same state bytes and
    FLOPs; the stored split moves no all_to_all. On expert 4 x tensor 2, the plan with each
    expert's hidden dim over tensor within against expert parallelism alone."""
    small = {**MOE_BENCH_SIZES, "d": 16, "hidden": 32, "vocab": 32}
    ep, stored = (
        measure_moe("fsdp2_expert4", plan, small, batch=8, seq=8)
        for plan in ("expert parallel", "stored split")
    )
    assert ep.all_to_all_bytes == ep.minimum > 0 and stored.all_to_all_bytes == 0
    assert ep.expert_gathered == 0 < stored.expert_gathered
    assert ep.expert_wire < stored.expert_wire and ep.state_bytes == stored.state_bytes
    assert ep.flops == stored.flops
    # on expert 4 x tensor 2, the hidden dim over tensor within: fewer bytes and FLOPs a device
    # than expert parallelism alone (whose tensor devices compute the same experts), the same
    # all_to_alls, no expert gathered
    alone, within = (
        measure_moe("expert4_tensor2", plan, small, batch=8, seq=8) for plan in (PLANS[0], WITHIN)
    )
    assert within.all_to_all_bytes == alone.all_to_all_bytes == within.minimum and within.expert_gathered == 0
    assert within.state_bytes < alone.state_bytes and within.flops < alone.flops
    section = moe_section([(ep, [1.0]), (stored, [2.0])])
    assert "| fsdp2_expert4 | expert parallel |" in section and "| 2.000 |" in section


class Bank(nn_linen.Module):
    """A user's expert bank, not a Flax layer: one kernel ``w`` an expert."""

    experts: int
    features: int

    @nn_linen.compact
    def __call__(self, x):
        w = self.param("w", nn_linen.initializers.lecun_normal(), (self.experts, x.shape[-1], self.features))
        return jnp.einsum("GECD,EDH->GECH", x, w)


register_einsum(Bank, "GECD,EDH->GECH", kernel="w", sizes={"experts": "E"})


class BankMoE(nn_linen.Module):
    @nn_linen.compact
    def __call__(self, x):
        logits = nn_linen.Dense(4, use_bias=False, name="router")(x)
        r = jax.vmap(lambda g: route(g, 2, capacity(g.shape[0], 2, 4, 1.0)))(logits)
        h = Bank(4, 16, name="up")(jax.vmap(dispatch)(x, r))
        return jax.vmap(combine)(Bank(4, x.shape[-1], name="down")(nn_linen.relu(h)), r)


def test_expert_parallel_on_a_users_registered_expert_bank_is_its_unsharded_twin():
    """The role on a module class of the user's, told what it computes by register_einsum."""
    rules = [(r"^up$", ExpertParallel()), (r"^down$", ExpertParallel(returns=True))]
    x = jax.random.normal(jax.random.key(0), (8, 8, 8))
    mse = lambda out, y: jnp.mean((out - y) ** 2)
    check_sharded(
        BankMoE(),
        (x, x),
        mse,
        {"data": 2, "expert": 4},
        tp_rules=rules,
        batch_axes=("data", "expert"),
        steps=2,
    )


@pytest.mark.parametrize(
    "mesh, rules, error, message",
    [
        (
            {"expert": 8},
            EP,
            IndivisibleShapeError,
            r"the experts \(letter 'E' of 'GECD,EDH->GECH'\) \(size 4\) is not ",
        ),
        (
            {"data": 2, "expert": 4},
            [("router$", ExpertParallel())],
            RuleError,
            "ExpertParallel computes nn.Einsum",
        ),
        (
            {"data": 2, "expert": 4},
            [("attn/q$", ExpertParallel())],
            RuleError,
            "'BTD,DNH->BTNH'; it has none",
        ),
        (
            {"data": 2, "expert": 4},
            [("experts/gate$", ExpertParallel(letter="H"))],
            RuleError,
            r"letter 'H' is not one of them. Fix: give ExpertParallel\(letter=...\) one of 'E'",
        ),
    ],
    ids=["experts-indivisible", "a-dense-layer", "no-expert-letter", "a-letter-not-the-experts"],
)
def test_expert_parallel_that_cannot_work_is_refused_with_the_fix(mesh, rules, error, message):
    axes = tuple(a for a in ("data", "expert") if a in mesh)
    with pytest.raises(error, match=message):
        check_sharded(
            _model("linen"),
            (TOKENS, TOKENS),
            lm_loss,
            mesh,
            [],
            tp_rules=rules,
            batch_axes=axes,
            steps=1,
            optimizers={},
        )


def test_the_plan_of_an_expert_parallel_model_on_a_mesh_larger_than_the_machine():
    """make_plan on data 16 x expert 8 (128 devices, abstractly): each device holds an eighth of
    the experts, and one step sends four of its buffers a MoE layer over `expert` (ring model:
    7/8 of each)."""
    mesh = AbstractMesh((16, 8), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    sizes = {**SIZES, "experts": 16, "capacity_factor": 1.0}
    model = shard_by_rules(MoELM, [], batch_axes=("data", "expert"), tp_rules=EP)(sizes)
    tx = optax.adamw(1e-3)
    init = lambda rng, x: TrainState.create(
        apply_fn=model.apply, params=model.init(rng, x)["params"], tx=tx, rng=rng
    )
    ids = jax.ShapeDtypeStruct((128, 8), jnp.int32)  # a row (one group of 8 tokens) a device
    loss = lambda params, ids: lm_loss(model.apply({"params": params}, ids), ids)
    axes = P(("data", "expert"))
    plan = make_plan(
        init, mesh, (P(), axes), jax.random.key(0), ids, loss_fn=loss, batch=ids, batch_specs=axes
    )
    gate = next(r for r in plan.rows if r.path == "block_0/moe/experts/gate/kernel")
    assert gate.shape == (16, 16, 32) and gate.bytes_per_device == 16 * 16 * 32 * 4 // 8
    buffer = 16 * capacity(8, 2, 16, 1.0) * 16 * 4  # (1 group, E, capacity, d) in f32
    assert plan.wire["expert"] == {"all-to-all": 4 * SIZES["layers"] * buffer * 7 / 8}

"""Issue 45: the Megatron plan found from what a model computes (``find_tp_rules``), printed
as rules, and proved.

The plan found for every model with hand-written rules gives every module the role those
rules give it (the Llama-style einsum/GQA/gated model with tied logits, Linen and NNX, on
tensor 2 and on tensor 4 where its kv heads are kept whole; the NNX GPT scanned and unrolled),
so the proofs of those rules (tests/test_einsum_tp.py, tests/test_nnx_gpt.py) are its proofs.
Models nobody wrote rules for are proved here: a convolution net, and a model whose layers
must not all be split (a norm between two matmuls, a matmul whose output is summed over its
features); their found plan equals the unsharded model (outputs and synced gradients,
float64, data 2 x tensor 4) and names each layer it leaves whole with the reason. Negative
control: a finder that ignores what a norm mixes finds a plan, and the proof catches it.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.linen._traced
import fsdp_tp.testing
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import dot_flops, operand_count, parse_collectives
from fsdp_tp.errors import LayerLeftWholeWarning, RuleError
from fsdp_tp.linen.tp_rules import mlp_rules
from fsdp_tp.models import Transformer
from fsdp_tp.models.llama import RULES, LlamaLM, NNXLlamaLM
from fsdp_tp.models.nnx_transformer import NNXTransformer, tp_rules
from fsdp_tp.sharded_init import abstract_init
from fsdp_tp.testing import NNXSharded as Sharded
from fsdp_tp.tp import ColumnParallel, RowParallel, VocabParallel
from fsdp_tp.tp._find import regions as _regions
from fsdp_tp.tp._find.plan import warn_left_whole
from fsdp_tp.tp.pieces import shared_column_inputs
from tests.equivalence import assert_trees_close, check_split
from tests.models import GATED_RULES, GatedLM, TiedLM
from tests.nnx_models import NNX_MEGATRON, NNXGatedLM, NNXTiedLM, lm_maker
from tests.plain_models import MEGATRON, PlainLM
from tests.refusals import named_fix

APIS = ["linen", "nnx"]
IDS = jnp.zeros((2, 8), jnp.int32)
F64 = dict(param_dtype=jnp.float64)


def _find(api: str, make, *args, **options):
    """The plan of ``make`` (a Linen module class, or an NNX constructor taking ``rngs``)."""
    with jax.enable_x64(True):  # (the float64 models' parameters)
        if api == "linen":
            return fsdp_tp.linen.find_tp_rules(make(), *args, **options)
        return fsdp_tp.nnx.find_tp_rules(nnx.eval_shape(lambda: make(rngs=nnx.Rngs(0))), *args, **options)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("api", APIS)
def test_the_llama_plan_is_its_hand_written_rules(api, size):
    """Tensor 2: the rules of fsdp_tp.models.llama; tensor 4 (2 kv heads): the same, the kv
    einsum kept whole, as tests/test_einsum_tp.py's REPLICATED_KV writes it."""
    plan = _find(api, LlamaLM if api == "linen" else NNXLlamaLM, IDS, size=size)
    kept = ColumnParallel(letter="K", replicated=True)
    hand = RULES if size == 2 else [(p, kept if p == r"attn/kv$" else r) for p, r in RULES]
    assert plan.differences(hand) == []
    assert plan.whole == ()


def _tests_models():
    """``(api, make, hand rules)`` of the LMs the other test modules prove their rules on."""
    lm = dict(vocab=32, d_model=16, heads=4, layers=2)
    return [
        ("linen", lambda: PlainLM(**lm), MEGATRON),
        ("linen", lambda: PlainLM(**lm, scan=True, remat=True), MEGATRON),
        ("nnx", lm_maker(**lm), NNX_MEGATRON),
        ("nnx", lm_maker(**lm, scan=True), NNX_MEGATRON),
        ("linen", TiedLM, [(r"Embed_0$", VocabParallel()), *mlp_rules(r"up$", r"down$")]),
        (
            "nnx",
            NNXTiedLM,
            [(r"embed$", VocabParallel()), (r"up$", ColumnParallel()), (r"down$", RowParallel())],
        ),
        ("linen", GatedLM, GATED_RULES["linen"]),
        ("nnx", NNXGatedLM, GATED_RULES["nnx"]),
    ]


@pytest.mark.parametrize("case", range(8))
def test_the_plans_of_the_lms_the_rules_tests_prove_are_their_rules(case):
    """tests/test_tp_rules.py proves these rules (equivalence, Megatron's minimum of
    collectives, a quarter of the FLOPs); the plan found gives every module the same role."""
    api, make, hand = _tests_models()[case]
    plan = _find(api, make, IDS, size=4)
    assert plan.differences(hand) == []


@pytest.mark.parametrize("api", APIS)
def test_dropout_is_planned_through_and_other_random_numbers_are_not(api):
    """The library draws each device's block of a dropout mask (fsdp_tp.dropout), so a dropout
    between the column and row layers changes no role; noise a model draws itself would be
    the same on every tensor device, so the layer before it stays whole, named."""
    noisy = NOISY[api]
    for noise, roles in ((False, ["up", "down"]), (True, [])):
        streams = dict(rngs=("noise",)) if api == "linen" else {}
        plan = _find(api, functools.partial(noisy, noise=noise), jnp.zeros((8, 6)), size=4, **streams)
        assert list(plan.roles) == roles, (noise, str(plan))
    assert re.search(
        r"up/kernel split on dim -1: .*random numbers the model draws along", dict(plan.whole)["up"]
    ), str(plan)
    # issue 61: the warning said "the numbers are the unsharded model's", which a draw of the
    # model's own is not; a layer left whole for another reason still says they are
    for whole, said in (
        (plan.whole, "are not the unsharded model's where the model draws random numbers itself (up)"),
        ((("up", "a norm's mean"),), "The numbers are the unsharded model's;"),
    ):
        with pytest.warns(LayerLeftWholeWarning, match=re.escape(said)):
            warn_left_whole(dataclasses.replace(plan, whole=whole), 4, "test")


@pytest.mark.parametrize("scan", [True, False])
def test_the_nnx_gpt_plan_is_its_hand_written_rules(scan):
    """On tensor 2 and 4 (its 2 kv heads kept whole), with and without sequence parallelism and
    rings, the plan the main job trains with (fsdp_tp.recipe.nnx_gpt) is tp_rules(...): the
    logits left split for the vocab-parallel loss (outputs_split=True); without it the head
    gathers them, and the plan says so."""
    model = nnx.eval_shape(lambda: NNXTransformer(64, 32, 2, 4, 8, 2, 64, scan_layers=scan, rngs=nnx.Rngs(0)))
    for size in (2, 4):
        plan = fsdp_tp.nnx.find_tp_rules(model, IDS, size=size, outputs_split=True)
        for sequence, ring in (
            (False, None),
            (True, None),
            (True, "bidirectional"),
            (False, "unidirectional"),
        ):
            hand = tp_rules(sequence, size == 4, ring)
            found = plan.scheduled(1 if sequence else None, ring)
            assert found.differences(hand) == [], (size, sequence, ring)
    gathered = fsdp_tp.nnx.find_tp_rules(model, IDS, size=2)
    assert gathered.roles["head"] == ColumnParallel(gather_output=True)
    assert '    (r"^head$", ColumnParallel(gather_output=True)),' in str(gathered).splitlines()


class LinenConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv_in", **F64)(x))
        return nn.Conv(3, (3, 3), name="conv_out", **F64)(x)


class NNXConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv_in = nnx.Conv(3, 8, (3, 3), rngs=rngs, **F64)
        self.conv_out = nnx.Conv(8, 3, (3, 3), rngs=rngs, **F64)

    def __call__(self, x):
        return self.conv_out(nnx.relu(self.conv_in(x)))


class LinenNormBetween(nn.Module):
    """``a`` feeds a norm (its mean mixes a's features), ``b`` -> gelu -> ``c`` is Megatron's
    pair, and ``d``'s output is summed over its features."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(**F64)(nn.Dense(16, name="a", **F64)(x))
        x = nn.Dense(6, name="c", **F64)(nn.gelu(nn.Dense(32, name="b", **F64)(x)))
        return jnp.sum(nn.Dense(8, name="d", **F64)(x) ** 2, axis=-1, keepdims=True)


class NNXNormBetween(nnx.Module):
    def __init__(self, rngs):
        self.a, self.norm = nnx.Linear(6, 16, rngs=rngs, **F64), nnx.LayerNorm(16, rngs=rngs, **F64)
        self.b, self.c = nnx.Linear(16, 32, rngs=rngs, **F64), nnx.Linear(32, 6, rngs=rngs, **F64)
        self.d = nnx.Linear(6, 8, rngs=rngs, **F64)

    def __call__(self, x):
        x = self.c(nnx.gelu(self.b(self.norm(self.a(x)))))
        return jnp.sum(self.d(x) ** 2, axis=-1, keepdims=True)


class LinenNoisy(nn.Module):
    """up -> gelu -> dropout (training) -> down, or with noise the model draws itself."""

    noise: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(32, name="up")(x))
        if self.noise:
            h = h + jax.random.normal(self.make_rng("noise"), h.shape)
        return nn.Dense(6, name="down")(nn.Dropout(0.5, deterministic=False)(h))


class NNXNoisy(nnx.Module):
    def __init__(self, rngs, noise: bool = False):
        self.up, self.down = nnx.Linear(6, 32, rngs=rngs), nnx.Linear(32, 6, rngs=rngs)
        self.drop, self.noise, self.rngs = nnx.Dropout(0.5, rngs=rngs), noise, rngs

    def __call__(self, x):
        h = nnx.gelu(self.up(x))
        if self.noise:
            h = h + jax.random.normal(self.rngs.noise(), h.shape)
        return self.down(self.drop(h))


NOISY = {"linen": LinenNoisy, "nnx": NNXNoisy}
CONV = {"linen": LinenConvNet, "nnx": NNXConvNet}
NORM = {"linen": LinenNormBetween, "nnx": NNXNormBetween}


@pytest.mark.parametrize("api", APIS)
def test_a_conv_net_gets_megatrons_pair_and_equals_unsharded(api):
    x_shape = (8, 6, 6, 3)
    plan = _find(api, CONV[api], jnp.zeros(x_shape), size=4)
    assert [(p, type(r).__name__) for p, r in plan.rules] == [
        ("^conv_in$", "ColumnParallel"),
        ("^conv_out$", "RowParallel"),
    ]
    with jax.enable_x64(True):
        check_split(api, CONV[api], plan.rules, x_shape, True)


@pytest.mark.parametrize("api", APIS)
def test_layers_that_must_stay_whole_are_named_with_the_reason(api):
    """``a`` and ``d`` stay whole, each with what its split would meet; the rest is split and
    the model equals the unsharded one."""
    plan = _find(api, NORM[api], jnp.zeros((8, 6)), size=4)
    assert list(plan.roles) == ["b", "c"]
    whole = dict(plan.whole)
    assert list(whole) == ["a", "d"]
    assert re.search(r"a/kernel split on dim -1: reduce_sum over dim 1 of \[8,16\]", whole["a"]), whole["a"]
    assert re.search(r"d/kernel split on dim -1: .*reduce_sum over dim 1 of \[8,8\]", whole["d"]), whole["d"]
    with jax.enable_x64(True):
        check_split(api, NORM[api], plan.rules, (8, 6), True)


class NNXBareNorm(nnx.Module):
    """``a`` -> a norm without parameters -> ``b`` -> gelu -> ``c``: only the norm's mean keeps
    ``a`` whole."""

    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(6, 16, rngs=rngs, **F64), nnx.Linear(16, 32, rngs=rngs, **F64)
        self.c = nnx.Linear(32, 6, rngs=rngs, **F64)

    def __call__(self, x):
        x = self.a(x)
        return self.c(nnx.gelu(self.b(x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True)))))


def test_negative_control_a_finder_blind_to_a_norms_mean(monkeypatch):
    """The plan keeps ``a`` whole; with the mixing operations let through, ``a`` is split
    before the norm, and the proof fails."""
    plan = _find("nnx", NNXBareNorm, jnp.zeros((8, 6)), size=4)
    assert list(plan.roles) == ["b", "c"]
    with jax.enable_x64(True):
        check_split("nnx", NNXBareNorm, plan.rules, (8, 6), True)

    along = _regions._Grower.along

    def blind(grower, node, value, dims):  # the relations followed, what a node mixes ignored
        mixes, node.mixes = node.mixes, {}
        try:
            along(grower, node, value, dims)
        finally:
            node.mixes = mixes

    monkeypatch.setattr(_regions._Grower, "along", blind)
    with switched_off():
        plan = _find("nnx", NNXBareNorm, jnp.zeros((8, 6)), size=4)
    assert list(plan.roles) == ["a", "b"]
    with jax.enable_x64(True), pytest.raises(AssertionError, match="output"), switched_off():
        check_split("nnx", NNXBareNorm, plan.rules, (8, 6), True)
    # The plan check, reading the same model, refuses that plan: the norm reads partial sums.
    with jax.enable_x64(True), pytest.raises(RuleError, match=r"sqrt reads the partial sums of reduce_sum"):
        check_split("nnx", NNXBareNorm, plan.rules, (8, 6), True)
    # and find_tp_rules, which checks its plan for the size, leaves that region whole, saying why
    fitted = _find("nnx", NNXBareNorm, jnp.zeros((8, 6)), size=4)
    assert list(fitted.roles) == [] and "the plan check: sqrt" in dict(fitted.whole)["a"], str(fitted)


@pytest.mark.parametrize("api", APIS)
def test_auto_is_the_plan_found_for_the_axis_size(api):
    """tp_rules="auto" finds the plan under the mesh (the tensor axis's size bound) and equals
    the unsharded model; it names the layers it leaves whole, once per plan (init and step
    trace the model again); NNX traces the call on ``inputs=`` (its layout is built before any
    input), keeps the plan it found per size, and names what is missing or unused."""
    x = (jax.ShapeDtypeStruct((8, 6), jnp.float64),)
    with jax.enable_x64(True), pytest.warns(LayerLeftWholeWarning) as said:
        # Linen finds the plan at the call (the init's); NNX traces the call on inputs= (given
        # by _check_split) and finds the plan at init.
        model, specs = check_split(api, NORM[api], "auto", (8, 6), True)
    [whole] = [str(w.message) for w in said if w.category is LayerLeftWholeWarning]
    assert re.search(r"'auto' on tensor=4 leaves 2 of 4 layers whole, .* a \(a/kernel .*; d \(d/", whole)
    with jax.enable_x64(True):
        plans = model.tp_plans if api == "linen" else model.sharded.tp_plans
        assert (specs["b"]["kernel"], specs["c"]["kernel"]) == (P(None, "tensor"), P("tensor", None))
        assert list(plans) == [4]  # what "auto" found, readable as rules
        assert plans[4].rules == _find(api, NORM[api], *x, size=4).rules
    if api == "linen":  # where "auto" keeps its plans, a model's own attribute is not overwritten
        owns = type("Owns", (LinenNormBetween,), {"tp_plans": ()})
        with pytest.raises(RuleError, match=r"Owns has its own attribute tp_plans, .* rename it") as refused:
            fsdp_tp.shard_by_rules(owns, tp_rules="auto")
        named_fix(refused, "or pass the plan: tp_rules=find_tp_rules(...)")
        fsdp_tp.shard_by_rules(owns, tp_rules=plans[4].rules)
        return
    with jax.enable_x64(True):
        with pytest.raises(RuleError, match=r"tp_rules='auto' .* pass them: .*inputs=\(x,\)") as refused:
            fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules="auto")
        named_fix(refused, "tp_rules='auto', inputs=(x,))")
        fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules="auto", inputs=x)
        with pytest.raises(
            RuleError, match=r"inputs= is what the tp plan is found and checked on .*no tp_"
        ) as refused:
            fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules=[], inputs=x)
        named_fix(refused, "Drop it, or pass tp_rules")
        fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules=[])
        with pytest.raises(RuleError, match=r"inputs=, a tuple .* got ShapeDtypeStruct") as refused:
            fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules="auto", inputs=x[0])
        named_fix(refused, "Pass e.g. inputs=(tokens,)")
        fsdp_tp.nnx.shard_by_rules(NNXNormBetween, tp_rules="auto", inputs=(x[0],))


def test_differences_name_each_module_two_plans_disagree_on():
    """The negative control of the plan comparisons above: one rule changed is one module named."""
    plan = _find("linen", LlamaLM, IDS, size=2)
    changed = [(p, ColumnParallel() if p == r"mlp/down$" else r) for p, r in RULES]
    assert plan.differences(changed) == [
        "block_0/mlp/down: the plan RowParallel(), the rules ColumnParallel()",
        "block_1/mlp/down: the plan RowParallel(), the rules ColumnParallel()",
    ]
    assert plan.differences(RULES[1:]) == ["embed: the plan VocabParallel(), the rules whole"]


@pytest.mark.parametrize("api", APIS)
def test_the_found_plan_moves_megatrons_collectives_and_no_weight(api):
    """The norm-between model's compiled step (data 2 x tensor 4): over ``tensor``, the b -> c
    pair's one all-reduce forward (c's sum) and one backward (b's input gradient), nothing
    else; no weight is all-gathered over it."""
    with jax.enable_x64(True):  # (the model's float64 parameters)
        found = _norm_step_collectives(api)
    over_tensor = [c for c in found if c.group_size == 4]
    assert operand_count(over_tensor, "all-reduce", 4) == 2
    assert sum(c.operands * c.executions for c in over_tensor) == 2


def _norm_step_collectives(api: str) -> list:
    """The collectives of the norm-between model's compiled gradient step under its found plan."""
    plan = _find(api, NORM[api], jnp.zeros((8, 6)), size=4)
    if api == "nnx":
        model = Sharded(NNXNormBetween, batch_axes=("data",), tp_rules=plan)
    else:
        model = fsdp_tp.shard_by_rules(LinenNormBetween, batch_axes=("data",), tp_rules=plan)()
    lowered = _lowered_grad_step(model, {"data": 2, "tensor": 4}, jnp.zeros((8, 6)))
    return parse_collectives(lowered.compile().as_text())


def _lowered_grad_step(model, sizes: dict[str, int], x) -> jax.stages.Lowered:
    """``model``'s gradient step (of its mean output, the batch split over ``data``) on a mesh
    of ``sizes``, lowered as ``shard_step`` traces it (column layers reading one activation
    share its *f*)."""
    mesh = fsdp_tp.make_mesh(sizes)
    params, specs = abstract_init(  # (the parameters' shapes: all lowering needs)
        lambda r, x: model.init(r, x)["params"], mesh, (P(), P("data")), jax.random.key(0), x
    )

    def per_device(params, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x)))(params)
        return fsdp_tp.sync_gradients(grads, ("data",))

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
    with shared_column_inputs():
        return step.lower(params, x)


GPT = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, head_dim=8, num_kv_heads=2, mlp_hidden=64)


def test_the_linen_gpt_keeps_heads_whole_where_the_axis_would_cut_one():
    """The Linen GPT's attention projects k and v with dense layers over 2 kv heads of 8: on
    tensor 2 each device takes a kv head (q/k/v column, out row); on tensor 4 a device's 4 of
    the 16 kv features would be half a head, whose dims attention contracts: the attention
    stays whole, named with that reason (tp_rules="auto" says so as it finds the plan), and the
    MLP is still split. Both plans equal the unsharded model (its logits and gradients)."""
    two = fsdp_tp.linen.find_tp_rules(Transformer(**GPT), IDS, size=2)
    assert [p for p, _ in two.rules] == [
        "^embed$", "^blocks/attn/query$", "^blocks/attn/key$", "^blocks/attn/value$",
        "^blocks/attn/out$", "^blocks/mlp/wi$", "^blocks/mlp/wo$", "^head$",
    ]  # fmt: skip
    four = fsdp_tp.linen.find_tp_rules(Transformer(**GPT), IDS, size=4)
    assert [p for p, _ in four.rules] == ["^embed$", "^blocks/mlp/wi$", "^blocks/mlp/wo$", "^head$"]
    whole = dict(four.whole)
    assert re.search(r"reshape \[2,8,16\] -> \[2,8,2,8\] regroups dim 2", whole["blocks/attn/query"]), str(
        four
    )
    _check_gpt(2)  # every layer split: no warning (the suite makes one an error)
    said = r"tensor=4 leaves 4 of 8 layers whole, .*: blocks/attn/query"
    with pytest.warns(LayerLeftWholeWarning, match=said) as caught:
        _check_gpt(4)
    assert {w.filename for w in caught} == {__file__}  # shown at the user's line, not the library's


def test_the_linen_gpts_plan_moves_what_its_megatron_layers_move():
    """The Linen GPT has no hand rules: its tensor parallelism is its own layers
    (``Layout("tensor")``). Under the plan found (tensor 2), its compiled gradient step has
    the same collectives over ``tensor`` as with its layers (q, k and v sharing one backward
    all-reduce: 12 operands for 2 blocks, embedding and head), no weight all-gathered over
    it, and the same per-device dot FLOPs: half those of the model unsplit on the same mesh."""
    config = dict(GPT, dtype=jnp.float32)
    auto = _gpt_figures(fsdp_tp.shard_by_rules(Transformer, batch_axes=("data",), tp_rules="auto")(**config))
    layers = _gpt_figures(Transformer(**config, layout=fsdp_tp.models.Layout("tensor")))
    unsplit = _gpt_figures(fsdp_tp.shard_by_rules(Transformer, batch_axes=("data",))(**config))
    assert auto == layers
    kinds, flops = auto
    assert kinds == {"all-reduce": 12}
    assert unsplit == ({}, 2 * flops)


def _gpt_figures(model) -> tuple[dict[str, int], int]:
    """``model``'s gradient step on data 4 x tensor 2: the operands of each kind of collective
    over ``tensor`` (those over ``data`` sync the gradients), and its dot FLOPs per device."""
    lowered = _lowered_grad_step(model, {"data": 4, "tensor": 2}, jnp.zeros((8, 8), jnp.int32))
    over_tensor = [c for c in parse_collectives(lowered.compile().as_text()) if c.group_size == 2]
    kinds = {k: operand_count(over_tensor, k, 2) for k in sorted({c.kind for c in over_tensor})}
    return kinds, dot_flops(lowered.as_text(dialect="hlo"))


def _check_gpt(tensor: int) -> None:
    """The Linen GPT under tp_rules='auto' on data 2 x tensor ``tensor``: its logits and
    synced gradients are the unsharded model's (float64)."""
    with jax.enable_x64(True):
        mesh = fsdp_tp.make_mesh({"data": 8 // tensor, "tensor": tensor})
        ids = jax.random.randint(jax.random.key(0), (8, 8), 0, GPT["vocab_size"])
        config = dict(GPT, dtype=jnp.float64)
        model = fsdp_tp.shard_by_rules(Transformer, batch_axes=("data",), tp_rules="auto")(**config)
        params, specs = fsdp_tp.init_sharded(
            lambda r, x: model.init(r, x)["params"], mesh, (P(), P("data")), jax.random.key(1), ids
        )

        def loss(model, params, ids):
            logits = model.apply({"params": params}, ids)
            return jnp.mean(logits * jnp.cos(logits)), logits

        def per_device(params, ids):
            (_, out), grads = jax.value_and_grad(lambda p: loss(model, p, ids), has_aux=True)(params)
            return out, fsdp_tp.sync_gradients(grads, ("data",))

        out_specs = (P("data"), specs)
        step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=out_specs))
        out, grads = step(params, ids)
        twin, whole = Transformer(**config), nn.unbox(params)
        (_, want), want_grads = jax.jit(jax.value_and_grad(lambda p: loss(twin, p, ids), has_aux=True))(whole)
        assert_trees_close(out, want, "output")
        assert_trees_close(nn.unbox(grads), want_grads, "grads")


# --- issue 57 point 4: parameters boxed as flax's examples write every layer ---------------

LOGICAL = nn.with_logical_partitioning
XAVIER = nn.initializers.xavier_uniform()


class LinenBoxed(nn.Module):
    """Attention and an MLP whose kernels are ``nn.with_logical_partitioning`` boxes, as flax's
    lm1b and MaxText's Linen models write them."""

    @nn.compact
    def __call__(self, x):
        kernel = lambda *names: LOGICAL(XAVIER, names)
        attend = nn.MultiHeadDotProductAttention(4, kernel_init=kernel("embed", "heads", "kv"), name="attn")
        x = x + attend(x, x)
        bias = LOGICAL(nn.initializers.zeros, ("mlp",))
        h = nn.Dense(64, kernel_init=kernel("embed", "mlp"), bias_init=bias, name="wi")
        return nn.Dense(16, kernel_init=kernel("mlp", "embed"), name="wo")(nn.relu(h(x)))


class NNXBoxed(nnx.Module):
    def __init__(self, rngs):
        kernel = lambda *names: nnx.with_partitioning(nnx.initializers.xavier_uniform(), names)
        heads = kernel("embed", "heads", "kv")
        self.attn = nnx.MultiHeadAttention(4, 16, 16, kernel_init=heads, decode=False, rngs=rngs)
        self.wi = nnx.Linear(16, 64, kernel_init=kernel("embed", "mlp"), rngs=rngs)
        self.wo = nnx.Linear(64, 16, kernel_init=kernel("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return self.wo(nnx.relu(self.wi(x)))


BOXED_X = jax.random.normal(jax.random.key(3), (8, 8, 16))


@pytest.mark.parametrize("api", APIS)
def test_boxed_parameters_get_megatrons_plan_and_equal_unsharded(api):
    """The finder reads a box's value as the parameter: attention head-parallel, the MLP column
    then row (0.1's finder left every layer whole: "no matmul reads its parameters"), found and
    checked for tensor 2, and proved equal to unsharded under tp_rules="auto"."""
    if api == "linen":
        plan = fsdp_tp.linen.find_tp_rules(LinenBoxed(), BOXED_X, size=2)
        model, rules = LinenBoxed(), ()
    else:
        with nnx.use_eager_sharding(False):
            plan = fsdp_tp.nnx.find_tp_rules(nnx.eval_shape(lambda: NNXBoxed(nnx.Rngs(0))), BOXED_X, size=2)
        model, rules = (lambda rngs: NNXBoxed(rngs)), [(".", P())]  # (its logical names: no mesh axes)
    assert [(pattern, type(role).__name__) for pattern, role in plan.rules] == [
        ("^attn$", "HeadParallel"), ("^wi$", "ColumnParallel"), ("^wo$", "RowParallel")
    ], str(plan)  # fmt: skip
    mse = lambda out, y: jnp.mean((out - y) ** 2)
    fsdp_tp.testing.check_sharded(model, (BOXED_X, 0 * BOXED_X), mse, {"data": 4, "tensor": 2}, rules,
                                  tp_rules="auto", steps=1)  # fmt: skip


def test_negative_control_boxes_read_as_the_parameters_leave_every_layer_whole(monkeypatch):
    monkeypatch.setattr(fsdp_tp.linen._traced, "_unboxed", lambda x: x)
    plan = fsdp_tp.linen.find_tp_rules(LinenBoxed(), BOXED_X, size=2)
    assert not plan.rules and dict(plan.whole)["wi"] == "no matmul reads its parameters", str(plan)

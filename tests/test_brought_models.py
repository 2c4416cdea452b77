"""Issue 82: the proof takes the models people bring, as they wrote them.

Each test is one point of the issue, with its negative control: the NNX tutorial's call-time
dropout rngs under ``"auto"`` and ``find_tp_rules(size=)`` (point 1), float64 that reaches a
token model's default-dtype layers (point 2), an NNX model that holds its own rngs (point 3),
every ``check_sharded`` argument mistake one line whose fix is then proved (point 7).
"""

from __future__ import annotations

import os
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fsdp_tp
from fsdp_tp.errors import CheckPrecisionWarning, LayerLeftWholeWarning, RuleError
from fsdp_tp.testing import NNXTwin, check_sharded
from fsdp_tp.tp import ColumnParallel, Region, RowParallel
from tests.refusals import named_fix, role_named

D = 8
MESH = {"data": 2, "tensor": 4}
X = jax.random.normal(jax.random.key(1), (8, D))
BATCH = (X, jnp.zeros((8, D)))
KEY = jax.random.key(3)
RULES = [("up$", ColumnParallel()), ("down$", RowParallel())]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


class CallTimeDrop(nnx.Module):
    """The tutorial's idiom: ``nnx.Dropout(rate)`` holding no rngs, given them at the call."""

    def __init__(self, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return x + self.down(self.drop(nnx.gelu(self.up(x)), rngs=rngs))


class OwnDrop(nnx.Module):
    """The Flax NNX guide's idiom: ``nnx.Dropout(rate, rngs=rngs)`` holding its own stream."""

    def __init__(self, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.down(self.drop(nnx.gelu(self.up(x))))


def test_call_time_dropout_rngs_auto_plans_and_proves_equal():
    """Point 1: "auto" fits its plan with the call's rngs unknown (a stand-in stream for the
    trace), and the plan is Megatron's, proved equal with dropout on."""
    check_sharded(CallTimeDrop, BATCH, mse, MESH, tp_rules="auto", rngs={"dropout": KEY}, steps=1)
    model = nnx.eval_shape(lambda: CallTimeDrop(nnx.Rngs(0)))
    for call in ({}, {"rngs": nnx.Rngs(dropout=1)}):  # with and without the call's own rngs
        plan = fsdp_tp.nnx.find_tp_rules(model, X, size=4, **call)
        assert [(p, type(r).__name__) for p, r in plan.rules] == [
            ("^up$", "ColumnParallel"),
            ("^down$", "RowParallel"),
        ]


def test_negative_control_a_real_misfit_beside_dropout_is_still_refused():
    """The stand-in stream names no plan right: a norm over the split features between the
    pair is refused at its line with the rngs stood in for, as without dropout."""

    class NormInside(CallTimeDrop):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.norm = nnx.LayerNorm(4 * D, rngs=rngs)

        def __call__(self, x, rngs=None):
            return x + self.down(self.drop(self.norm(self.up(x)), rngs=rngs))

    with pytest.raises(RuleError, match=r"LayerNorm|norm") as refused:
        check_sharded(NormInside, BATCH, mse, MESH, tp_rules=RULES, rngs={"dropout": KEY}, steps=1)
    named_fix(refused, "leave the column and row layers around it whole (drop its tp rule)")
    check_sharded(NormInside, BATCH, mse, MESH, tp_rules=[], rngs={"dropout": KEY}, steps=1)


def test_an_nnx_model_holding_its_own_rngs_is_proved_equal():
    """Point 3: both models draw from the state ``make(nnx.Rngs(seed))`` holds (was a raw
    ``KeyError: ('drop', 'rngs', 'count')``)."""
    check_sharded(OwnDrop, BATCH, mse, MESH, tp_rules=RULES, steps=1)


def test_negative_control_own_rngs_from_another_seed_differ():
    """The twin's dropout really draws: the same model from another seed's rngs drops other
    entries, so the state the check carries decides the output."""
    twins = [NNXTwin(OwnDrop, seed=seed) for seed in (0, 1)]
    params = twins[0].init(jax.random.key(0))["params"]
    first, second = (t.apply({"params": params}, X) for t in twins)
    assert not jnp.allclose(first, second)
    assert jnp.array_equal(first, twins[0].apply({"params": params}, X))  # the same draws each call


class LinenTokens(nn.Module):
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(32, D, name="embed")(tokens)
        return nn.Dense(D, name="down")(nn.gelu(nn.Dense(4 * D, dtype=self.dtype, name="up")(h)))


class NNXTokens(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, D, rngs=rngs)  # (its dtype is fixed to its table's: float32)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, tokens):
        return self.down(nnx.gelu(self.up(self.embed(tokens))))


TOKENS = (jax.random.randint(jax.random.key(2), (8, 4), 0, 32), jnp.zeros((8, 4, D)))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_float64_reaches_a_token_models_default_dtype_layers(api):
    """Point 2: integer tokens and flax's default ``param_dtype=float32``; the check's
    parameters are cast (and NNX's layers' dtypes, fixed when built), so every layer computes in
    float64: the loss sees it, and no narrower operation is warned of."""
    seen = []
    loss = lambda out, y: (seen.append(out.dtype), mse(out, y))[1]
    model = LinenTokens() if api == "linen" else NNXTokens
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckPrecisionWarning)
        check_sharded(model, TOKENS, loss, MESH, tp_rules=RULES, steps=1)
    assert seen and set(seen) == {jnp.dtype(jnp.float64)}


def test_negative_control_a_layer_of_its_own_float32_is_named():
    """A Linen layer that computes in float32 itself keeps the check in float32 there: said,
    at the model's line, not hidden."""
    with pytest.warns(
        CheckPrecisionWarning, match=r"computes in float32 at tests/test_brought_models.py:\d+"
    ):
        check_sharded(LinenTokens(dtype=jnp.float32), TOKENS, mse, MESH, tp_rules=RULES, steps=1)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="down")(nn.gelu(nn.Dense(4 * D, name="up")(x)))


# Each mistake a user made (issue 82 point 7), the words its one line must hold, and the fix
# that line names, as check_sharded's keyword arguments: all the fixes together are proved.
RNGS_FIX, OPT_FIX = "rngs={'dropout': jax.random.key(0)}", "{'sgd': lambda: optax.sgd(0.1)}"
MISTAKES = {
    "optimizer-transform": (
        {"optimizers": {"sgd": optax.sgd(0.1)}}, r"optimizers\['sgd'\] is an optax transform", OPT_FIX),
    "optimizers-a-list": ({"optimizers": [optax.sgd]}, r"optimizers is a mapping .* got list", OPT_FIX),
    "optimizer-not-optax": ({"optimizers": {"sgd": lambda: 3}}, r"is a function returning int 3", OPT_FIX),
    "no-steps": ({"steps": 0}, r"steps=0; .* steps=1 or more", "steps=1"),
    "negative-steps": ({"steps": -1}, r"steps=-1", "steps=1"),
    "batch-axis-not-in-mesh": (
        {"batch_axes": ("batch",)}, r"batch_axes=\('batch',\) names \['batch'\]", "batch_axes=('data',)"),
    "rngs-a-key": ({"rngs": KEY}, r"got an array of shape \(\) and dtype key", RNGS_FIX),
    "rngs-an-int": ({"rngs": 3}, r"got int 3", RNGS_FIX),
    "a-bare-role": ({"tp_rules": ColumnParallel()}, r"is a role alone", "tp_rules=[('up$', ColumnParallel("),
    "auto-capitalised": ({"tp_rules": "Auto"}, r"spelled tp_rules='auto', in lower case", "tp_rules='auto'"),
    "inputs-alone": ({"batch": X}, r"batch is \(inputs, targets\).* shape \(8, 8\)", "batch=(x, y)"),
    "a-linen-class": ({"model": MLP}, r"the Linen class MLP; pass an instance", "MLP(...)"),
    "no-batch-axis": (
        {"mesh": {"tensor": 8}}, r"has no axis the batch splits over", "mesh={'data': 1, 'tensor': 8}"),
}  # fmt: skip


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_every_argument_mistake_is_one_line_naming_the_fix(mistake):
    given, said, fix = MISTAKES[mistake]
    call = {"model": MLP(), "batch": BATCH, "loss": mse, "mesh": MESH, "tp_rules": RULES, "steps": 1} | given
    with pytest.raises((TypeError, ValueError)) as raised:
        check_sharded(**call)
    message = str(raised.value)
    assert "\n" not in message and re.search(said, message), message
    assert fix in message, message


def test_the_fixes_the_mistakes_name_are_accepted_and_equal():
    """Every fix above at once, as the messages spell them: passes (each mistake's own fix
    lands in one of these keywords; the model's and the batch's are the call's as written)."""
    check_sharded(
        MLP(),
        (X, BATCH[1]),
        mse,
        {"data": 1, "tensor": 8},
        tp_rules=[("up$", ColumnParallel()), ("down$", RowParallel())],
        batch_axes=("data",),
        optimizers={"sgd": lambda: optax.sgd(0.1)},
        steps=1,
        rngs={"dropout": jax.random.key(0)},
    )
    check_sharded(MLP(), BATCH, mse, MESH, tp_rules="auto", steps=1)


# -- point 6: every refusal's fix is itself accepted ---------------------------------------

HEADS, HD = 4, 4


class FusedQKV(nn.Module):
    """GPT-J/NeoX's fused projection; ``major="qkv"`` splits it qkv-major (3 parts over 4
    devices: no block), ``"head"`` head-major, the layout the refusal names."""

    major: str = "qkv"

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        qkv = nn.Dense(3 * HEADS * HD, name="qkv")(x)
        if self.major == "qkv":
            q, k, v = jnp.moveaxis(qkv.reshape(b, s, 3, -1, HD), 2, 0)
        else:
            q, k, v = jnp.moveaxis(qkv.reshape(b, s, -1, 3, HD), 3, 0)
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
        return nn.Dense(D, name="out")(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1))


SEQ = (jax.random.normal(jax.random.key(4), (8, 4, D)), jnp.zeros((8, 4, D)))
FUSED = [("qkv$", ColumnParallel()), ("out$", RowParallel())]


def test_a_qkv_major_reshape_is_refused_naming_the_head_major_layout_that_works():
    """The fix named was reshape(b, s, -1, 4, 8): 24 features a device into (-1, 4, 4) fits
    no whole dim, itself refused. Now: the head-major reshape (heads first, then the 3), or
    q, k and v apart; the head-major model is proved equal."""
    with pytest.raises(RuleError) as refused:
        check_sharded(FusedQKV(), SEQ, mse, MESH, tp_rules=FUSED, steps=1)
    named_fix(refused, "reshape to (4, 4, -1, 3, 4), -1 where the unsharded model has 4")
    named_fix(refused, "q, k and v apart")
    check_sharded(FusedQKV(major="head"), SEQ, mse, MESH, tp_rules=FUSED, steps=1)


class StackedKV(nnx.Module):
    """flax's NNX Gemma's attention: k and v stacked in one einsum, ``'BTD,CKDH->CBTKH'``."""

    def __init__(self, rngs, letter=None):
        self.q = nnx.Einsum("BTD,DNH->BTNH", (D, HEADS, HD), rngs=rngs)
        self.kv = nnx.Einsum("BTD,CKDH->CBTKH", (2, HEADS, D, HD), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HD, D), rngs=rngs)

    def __call__(self, x):
        q, (k, v) = self.q(x), self.kv(x)
        w = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), -1)
        return self.out(jnp.einsum("bnts,bsnh->btnh", w, v))


def test_a_stacked_kv_einsums_letter_is_named_under_check_vma_and_works():
    """Under check_vma=True the letter hint read "the plan leaves it whole" for every einsum
    (the finder traced a device's varying inputs, whose casts hid the matmuls); it names
    ColumnParallel(letter='K') as unchecked did, and that rule is proved equal."""
    rules = lambda kv: [("^q$", ColumnParallel()), ("^kv$", kv), ("^out$", RowParallel())]
    with pytest.raises(RuleError) as refused:
        check_sharded(
            StackedKV, SEQ, mse, {"data": 4, "tensor": 2}, tp_rules=rules(ColumnParallel()), steps=1
        )
    found = role_named(refused, r"(?<=the plan found gives )ColumnParallel\(letter='K'\)")
    check_sharded(StackedKV, SEQ, mse, {"data": 4, "tensor": 2}, tp_rules=rules(found), steps=1)


class RawSwiGLU(nnx.Module):
    """One module, three raw kernels read by einsums: no role computes it (issue 85's)."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w_gate = nnx.Param(init(rngs.params(), (D, 4 * D)))
        self.w_up = nnx.Param(init(rngs.params(), (D, 4 * D)))
        self.w_down = nnx.Param(init(rngs.params(), (4 * D, D)))

    def __call__(self, x):
        h = nnx.silu(jnp.einsum("bd,dh->bh", x, self.w_gate[...])) * jnp.einsum(
            "bd,dh->bh", x, self.w_up[...]
        )
        return jnp.einsum("bh,hd->bd", h, self.w_down[...])


class RawBlock(nnx.Module):
    def __init__(self, rngs):
        self.mlp = RawSwiGLU(rngs)

    def __call__(self, x):
        return x + self.mlp(x)


def test_a_rule_on_raw_parameters_names_a_layer_per_kernel_not_a_pattern_refused_in_turn():
    """It said "drop the parameter name, e.g. 'mlp$'", refused in turn (mlp is no layer a role
    computes). A Dense's parameter still gets its module's name, which RULES prove above."""
    with pytest.raises(RuleError) as refused:
        check_sharded(RawBlock, BATCH, mse, MESH, tp_rules=[("mlp/w_gate$", ColumnParallel())], steps=1)
    said = str(refused.value)
    assert "mlp is a RawSwiGLU whose own code reads its raw parameters" in said
    named_fix(refused, "give each kernel a layer of its own (nnx.Einsum or nnx.Linear")
    named_fix(refused, "or leave mlp whole (drop the rule")
    named_fix(refused, "('mlp$', Region(dims={'<parameter>': <dim from the end>, ...}))")  # (issue 85)
    region = Region(dims={"w_gate": -1, "w_up": -1, "w_down": -2})
    check_sharded(RawBlock, BATCH, mse, MESH, tp_rules=[("mlp$", region)], steps=1, optimizers={})
    fsdp_tp.nnx.shard_by_rules(RawBlock, tp_rules=[])  # (rules are matched as the model is laid out)
    with pytest.raises(RuleError, match=r"drop the parameter name, e.g. 'up\$'") as refused:
        check_sharded(CallTimeDrop, BATCH, mse, MESH, tp_rules=[("up/kernel$", ColumnParallel())], steps=1)
    pattern = re.search(r"e\.g\. '([^']+)'", named_fix(refused, "drop the parameter name, e.g. 'up$'"))[1]
    fsdp_tp.nnx.shard_by_rules(CallTimeDrop, tp_rules=[(pattern, ColumnParallel()), RULES[1]])


def test_a_dependencys_frame_is_never_the_models_line():
    """jnp.einsum plans through opt_einsum: a failure inside it named opt_einsum/contract.py:324
    as the model's line. Its frames are how an operation was made, as JAX's are."""
    import opt_einsum

    from fsdp_tp._trace.sites import made_by_jax, users_file

    contract = os.path.join(os.path.dirname(opt_einsum.__file__), "contract.py")
    assert made_by_jax(contract) and not users_file(contract)
    assert users_file(__file__)


# -- point 4: nothing quietly less parallel ------------------------------------------------


class RawExperts(nnx.Module):
    """A mixture's experts as raw ``(E, d, h)`` parameters read by einsums in one module."""

    def __init__(self, rngs, experts=4):
        init = nnx.initializers.lecun_normal()
        self.w_up = nnx.Param(init(rngs.params(), (experts, D, 4 * D)))
        self.w_down = nnx.Param(init(rngs.params(), (experts, 4 * D, D)))

    def __call__(self, x):
        h = nnx.gelu(jnp.einsum("bd,edh->beh", x, self.w_up[...]))
        return x + jnp.einsum("beh,ehd->bd", h, self.w_down[...]) / self.w_up.shape[0]


@pytest.mark.parametrize(
    "make, mesh, axes, said",
    [
        (RawExperts, {"data": 2, "expert": 4}, ("data", "expert"), r"on expert=4 leaves 1 of 1 .*the model"),
    ],
    ids=["raw-experts"],
)  # fmt: skip
def test_auto_names_a_module_of_raw_kernels_it_leaves_whole(make, mesh, axes, said):
    """ "auto" left a module of raw kernels whole naming nothing, on a tensor axis and on an
    expert axis (every device then stored every expert); it is named with what would split it,
    and the numbers are still the unsharded model's."""
    with pytest.warns(LayerLeftWholeWarning, match=said + r".*give each kernel a layer of its own"):
        check_sharded(make, BATCH, mse, mesh, tp_rules="auto", batch_axes=axes, steps=1)


def test_auto_gives_a_one_module_swiglu_its_region_and_leaves_nothing_whole():
    """It was left whole, named (issue 85): "auto" now splits its three kernels as one Region."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerLeftWholeWarning)
        check_sharded(RawBlock, BATCH, mse, MESH, tp_rules="auto", steps=1, optimizers={})
    plan = fsdp_tp.nnx.find_tp_rules(nnx.eval_shape(lambda: RawBlock(nnx.Rngs(0))), X, size=4)
    assert plan.whole == () and plan.rules == (
        ("^mlp$", Region(dims={"w_gate": -1, "w_up": -1, "w_down": -2})),
    )


def test_negative_control_a_norms_parameters_are_no_raw_kernels():
    """Only parameters a matmul or a lookup reads make a raw-kernel module: a LayerNorm's
    scale and bias (multiplied, added) leave nothing to name, and Megatron's pair is found."""

    class Normed(CallTimeDrop):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, x, rngs=None):
            return super().__call__(self.norm(x), rngs)

    plan = fsdp_tp.nnx.find_tp_rules(nnx.eval_shape(lambda: Normed(nnx.Rngs(0))), X, size=4)
    assert plan.whole == () and [p for p, _ in plan.rules] == ["^up$", "^down$"], str(plan)

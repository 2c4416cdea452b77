"""Issue 85: tensor parallelism for a module of raw kernels (:class:`fsdp_tp.tp.Region`).

A one-module SwiGLU MLP holds ``w_gate``, ``w_up`` ``(d, h)`` and ``w_down`` ``(h, d)`` as raw
parameters and reads them with ``jnp.einsum`` in one ``__call__``, Linen and NNX alike. One rule
names the module and the dim each kernel splits on; the module's own code runs on the blocks.
Properties: invariants 1-5 against the unsharded model (float64, ``fsdp_tp.testing``) on data x
tensor, fsdp x tensor (FSDP splits the other dim) and with sequence parallelism, both
``check_vma``; the compiled step moves Megatron's minimum over ``tensor`` (one all-reduce forward,
one backward per block, no weight gathered over it). Negative controls: a norm over the split
hidden dim inside the module, and a split on the dim the first einsum contracts, are refused at
the model's line (with the check off the harness catches them); a parameter named that the
module does not hold, and dims passed where the axis goes, are one error with the fix.
Raw expert kernels (:class:`fsdp_tp.tp.ExpertParallel` with ``dims``), a bank taking the
dispatched buffers or a module routing in its own call, move the einsum bank's all-to-alls;
their gradients' ``1/n`` dropped is caught; a kernel read otherwise is refused at its line.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp import routing
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import dot_flops, parse_collectives
from fsdp_tp.errors import LayerLeftWholeWarning, RuleError
from fsdp_tp.models.moe import mixture
from fsdp_tp.testing import check_sharded
from fsdp_tp.tp import ColumnParallel, ExpertParallel, Region, RowParallel, VocabParallel
from tests.refusals import named_fix

D, H, V = 8, 16, 32
SWIGLU = Region(dims={"w_gate": -1, "w_up": -1, "w_down": -2})
RULES = [("mlp$", SWIGLU)]
FSDP = [(r"w_(gate|up)$", P("fsdp")), (r"w_down$", P(None, "fsdp"))]  # (the dim tensor leaves whole)
# sequence parallelism: the residual stream split along the tokens between the regions
SEQUENCE = [
    ("embed$", VocabParallel(sequence_dim=1)),
    ("mlp$", Region(dims=SWIGLU.dims, sequence_dim=1)),
    ("head$", ColumnParallel(sequence_dim=1, gather_output=True)),
]
TOKENS = jax.random.randint(jax.random.key(1), (8, 4), 0, V)
BATCH = (TOKENS, jnp.roll(TOKENS, -1, axis=1))


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _swiglu(x, w_gate, w_up, w_down, norm: bool):
    gate = jnp.einsum("btd,dh->bth", x, w_gate)
    hidden = nn.silu(gate) * jnp.einsum("btd,dh->bth", x, w_up)
    if norm:  # (a norm over the hidden units: each device would normalize its own block)
        hidden = hidden / jnp.sqrt(jnp.mean(hidden**2, axis=-1, keepdims=True) + 1e-6)
    return jnp.einsum("bth,hd->btd", hidden, w_down)


class LinenSwiGLU(nn.Module):
    norm: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w_gate, w_up = (self.param(name, init, (D, H)) for name in ("w_gate", "w_up"))
        return _swiglu(x, w_gate, w_up, self.param("w_down", init, (H, D)), self.norm)


class NNXSwiGLU(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, norm: bool = False):
        init = nnx.initializers.lecun_normal()
        self.w_gate, self.w_up = (nnx.Param(init(rngs.params(), (D, H))) for _ in range(2))
        self.w_down, self.norm = nnx.Param(init(rngs.params(), (H, D))), norm

    def __call__(self, x):
        return _swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...], self.norm)


class LinenLM(nn.Module):
    """Embedding, one pre-norm residual block of raw kernels, logits: ``block`` "mlp" (the
    SwiGLU; ``variant``: a norm inside) or "attn" (the attention; ``variant``: constant groups)."""

    block: str = "mlp"
    variant: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        inner = LinenSwiGLU if self.block == "mlp" else LinenRawAttention
        x = x + inner(self.variant, name=self.block)(nn.RMSNorm(name="norm")(x))
        return nn.Dense(V, name="head")(x)


class NNXLM(nnx.Module):
    """:class:`LinenLM` in NNX, the block under the same name."""

    def __init__(self, rngs: nnx.Rngs, block: str = "mlp", variant: bool = False):
        self.embed, self.norm = nnx.Embed(V, D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        inner = NNXSwiGLU if block == "mlp" else NNXRawAttention
        self.block, self.head = block, nnx.Linear(D, V, rngs=rngs)
        setattr(self, block, inner(rngs, variant))

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + getattr(self, self.block)(self.norm(x)))


def _lm(api: str, block: str, variant: bool = False):
    return LinenLM(block, variant) if api == "linen" else (lambda rngs: NNXLM(rngs, block, variant))


def _model(api: str, norm: bool = False):
    return _lm(api, "mlp", norm)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_one_module_swiglu_by_its_kernels_splits_is_the_unsharded_model(api):
    """data x tensor (SGD and AdamW, 3 steps); FSDP on the dim tensor leaves whole, unchecked
    vma; sequence parallelism from the embedding to the logits."""
    check_sharded(_model(api), BATCH, cross_entropy, {"data": 2, "tensor": 4}, tp_rules=RULES)
    once = dict(steps=1, optimizers={})
    fsdp = {"fsdp": 2, "tensor": 4}
    check_sharded(_model(api), BATCH, cross_entropy, fsdp, FSDP, tp_rules=RULES, check_vma=False, **once)
    check_sharded(_model(api), BATCH, cross_entropy, {"data": 4, "tensor": 2}, tp_rules=SEQUENCE, **once)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_norm_between_the_region_s_einsums_is_refused_at_its_line_and_caught_unchecked(api):
    mesh = {"data": 2, "tensor": 4}
    with pytest.raises(RuleError, match=r"test_raw_kernels\.py:\d+ .*mean") as refused:
        check_sharded(_model(api, norm=True), BATCH, cross_entropy, mesh, tp_rules=RULES, steps=1)
    with switched_off(), pytest.raises(AssertionError, match="output"):
        check_sharded(
            _model(api, norm=True), BATCH, cross_entropy, mesh, tp_rules=RULES, steps=1, optimizers={}
        )
    named_fix(refused, "leave mlp whole (drop its tp rule)")
    check_sharded(_model(api, norm=True), BATCH, cross_entropy, mesh, steps=1, optimizers={})


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_split_on_the_contracted_dim_of_the_first_einsum_is_refused(api):
    wrong = [("mlp$", Region(dims={"w_gate": -2, "w_up": -1, "w_down": -2}))]
    mesh = {"data": 2, "tensor": 4}
    with pytest.raises(RuleError, match=r"test_raw_kernels\.py:\d+ .*'d' for operand 1 \(8\)") as refused:
        check_sharded(_model(api), BATCH, cross_entropy, mesh, tp_rules=wrong, steps=1)
    named_fix(refused, "leave the modules around that line whole")
    check_sharded(_model(api), BATCH, cross_entropy, mesh, steps=1, optimizers={})


def test_a_region_naming_what_the_module_does_not_hold_or_dims_for_the_axis_is_one_error_with_its_fix():
    missing = [("mlp$", Region(dims={"w_gate": -1, "w_upp": -1, "w_down": -2}))]
    with pytest.raises(RuleError, match=re.escape("names ['w_upp'], which it does not hold")):
        check_sharded(
            _model("linen"), BATCH, cross_entropy, {"data": 2, "tensor": 4}, tp_rules=missing, steps=1
        )
    with pytest.raises(RuleError, match=r"pass the parameters' dims by keyword: Region\(dims=") as told:
        Region({"w_gate": -1})
    named_fix(told, "Region(dims=")
    with pytest.raises(RuleError, match="counted from the end"):
        Region(dims={"w_down": 0})


class LinenDenseSwiGLU(nn.Module):
    """The same MLP, one kernel a module: Megatron's plan by the column and row roles."""

    @nn.compact
    def __call__(self, x):
        gate, up = (nn.Dense(H, use_bias=False, name=name)(x) for name in ("gate", "up"))
        return nn.Dense(D, use_bias=False, name="down")(nn.silu(gate) * up)


DENSE_RULES = [(r"mlp/(gate|up)$", ColumnParallel()), (r"mlp/down$", RowParallel())]


class Holder(nn.Module):
    dense: bool = False

    @nn.compact
    def __call__(self, x):
        # (a norm's scale before it: the input's gradient is needed, so f's backward runs)
        return (LinenDenseSwiGLU if self.dense else LinenSwiGLU)(name="mlp")(nn.RMSNorm(name="norm")(x))


def _step_collectives(module: Holder, tp_rules, check_vma: bool) -> tuple[list[tuple[str, int]], int]:
    """``(kind, operand bytes)`` of every collective of the compiled SGD step of ``module`` on
    data 2 x tensor 4 (forward, backward and update), and its matmuls' FLOPs per device."""
    mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
    model = fsdp_tp.shard_by_rules(Holder, [], batch_axes=("data",), tp_rules=tp_rules)(module.dense)
    x = jnp.ones((8, 4, D))

    def init_fn(rng):
        params = model.init(rng, x[:4])["params"]
        return fsdp_tp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), rng=rng)

    def step_fn(state, x):
        loss = lambda p: (model.apply({"params": p}, x) ** 2).mean()
        grads = fsdp_tp.sync_gradients(jax.grad(loss)(state.params), ("data",))
        return grads, ()

    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0), check_vma=check_vma)
    step = fsdp_tp.shard_step(step_fn, mesh, specs, P("data"), metrics_specs=(), check_vma=check_vma)
    lowered = step.lower(state, x)
    text = lowered.compile().as_text()
    found = sorted((c.kind, c.operand_bytes) for c in parse_collectives(text) if c.group_size > 1)
    return found, dot_flops(lowered.as_text(dialect="hlo"))


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_region_moves_what_its_one_kernel_a_module_twin_moves_megatron_s_minimum(check_vma):
    """One all-reduce over ``tensor`` forward (the row sum) and one backward (*f*, shared by the
    gate and up reads), of a device's activations (4 x 4 x 8 float32); the gradients' sync over
    ``data``; no kernel gathered over ``tensor``; a fourth of the matmuls' FLOPs. The same as the
    model written one kernel a module under Megatron's rules."""
    region, flops = _step_collectives(Holder(), RULES, check_vma)
    activation = 4 * 4 * D * 4
    assert [c for c in region if c == ("all-reduce", activation)] == [("all-reduce", activation)] * 2
    assert not [c for c in region if c[0] == "all-gather"]
    assert (region, flops) == _step_collectives(Holder(dense=True), DENSE_RULES, check_vma)
    if check_vma:  # (each device a fourth: the unsharded FLOPs, which check_vma does not change)
        assert 4 * flops == _step_collectives(Holder(), [], check_vma)[1]


class LinenDroppingSwiGLU(LinenSwiGLU):
    """Dropout on the hidden units inside the module: where they split, only its code knows."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w_gate, w_up = (self.param(name, init, (D, H)) for name in ("w_gate", "w_up"))
        hidden = nn.Dropout(0.5, deterministic=False)(nn.silu(x @ w_gate) * (x @ w_up))
        return hidden @ self.param("w_down", init, (H, D))


class LinenDroppingModel(LinenLM):
    outside: bool = False  # (the dropout after the module's sum, the fix its refusal names)

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        if self.outside:
            return nn.Dense(V, name="head")(
                x + nn.Dropout(0.25, deterministic=False)(LinenSwiGLU(name="mlp")(x))
            )
        return nn.Dense(V, name="head")(x + LinenDroppingSwiGLU(name="mlp")(x))


@pytest.mark.parametrize("check_vma", [True, False])
def test_dropout_inside_a_region_is_refused_in_both_check_vma_modes(check_vma):
    """Unchecked, it drew a mask no block of the unsharded one (1,024 of 1,024 outputs off):
    refused, naming the module and the fix; the fix (the dropout after the module's sum) draws
    the unsharded mask, equal to unsharded."""
    run = dict(steps=1, optimizers={}, rngs={"dropout": jax.random.key(3)}, check_vma=check_vma)
    mesh = {"data": 2, "tensor": 4}
    with pytest.raises(ValueError, match=r"mlp/Dropout_0: .*a module a Region computes") as refused:
        check_sharded(LinenDroppingModel(), BATCH, cross_entropy, mesh, tp_rules=RULES, **run)
    named_fix(refused, "move it out of the module, after its sum")
    if check_vma:
        check_sharded(LinenDroppingModel(outside=True), BATCH, cross_entropy, mesh, tp_rules=RULES, **run)


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4
ATTENTION = [("attn$", Region(dims={"q": -2, "kv": -2, "out": -3}))]


def _attention(x, q, kv, out, kv_heads: int | None):
    """Grouped-query causal attention from raw kernels q (d, H, hd), kv (2, d, G, hd), out (H, hd, d)
    (Gemma's einsums); the groups from the arrays (``kv_heads=None``) or from a constant."""
    b, t, _ = x.shape
    queries = jnp.einsum("btd,dnh->btnh", x, q)
    keys, values = jnp.einsum("bsd,cdkh->cbskh", x, kv)
    groups = keys.shape[2] if kv_heads is None else kv_heads
    queries = queries.reshape(b, t, groups, -1, queries.shape[-1])
    scores = jnp.einsum("btkgh,bskh->bkgts", queries, keys) / jnp.sqrt(queries.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    mixed = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(scores, axis=-1), values)
    return jnp.einsum("btnh,nhd->btd", mixed.reshape(b, t, -1, mixed.shape[-1]), out)


class LinenRawAttention(nn.Module):
    constant_groups: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        q = self.param("q", init, (D, HEADS, HEAD_DIM))
        kv = self.param("kv", init, (2, D, KV_HEADS, HEAD_DIM))
        out = self.param("out", init, (HEADS, HEAD_DIM, D))
        return _attention(x, q, kv, out, KV_HEADS if self.constant_groups else None)


class NNXRawAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, constant_groups: bool = False):
        init = nnx.initializers.lecun_normal()
        self.q = nnx.Param(init(rngs.params(), (D, HEADS, HEAD_DIM)))
        self.kv = nnx.Param(init(rngs.params(), (2, D, KV_HEADS, HEAD_DIM)))
        self.out = nnx.Param(init(rngs.params(), (HEADS, HEAD_DIM, D)))
        self.constant_groups = constant_groups

    def __call__(self, x):
        groups = KV_HEADS if self.constant_groups else None
        return _attention(x, self.q[...], self.kv[...], self.out[...], groups)


def _attention_lm(api: str, constant_groups: bool = False):
    return _lm(api, "attn", constant_groups)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_raw_kernel_gqa_attention_by_its_heads_splits_is_the_unsharded_model(api):
    """q split on its heads, the stacked kv on its kv heads, out on its heads: each device its
    query heads' group (H/G = 2) on data 4 x tensor 2; the groups counted from a constant are
    refused at the reshape (each device would regroup its 2 heads into 2 groups)."""
    mesh = {"data": 4, "tensor": 2}
    with pytest.raises(RuleError, match=r"test_raw_kernels\.py:\d+ .*reshape") as refused:
        check_sharded(_attention_lm(api, True), BATCH, cross_entropy, mesh, tp_rules=ATTENTION, steps=1)
    named_fix(refused, "size the dim the split lands on from the array, not from the module's constants")
    check_sharded(_attention_lm(api), BATCH, cross_entropy, mesh, tp_rules=ATTENTION, steps=1)


def _found(api: str, model, size: int) -> str:
    """The plan "auto" finds for ``model`` (a Linen module or an NNX constructor), printed."""
    if api == "linen":
        return str(fsdp_tp.linen.find_tp_rules(model, TOKENS, size=size))
    return str(fsdp_tp.nnx.find_tp_rules(model(nnx.Rngs(0)), TOKENS, size=size))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_auto_finds_each_raw_module_s_region_and_trains_equal_to_unsharded(api):
    """ "auto" prints the Region a user would write for the SwiGLU and the attention, and the
    attention trains equal to unsharded with it; with a norm between the einsums it leaves the
    module whole, naming the norm's line (the region it tried, refused)."""
    assert "(r\"^mlp$\", Region(dims={'w_down': -2, 'w_gate': -1, 'w_up': -1}))," in _found(
        api, _model(api), 4
    )
    said = _found(api, _attention_lm(api), 2)
    assert "(r\"^attn$\", Region(dims={'kv': -2, 'out': -3, 'q': -2}))," in said
    # (the SwiGLU trained by "auto": the composed raw-MoE test's shared expert, on fsdp x expert x tensor)
    once = dict(steps=1, optimizers={})
    check_sharded(_attention_lm(api), BATCH, cross_entropy, {"data": 4, "tensor": 2}, tp_rules="auto", **once)
    left = _found(api, _model(api, norm=True), 4)
    assert "Region(" not in left and re.search(
        r"#   mlp: .*reduce_sum over dim 2 .* at tests/test_raw_kernels\.py:\d+", left
    )


EXPERTS, TOP_K = 4, 2
BANK = [("experts$", ExpertParallel(dims={"w_gate": -3, "w_up": -3, "w_down": -3}))]
EINSUM_BANK = [(r"experts/(gate|up)$", ExpertParallel()), (r"experts/down$", ExpertParallel(returns=True))]
EXPERT_MESH, EXPERT_AXES = {"data": 2, "expert": 4}, ("data", "expert")


def _experts(x, w_gate, w_up, w_down, dropout=None):
    """A gated expert MLP on buffers (groups, E, capacity, d), kernels (E, d, h) and (E, h, d);
    ``dropout``: a layer on its hidden units."""
    hidden = nn.silu(jnp.einsum("gecd,edh->gech", x, w_gate)) * jnp.einsum("gecd,edh->gech", x, w_up)
    return jnp.einsum("gech,ehd->gecd", hidden if dropout is None else dropout(hidden), w_down)


class LinenRawBank(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w_gate, w_up = (self.param(name, init, (EXPERTS, D, H)) for name in ("w_gate", "w_up"))
        return _experts(x, w_gate, w_up, self.param("w_down", init, (EXPERTS, H, D)))


class LinenEinsumBank(nn.Module):
    """The same bank one kernel a module (the library's own experts' layout)."""

    @nn.compact
    def __call__(self, x):
        gate, up = (nn.Einsum((EXPERTS, D, H), "GECD,EDH->GECH", False, name=n)(x) for n in ("gate", "up"))
        return nn.Einsum((EXPERTS, H, D), "GECH,EHD->GECD", False, name="down")(nn.silu(gate) * up)


class LinenRawMoE(nn.Module):
    capacity_factor: float | None = None
    einsums: bool = False
    shared: bool = False  # (a shared expert every token takes: a one-module SwiGLU)

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        bank = (LinenEinsumBank if self.einsums else LinenRawBank)(name="experts")
        router = nn.Dense(EXPERTS, use_bias=False, name="router")
        y, _ = mixture(x, router, bank, k=TOP_K, capacity_factor=self.capacity_factor, group_rows=1)
        if self.shared:
            y = y + LinenSwiGLU(name="shared")(x)
        return nn.Dense(V, name="head")(x + y)


class NNXRawBank(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_gate, self.w_up = (nnx.Param(init(rngs.params(), (EXPERTS, D, H))) for _ in range(2))
        self.w_down = nnx.Param(init(rngs.params(), (EXPERTS, H, D)))

    def __call__(self, x):
        return _experts(x, self.w_gate[...], self.w_up[...], self.w_down[...])


class NNXRawMoE(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, capacity_factor: float | None = None, shared: bool = False):
        self.embed, self.head = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, V, rngs=rngs)
        self.router = nnx.Linear(D, EXPERTS, use_bias=False, rngs=rngs)
        self.experts, self.capacity_factor = NNXRawBank(rngs), capacity_factor
        self.shared = NNXSwiGLU(rngs) if shared else None

    def __call__(self, tokens):
        x = self.embed(tokens)
        y, _ = mixture(
            x, self.router, self.experts, k=TOP_K, capacity_factor=self.capacity_factor, group_rows=1
        )
        return self.head(x + y + (self.shared(x) if self.shared is not None else 0))


def _raw_moe(api: str, capacity_factor: float | None = None, shared: bool = False):
    if api == "linen":
        return LinenRawMoE(capacity_factor, shared=shared)
    return lambda rngs: NNXRawMoE(rngs, capacity_factor, shared)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_bank_of_raw_expert_kernels_by_its_experts_splits_is_the_unsharded_model(api):
    """Top-2 routing, dropless and (Linen) with a capacity (tokens dropped as unsharded), the bank's
    kernels (E, d, h) split on E over ``expert`` (which splits the batch with ``data``): the
    rule "auto" finds too (each kernel's experts dim, the dim every einsum reading it batches
    over), printed as a user writes it, so the plan trained is also its. An expert axis that
    does not divide the experts leaves the bank whole, named."""
    found = (
        fsdp_tp.linen.find_tp_rules(LinenRawMoE(), TOKENS, expert_size=4)
        if api == "linen"
        else fsdp_tp.nnx.find_tp_rules(NNXRawMoE(nnx.Rngs(0)), TOKENS, expert_size=4)
    )
    assert found.rules == (("^experts$", BANK[0][1]),) and str(found).count("ExpertParallel(dims=") == 1
    once = dict(batch_axes=EXPERT_AXES, steps=1)
    check_sharded(_raw_moe(api), BATCH, cross_entropy, EXPERT_MESH, tp_rules=BANK, **once)
    if api == "linen":  # (the slots the library's routing gives, whichever front end)
        check_sharded(
            _raw_moe(api, 1.0), BATCH, cross_entropy, EXPERT_MESH, tp_rules=BANK, optimizers={}, **once
        )
    if api == "linen":
        left = str(fsdp_tp.linen.find_tp_rules(LinenRawMoE(), TOKENS, expert_size=3))
        assert "#   experts: " in left and "its 4 experts, which 'expert' of 3 does not divide" in left


def _moe_collectives(cls: type[nn.Module], rules, mesh=EXPERT_MESH, **fields) -> list[tuple[str, int]]:
    """``(kind, operand bytes)`` of every collective of the compiled gradient of an MoE LM
    ``cls(**fields)`` on ``mesh`` (its batch over data and expert) by ``rules``."""
    axes = ("data", "expert")
    model = fsdp_tp.shard_by_rules(cls, [], batch_axes=axes, tp_rules=rules)(**fields)

    def init_fn(rng):
        params = model.init(rng, TOKENS[:1])["params"]
        return fsdp_tp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), rng=rng)

    def step_fn(state, data):
        loss = lambda p: cross_entropy(model.apply({"params": p}, data[0]), data[1])
        return fsdp_tp.sync_gradients(jax.grad(loss)(state.params), axes), ()

    state, specs = fsdp_tp.init_sharded(init_fn, fsdp_tp.make_mesh(mesh), P(), jax.random.key(0))
    step = fsdp_tp.shard_step(step_fn, fsdp_tp.make_mesh(mesh), specs, P(axes), metrics_specs=())
    text = step.lower(state, BATCH).compile().as_text()
    return sorted((c.kind, c.operand_bytes) for c in parse_collectives(text))


def _moe_all_to_alls(cls: type[nn.Module], rules, **fields) -> list[tuple[str, int]]:
    """The all-to-alls and all-gathers of :func:`_moe_collectives` on data 2 x expert 4 (no
    parameter is FSDP-split: an all-gather would be an expert's weights)."""
    return [c for c in _moe_collectives(cls, rules, **fields) if c[0] in ("all-to-all", "all-gather")]


def test_a_raw_bank_moves_the_einsum_bank_s_all_to_alls_and_gathers_no_expert():
    """One all-to-all to the experts' devices and one back, forward and backward: four, each of
    a device's buffer, as the same bank written one nn.Einsum a kernel moves; so does a module
    that routes in its own call (the all-to-alls placed inside it)."""
    raw = _moe_all_to_alls(LinenRawMoE, BANK)
    assert len(raw) == 4 and raw == _moe_all_to_alls(LinenRawMoE, EINSUM_BANK, einsums=True)
    assert _moe_all_to_alls(LinenRoutingMoE, ROUTED) == raw


def test_negative_control_a_raw_bank_s_kernel_gradient_unscaled_is_caught(monkeypatch):
    """A device's experts meet every device's tokens: their gradient is the mean over the
    devices' losses. Left the sum (the 1/n scaling dropped), the harness sees n times it."""
    import fsdp_tp.tp._expert_call as expert_call

    monkeypatch.setattr(expert_call, "cotangent_times", lambda x, factor: x)
    with pytest.raises(AssertionError, match=r"grads\['experts'\]"):
        once = dict(batch_axes=EXPERT_AXES, steps=1, optimizers={})
        check_sharded(_raw_moe("linen"), BATCH, cross_entropy, EXPERT_MESH, tp_rules=BANK, **once)


COMPOSED_MESH, COMPOSED_AXES = {"fsdp": 2, "expert": 2, "tensor": 2}, ("fsdp", "expert")
# FSDP on the model dim each kernel's expert or tensor split leaves whole
MOE_FSDP = [
    (r"experts/w_(gate|up)$", P(None, "fsdp")),
    (r"experts/w_down$", P(None, None, "fsdp")),
    (r"shared/w_(gate|up)$", P("fsdp")),
    (r"shared/w_down$", P(None, "fsdp")),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_a_raw_moe_with_a_shared_expert_on_fsdp_expert_tensor_by_rules_and_by_auto(api, check_vma):
    """The bank over ``expert``, the shared expert (a one-module SwiGLU) a Region over
    ``tensor``, both FSDP-split on their model dim, capacity 1.0: equal to unsharded by the
    rules; "auto" finds the same roles and trains equal too."""
    rules = [*BANK, ("shared$", SWIGLU)]
    once = dict(batch_axes=COMPOSED_AXES, steps=1, check_vma=check_vma)
    model = _raw_moe(api, 1.0, shared=True)
    check_sharded(model, BATCH, cross_entropy, COMPOSED_MESH, MOE_FSDP, tp_rules=rules, **once)
    if check_vma:  # (the router alone left whole: its softmax reads every expert's logit)
        said = r"leaves 1 of 5 layers whole.*: router \(router/kernel"
        with pytest.warns(LayerLeftWholeWarning, match=said):
            auto = dict(tp_rules="auto", optimizers={})
            check_sharded(model, BATCH, cross_entropy, COMPOSED_MESH, MOE_FSDP, **auto, **once)


class LinenRawHead(nn.Module):
    """Logits from a raw kernel (d, V): a module that ends on a column."""

    @nn.compact
    def __call__(self, x):
        return x @ self.param("w", nn.initializers.lecun_normal(), (D, V))


class LinenRawHeadLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return LinenRawHead(name="head")(x + LinenSwiGLU(name="mlp")(x))


def test_a_region_ending_on_a_column_gathers_its_output():
    """``gather_output=True``: the head's vocabulary split over ``tensor``, its logits gathered
    along their last dim, as "auto" finds it (a region reaching the model's output), equal to
    unsharded. Without it, each device's slice would be summed as a row's is, 8 of 32 logits a
    token: the plan check refuses it (a sum of blocks no read contracted). Asked to leave the
    output split, "auto" leaves the head whole, named."""
    head = Region(dims={"w": -1}, gather_output=True)
    found = fsdp_tp.linen.find_tp_rules(LinenRawHeadLM(), TOKENS, size=4)
    assert found.rules[1:] == (("^mlp$", SWIGLU), ("^head$", head))
    mesh, once = {"data": 2, "tensor": 4}, dict(steps=1, optimizers={})
    check_sharded(LinenRawHeadLM(), BATCH, cross_entropy, mesh, tp_rules="auto", **once)
    summed = [*RULES, ("head$", Region(dims={"w": -1}))]
    with pytest.raises(RuleError, match=r"psum\w* sums over 'tensor' \(4\) the blocks") as refused:
        check_sharded(LinenRawHeadLM(), BATCH, cross_entropy, mesh, tp_rules=summed, **once)
    named_fix(refused, "Region(..., gather_output=True)")  # (applied above, as "auto" found it)
    left = str(fsdp_tp.linen.find_tp_rules(LinenRawHeadLM(), TOKENS, size=4, outputs_split=True))
    assert "#   head: " in left and "leave the model's output split (outputs_split=True)" in left


class LinenRoutingMoE(nn.Module):
    capacity: int | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="head")(x + LinenRoutingBlock(self.capacity, name="moe")(x))


def _routed(x, router, w_gate, w_up, w_down, capacity: int | None, dropout=None):
    """Router, dispatch, raw expert kernels and combine in one call (MaxText's layout): top-2 of
    each row's tokens, buffers (rows, E, capacity, d); ``dropout`` on the experts' hidden units."""
    choices = jax.vmap(lambda row: routing.route(row, TOP_K, capacity))(x @ router)
    out = _experts(jax.vmap(routing.dispatch)(x, choices), w_gate, w_up, w_down, dropout)
    return jax.vmap(routing.combine)(out, choices)


class LinenRoutingBlock(nn.Module):
    capacity: int | None = None
    dropout: float = 0.0  # (on the experts' hidden units, between the einsums)

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        router = self.param("router", init, (D, EXPERTS))
        w_gate, w_up = (self.param(name, init, (EXPERTS, D, H)) for name in ("w_gate", "w_up"))
        w_down = self.param("w_down", init, (EXPERTS, H, D))
        dropout = nn.Dropout(self.dropout, deterministic=False) if self.dropout else None
        return _routed(x, router, w_gate, w_up, w_down, self.capacity, dropout)


class NNXRoutingBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, capacity: int | None = None, dropout: float = 0.0):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(init(rngs.params(), (D, EXPERTS)))
        self.w_gate, self.w_up = (nnx.Param(init(rngs.params(), (EXPERTS, D, H))) for _ in range(2))
        self.w_down, self.capacity = nnx.Param(init(rngs.params(), (EXPERTS, H, D))), capacity
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        weights = (self.router, self.w_gate, self.w_up, self.w_down)
        return _routed(x, *(w[...] for w in weights), self.capacity, self.dropout)


class NNXRoutingMoE(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, capacity: int | None = None):
        self.embed, self.head = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, V, rngs=rngs)
        self.moe = NNXRoutingBlock(rngs, capacity)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.moe(x))


ROUTED = [("moe$", ExpertParallel(dims={"w_gate": -3, "w_up": -3, "w_down": -3}))]


def _routing_moe(api: str, capacity: int | None = None):
    return LinenRoutingMoE(capacity) if api == "linen" else lambda rngs: NNXRoutingMoE(rngs, capacity)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_module_that_routes_in_its_own_call_is_split_around_its_expert_einsums(api):
    """Router, dispatch, raw experts and combine in one ``__call__``: ExpertParallel(dims=...)
    puts the all-to-all between the dispatch and the first expert einsum and back before the
    combine (the module's call traced and run again with them in place), equal to unsharded:
    dropless (Linen also with the sequence split over ``context``, its plan checked there) and,
    by "auto" (NNX), with 2 slots an expert (tokens dropped as unsharded); "auto" finds the same
    role, the router left whole as it is read."""
    found = (
        fsdp_tp.linen.find_tp_rules(LinenRoutingMoE(), TOKENS, expert_size=4)
        if api == "linen"
        else fsdp_tp.nnx.find_tp_rules(NNXRoutingMoE(nnx.Rngs(0)), TOKENS, expert_size=4)
    )
    assert found.rules == (("^moe$", ROUTED[0][1]),)
    once = dict(batch_axes=EXPERT_AXES, steps=1)
    check_sharded(_routing_moe(api), BATCH, cross_entropy, EXPERT_MESH, tp_rules=ROUTED, **once)
    if api == "nnx":
        auto = dict(tp_rules="auto", optimizers={})
        check_sharded(_routing_moe(api, capacity=2), BATCH, cross_entropy, EXPERT_MESH, **auto, **once)
    else:  # (the sequence split over context too, the tokens sent from each device's share of it)
        sequence = {"data": 2, "context": 2, "expert": 2}
        check_sharded(
            _routing_moe(api), BATCH, cross_entropy, sequence, tp_rules=ROUTED, optimizers={}, **once
        )


class LinenSharedExpertBlock(LinenRoutingBlock):
    """The routed block with a shared expert every token takes, its layers submodules of the
    block (MaxText's and DeepSeek's layout: ``shared_gate``, ``shared_up``, ``shared_down``)."""

    @nn.compact
    def __call__(self, x):
        shared = nn.silu(nn.Dense(H, name="shared_gate")(x)) * nn.Dense(H, name="shared_up")(x)
        return super().__call__(x) + nn.Dense(D, name="shared_down")(shared)


class NNXSharedExpertBlock(NNXRoutingBlock):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.shared_gate, self.shared_up = (nnx.Linear(D, H, rngs=rngs) for _ in range(2))
        self.shared_down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        shared = nnx.silu(self.shared_gate(x)) * self.shared_up(x)
        return super().__call__(x) + self.shared_down(shared)


class LinenSharedExpertMoE(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="head")(x + LinenSharedExpertBlock(name="moe")(x))


class NNXSharedExpertMoE(NNXRoutingMoE):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.moe = NNXSharedExpertBlock(rngs)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_routed_module_holding_its_shared_expert_is_planned_whole_inside_and_a_rule_there_refused(api):
    """Issue 99 point 8: find_tp_rules(size=2, expert_size=2) raised on its own plan ("tp rule
    '...shared_gate$' -> ColumnParallel matches no submodule", listing it): a role inside a
    module whose ExpertParallel(dims=...) runs its call again never runs. The plan now leaves
    the shared expert whole, says why, and trains equal to unsharded on data x expert x tensor;
    such a rule by hand is refused naming the module around it, and the fix (dropping it) runs."""
    model = LinenSharedExpertMoE() if api == "linen" else NNXSharedExpertMoE
    find = fsdp_tp.linen.find_tp_rules if api == "linen" else fsdp_tp.nnx.find_tp_rules
    found = find(model if api == "linen" else model(nnx.Rngs(0)), TOKENS, size=2, expert_size=2)
    assert [pattern for pattern, _ in found.rules] == ["^embed$", "^moe$", "^head$"]
    assert {path for path, why in found.whole if "ExpertParallel(dims=...) runs its call again" in why} == {
        f"moe/shared_{name}" for name in ("gate", "up", "down")
    }
    once = dict(batch_axes=HYBRID_AXES, steps=1, optimizers={})
    check_sharded(model, BATCH, cross_entropy, HYBRID_MESH, tp_rules=found.rules, **once)
    inside = [*ROUTED, ("moe/shared_(gate|up)$", ColumnParallel()), ("moe/shared_down$", RowParallel())]
    with pytest.raises(RuleError, match=r"names moe/shared_gate, inside moe, whose role") as refused:
        check_sharded(model, BATCH, cross_entropy, HYBRID_MESH, tp_rules=inside, **once)
    named_fix(refused, "Fix: drop the rule")
    check_sharded(model, BATCH, cross_entropy, HYBRID_MESH, tp_rules=ROUTED, **once)


class LinenMisreadBlock(LinenRoutingBlock):
    """The routed block reading an expert kernel otherwise than through an einsum over its
    experts: summed into the output, or contracted over its experts."""

    misread: str = "summed"

    @nn.compact
    def __call__(self, x):
        out = super().__call__(x)
        w_up = self.get_variable("params", "w_up")
        if self.misread == "summed":
            return out + jnp.mean(w_up)
        return out + jnp.einsum("bse,edh->bsdh", x[..., :EXPERTS], w_up)[..., 0]


class LinenMisreadMoE(nn.Module):
    misread: str

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="head")(x + LinenMisreadBlock(misread=self.misread, name="moe")(x))


@pytest.mark.parametrize("misread", ["summed", "contracted"])
def test_an_expert_kernel_read_otherwise_than_by_its_experts_is_refused_with_the_fix(misread):
    """A kernel each device holds only its experts of, read whole (a sum of it) or with its experts
    contracted, has no value on one device: refused at the model's line, naming the kernel; the
    fix (the module left whole) trains equal to unsharded."""
    once = dict(batch_axes=EXPERT_AXES, steps=1, optimizers={})
    op = "reduce_sum" if misread == "summed" else "dot_general"
    said = rf"{op} at tests/test_raw_kernels.py:\d+ \(LinenMisreadBlock.__call__\) reads the expert kernel"
    said += " 'w_up'"
    with pytest.raises(
        RuleError, match=rf"moe \(ExpertParallel\(dims=...\) over 'expert'\): {said}"
    ) as refused:
        check_sharded(LinenMisreadMoE(misread), BATCH, cross_entropy, EXPERT_MESH, tp_rules=ROUTED, **once)
    named_fix(refused, "leave the module whole")
    check_sharded(LinenMisreadMoE(misread), BATCH, cross_entropy, EXPERT_MESH, **once)


HIDDEN = Region(dims={"w_gate": -1, "w_up": -1, "w_down": -2})  # (each expert's hidden dim)
HYBRID = [("moe$", ExpertParallel(dims=ROUTED[0][1].dims, within=HIDDEN))]
HYBRID_MESH, HYBRID_AXES = {"data": 2, "expert": 2, "tensor": 2}, ("data", "expert")


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_raw_experts_over_expert_with_each_hidden_dim_over_tensor_are_the_unsharded_model(api):
    """``within=Region(dims=...)``: the routed module's kernels split on their experts over
    ``expert`` and each expert's hidden dim over ``tensor`` (a kernel on two axes), equal to
    unsharded on data 2 x expert 2 x tensor 2: NNX by the rule, Linen by "auto", which finds
    that role (its within the Region it finds over tensor), with check_vma off."""
    once = dict(batch_axes=HYBRID_AXES, steps=1)
    if api == "nnx":
        check_sharded(_routing_moe(api), BATCH, cross_entropy, HYBRID_MESH, tp_rules=HYBRID, **once)
        return
    found = fsdp_tp.linen.find_tp_rules(LinenRoutingMoE(), TOKENS, size=2, expert_size=2)
    assert dict(found.rules)["^moe$"] == HYBRID[0][1]
    check_sharded(
        LinenRoutingMoE(), BATCH, cross_entropy, HYBRID_MESH, tp_rules="auto", check_vma=False, **once
    )


def test_raw_experts_split_twice_move_what_einsum_experts_split_twice_move():
    """The raw bank with ``within=Region(...)`` compiles to the collectives of the same bank
    written one nn.Einsum a kernel under ``ExpertParallel(within=ColumnParallel())`` for gate
    and up and ``within=RowParallel()`` for down: the all-to-alls each way, one all-reduce over
    ``tensor`` forward (down's sum) and one backward (gate's and up's input gradients, *f*
    once), no weight gathered."""
    raw = [("experts$", ExpertParallel(dims=BANK[0][1].dims, within=HIDDEN))]
    einsums = [
        (r"experts/(gate|up)$", ExpertParallel(within=ColumnParallel())),
        (r"experts/down$", ExpertParallel(returns=True, within=RowParallel())),
    ]
    moved = _moe_collectives(LinenRawMoE, raw, HYBRID_MESH)
    assert moved == _moe_collectives(LinenRawMoE, einsums, HYBRID_MESH, einsums=True)
    assert not [c for c in moved if c[0] == "all-gather"]


def test_negative_control_raw_experts_split_twice_without_f_are_caught(monkeypatch):
    """Without *f* on the buffers sent to the experts, their gradient is one device's part
    of the hidden dims' sum over ``tensor``: the harness sees the embedding's gradient off."""
    import fsdp_tp.tp._expert_call as expert_call

    monkeypatch.setattr(expert_call, "copy_to_axis", lambda x, axis: x)
    with pytest.raises(AssertionError, match=r"grads\['embed'\]"):
        once = dict(batch_axes=HYBRID_AXES, steps=1, optimizers={}, check_vma=False)
        check_sharded(LinenRoutingMoE(), BATCH, cross_entropy, HYBRID_MESH, tp_rules=HYBRID, **once)


def test_raw_experts_within_a_column_role_is_refused_with_the_fix():
    """On raw expert kernels each expert's hidden split is a Region naming each kernel's dim;
    an einsum layer's ColumnParallel there is refused, naming the Region, which then runs."""
    with pytest.raises(RuleError, match=r"on raw expert kernels \(dims=\) Region\(dims=...\)") as refused:
        ExpertParallel(dims=ROUTED[0][1].dims, within=ColumnParallel())
    named_fix(refused, "Region(dims=...) naming each kernel's hidden dim")  # (trained above)


class LinenDroppingRoutingMoE(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="head")(x + LinenRoutingBlock(dropout=0.25, name="moe")(x))


DROPOUT = {"dropout": jax.random.key(3)}


def test_dropout_on_routed_experts_draws_the_unsharded_mask_and_split_twice_is_refused():
    """Dropout between the expert einsums draws the unsharded mask's block of this device's rows
    (whole, before the all-to-all) and sends it with them: equal to unsharded. With each
    expert's hidden dim split over ``tensor`` too, which dims are split the dropout cannot
    tell: refused before anything trains, as inside a Region; the fix named (the experts alone
    on their axis) runs."""
    once = dict(batch_axes=HYBRID_AXES, steps=1, optimizers={}, rngs=DROPOUT)
    check_sharded(LinenDroppingRoutingMoE(), BATCH, cross_entropy, HYBRID_MESH, tp_rules=ROUTED, **once)
    with pytest.raises(ValueError, match=r"moe/Dropout_0: .*splits twice") as refused:
        check_sharded(LinenDroppingRoutingMoE(), BATCH, cross_entropy, HYBRID_MESH, tp_rules=HYBRID, **once)
    named_fix(refused, "drop within=, the experts alone on their axis")  # (ROUTED: run above)


def test_negative_control_a_routed_dropout_mask_not_sent_with_its_rows_is_caught(monkeypatch):
    """The mask applied where the buffer's rows went, without sending it: another mask's
    positions, caught by the harness."""
    import fsdp_tp.tp._expert_call as expert_call

    def unsent(self, var, env, place):  # (this device's rows' mask, read in the sent layout)
        local = list(var.aval.shape)
        local[place.experts], local[place.rows] = local[place.experts] // self.n, local[place.rows] * self.n
        return env[var].reshape(local)

    monkeypatch.setattr(expert_call._Rerun, "_there", unsent)
    with pytest.raises(AssertionError, match=r"output"):
        once = dict(batch_axes=EXPERT_AXES, steps=1, optimizers={}, rngs=DROPOUT)
        check_sharded(LinenDroppingRoutingMoE(), BATCH, cross_entropy, EXPERT_MESH, tp_rules=ROUTED, **once)


class LinenRectifiedRoutingBlock(LinenRoutingBlock):
    """The routed block with a custom-derivative function (jax.nn.relu) on its combined output."""

    @nn.compact
    def __call__(self, x):
        return jax.nn.relu(super().__call__(x))


class LinenRectifiedRoutingMoE(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="head")(x + LinenRectifiedRoutingBlock(name="moe")(x))


def test_a_custom_derivative_on_raw_experts_split_twice_is_refused_and_the_fix_runs():
    """Split twice, the experts' output is summed over ``tensor`` where the trace typed it a
    part of that sum: a function with a custom derivative (relu's, 0 at 0) cannot run as
    traced, nor its body stand in for it. Refused at its line; the fix named (within= dropped)
    trains equal to unsharded."""
    once = dict(batch_axes=HYBRID_AXES, steps=1, optimizers={})
    model = LinenRectifiedRoutingMoE()
    with pytest.raises(RuleError, match=r"custom_jvp_call at .*custom derivative") as refused:
        check_sharded(model, BATCH, cross_entropy, HYBRID_MESH, tp_rules=HYBRID, **once)
    named_fix(refused, "or drop within=")
    check_sharded(model, BATCH, cross_entropy, HYBRID_MESH, tp_rules=ROUTED, **once)


class NNXDroppingRoutingMoE(nnx.Module):
    """The routed NNX model with dropout inside its block (``inside``), or after the block's
    output (the fix its refusal names)."""

    def __init__(self, rngs: nnx.Rngs, inside: bool = True):
        self.embed, self.head = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, V, rngs=rngs)
        self.moe = NNXRoutingBlock(rngs, dropout=0.25 if inside else 0.0)
        self.dropout = None if inside else nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        y = self.moe(x)
        return self.head(x + (y if self.dropout is None else self.dropout(y)))


def test_an_nnx_dropout_inside_a_routed_module_is_refused_and_the_fix_runs():
    """NNX draws a dropout mask by updating its rng count, state made outside the trace the
    role runs the module's call in: refused at the module with the fix (the dropout after the
    module's output), which draws the unsharded mask, equal to unsharded."""
    once = dict(batch_axes=EXPERT_AXES, steps=1, optimizers={})
    with pytest.raises(RuleError, match=r"moe: ExpertParallel traces this module's call anew") as refused:
        check_sharded(NNXDroppingRoutingMoE, BATCH, cross_entropy, EXPERT_MESH, tp_rules=ROUTED, **once)
    named_fix(refused, "Move that layer out of the module (a dropout after its output)")
    outside = lambda rngs: NNXDroppingRoutingMoE(rngs, inside=False)
    check_sharded(outside, BATCH, cross_entropy, EXPERT_MESH, tp_rules=ROUTED, **once)

"""Issue 44: Megatron tensor parallelism for a model written the way Gemma and Llama are.

:mod:`fsdp_tp.models.llama` (einsum q and kv projections with grouped-query attention and RoPE,
an output einsum, a gated einsum MLP, RMSNorm, logits tied to the embedding), in Linen and in
NNX, with one rule per projection (``fsdp_tp.models.llama.RULES``). Properties: docs/design.md
invariants 1-5 against the unsharded model on data 2 x fsdp 2 x tensor 2 (``check_vma`` on)
and on data 2 x tensor 4 (8 query heads, 4 kv heads; off); the step's all-reduce operands
over ``tensor`` are Megatron's minimum, ``4 x layers + 2``, no weight is all-gathered over
``tensor``, FSDP moves W_min with one reduce-scatter per parameter (the tied embedding too),
and the matmuls are 1/tensor. Any column-then-row einsum pair (hypothesis) equals the
unsharded pair; a module class of one's own takes the roles once registered
(``register_einsum``). An einsum a role cannot split is named with its equation and letter.
Negative controls for each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import fsdp_tp
import fsdp_tp.tp._registered
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import operand_count, parse_collectives
from fsdp_tp.bench.llama_rows import llama_section, measure
from fsdp_tp.bench.lm_step import lowered_lm_step
from fsdp_tp.errors import IndivisibleShapeError, RuleError
from fsdp_tp.models.llama import FSDP_RULES, RULES, SIZES, LlamaLM, NNXLlamaLM
from fsdp_tp.testing import NNXSharded as Sharded
from fsdp_tp.testing import NNXTwin as Twin
from fsdp_tp.tp import ColumnParallel, RowParallel, register_einsum
from fsdp_tp.tp import _matmul as tp_matmul
from tests.conftest import first_block
from tests.equivalence import Case, check_equivalence, check_split, next_token_loss
from tests.refusals import named_fix

APIS = ["linen", "nnx"]
MESHES = {
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "data4_tensor2": {"data": 4, "tensor": 2},
    "data2_tensor4": {"data": 2, "tensor": 4},
    "fsdp4_tensor2": {"fsdp": 4, "tensor": 2},
    "fsdp2_tensor4": {"fsdp": 2, "tensor": 4},
}
BATCH, SEQ = 8, 8
EXACT = dict(param_dtype=jnp.float64)


def _batch(mesh_name: str) -> tuple[str, ...]:
    return tuple(axis for axis in MESHES[mesh_name] if axis != "tensor")


def _models(api: str, mesh_name: str, tp=RULES, policy=None, **options):
    storage = FSDP_RULES if "fsdp" in MESHES[mesh_name] else []
    batch = _batch(mesh_name)
    if api == "nnx":
        make = functools.partial(NNXLlamaLM, **options)
        return Sharded(make, storage, batch_axes=batch, tp_rules=tp, mixed_precision=policy), Twin(make)
    model = fsdp_tp.shard_by_rules(LlamaLM, storage, batch_axes=batch, tp_rules=tp, mixed_precision=policy)
    return model(**options), LlamaLM(**options)


def _case(api: str, mesh_name: str, check_vma: bool, policy=None) -> Case:
    # On tensor 4 the model has 8 query heads and 4 kv heads, so the axis divides both.
    heads = dict(heads=8, kv_heads=4) if MESHES[mesh_name]["tensor"] == 4 else {}
    with jax.enable_x64(True):  # an NNX model's constructor runs here, and keeps its dtypes
        model, twin = _models(api, mesh_name, policy=policy, **EXACT, **heads)
    loss = next_token_loss
    mesh = fsdp_tp.make_mesh(MESHES[mesh_name])
    batch = _batch(mesh_name)
    tokens = dict(seq_len=SEQ, vocab=SIZES["vocab"])
    case = Case(model, twin, mesh, batch, check_vma, 0, 0, **tokens, loss=loss, reference_loss=loss)
    return case if policy is None else dataclasses.replace(case, twin_reads=policy.round)


@pytest.mark.parametrize("mesh_name, check_vma", [("data2_fsdp2_tensor2", True), ("data2_tensor4", False)])
@pytest.mark.parametrize("api", APIS)
def test_einsum_attention_and_gated_mlp_equal_unsharded(api, mesh_name, check_vma):
    with jax.enable_x64(True):  # (float64: see tests/test_tp_rules.EXACT)
        check_equivalence(_case(api, mesh_name, check_vma))


@pytest.mark.parametrize("api", APIS)
def test_fp8_gathers_compose_with_tensor_parallelism(api):
    """Issue 60: the Llama-style model (einsum attention, gated MLP, tied logits) under
    Megatron's rules on data 2 x fsdp 2 x tensor 2 with its FSDP gathers in float8_e4m3fn:
    the tensor-split parameters gathered in 8 bits over fsdp only, each row scaled by its
    largest magnitude over every axis that splits the row (fsdp and tensor alike), equal to
    the twin computing on ``policy.round(params)`` (invariants 1-5)."""
    with jax.enable_x64(True):
        check_equivalence(_case(api, "data2_fsdp2_tensor2", True, fsdp_tp.MixedPrecision(jnp.float8_e4m3fn)))


def _step(api: str, tp=RULES, mesh_name: str = "fsdp4_tensor2"):
    """One lowered AdamW step of the model, and its state's shapes."""
    model, _ = _models(api, mesh_name, tp=tp)
    mesh = fsdp_tp.make_mesh(MESHES[mesh_name])
    return lowered_lm_step(model, mesh, _batch(mesh_name), jnp.zeros((BATCH, SEQ), jnp.int32))


TINY = dict(sizes=SIZES, batch=BATCH, seq=SEQ)  # the benchmark's figures of the small model


@pytest.mark.parametrize("api", APIS)
def test_megatrons_all_reduces_fsdp_at_the_minimum_and_half_the_matmuls(api):
    """On fsdp 4 x tensor 2 (the axes told apart by their sizes), the benchmark's figures: over
    `tensor`, per block one all-reduce forward and one backward for the attention (q and kv
    share the input's *f*) and for the gated MLP (gate and up share it), plus the embedding's
    sum and the tied logits' input gradient: 4 x layers + 2; the only gather over `tensor` is
    the logits'. Over `fsdp`, each FSDP-split parameter is gathered once (its tensor slice:
    W_min) and its gradient reduce-scattered once, the tied embedding included. Every matmul
    is half the size of the model's whole on each device (the storage plan's)."""
    megatron = measure(api, "fsdp4_tensor2", "megatron", **TINY)
    assert megatron.tensor_all_reduces == 4 * SIZES["layers"] + 2
    (logits,) = [c for c in megatron.collectives if c.kind == "all-gather" and c.group_size == 2]
    assert logits.operands == megatron.tensor_all_gathers == 1
    assert logits.operand_types[0].startswith(f"f32[{BATCH // 4},{SEQ},{SIZES['vocab'] // 2}]")
    assert megatron.fsdp_gathered == megatron.w_min
    assert megatron.reduce_scatters == megatron.fsdp_split == 6 * SIZES["layers"] + 1  # 6 kernels a block
    storage = measure(api, "fsdp4_tensor2", "storage", **TINY)
    assert storage.flops == 2 * megatron.flops
    assert storage.tensor_all_reduces == 0 and storage.tensor_all_gathers > 0  # weights move instead
    section = llama_section([(megatron, [1.0]), (storage, [2.0])])
    figures = "10 (10) | 1 | 1.000 | 13 / 13 | 0.500"  # all-reduces (minimum), gathers, W_min, RS, FLOPs
    assert f"| fsdp4_tensor2 | {api} | megatron | {megatron.state_bytes:,} | {figures} |" in section
    assert "| 2.000 |" in section  # the storage step's time over Megatron's


@pytest.mark.parametrize(
    "api, bias", [("linen", "['block_0']['attn']['out']"), ("nnx", "['blocks'][0]['attn']['out']")]
)
def test_negative_control_a_row_einsum_adding_its_own_bias(monkeypatch, api, bias):
    """The output einsum keeping its bias on its slices: every device adds it before the sum
    (its gradient is 3 times the twin's on tensor 2)."""
    local = RowParallel.local
    keeping_bias = lambda self, *a: dataclasses.replace(local(self, *a), use_bias=None)
    monkeypatch.setattr(RowParallel, "local", keeping_bias)
    with pytest.raises(AssertionError, match=re.escape(f"grads{bias}['bias']")), jax.enable_x64(True):
        with switched_off():
            check_equivalence(_case(api, "data4_tensor2", False))
    # The plan check refuses it before anything trains: the bias meets the partial sums.
    with pytest.raises(RuleError, match=r"RowParallel\(\) \(tp rule 'attn/out\$'\).*add adds a value whole"):
        with jax.enable_x64(True):
            check_equivalence(_case(api, "data4_tensor2", False))


def test_negative_control_query_heads_split_and_kv_heads_whole():
    """Without the kv rule every device holds both kv heads while its query heads are half of
    them: the attention, computing from shapes, pairs query heads with the wrong kv heads. The
    plan check refuses it at the reshape into kv groups (a device's 2 query heads regrouped as
    both kv groups); with the check off, the outputs differ."""
    rules = [rule for rule in RULES if rule[0] != r"attn/kv$"]
    with jax.enable_x64(True):
        case = _case("linen", "data4_tensor2", False)
        model, _ = _models("linen", "data4_tensor2", tp=rules, **EXACT)
        with pytest.raises(AssertionError, match="output"), switched_off():
            check_equivalence(dataclasses.replace(case, model=model))
        with pytest.raises(RuleError, match=r"models/llama.py:\d+ \(attention\).*reshape.*regroups"):
            check_equivalence(dataclasses.replace(case, model=model))


def test_negative_control_an_f_per_projection_all_reduces_shared_inputs_twice(monkeypatch):
    """Without the shared *f*, q and kv (and gate and up) each all-reduce their input's gradient."""
    monkeypatch.setattr(fsdp_tp.train, "shared_column_inputs", contextlib.nullcontext)
    assert measure("nnx", "fsdp4_tensor2", "megatron", **TINY).tensor_all_reduces == 6 * SIZES["layers"] + 2


def _without(pattern: str, *extra):
    return [rule for rule in RULES if rule[0] != pattern] + list(extra)


@pytest.mark.parametrize(
    "tp, error, match",
    [
        (
            _without(r"attn/q$", (r"attn/q$", ColumnParallel(letter="D"))),
            RuleError,
            r"attn/q: ColumnParallel splits an output dim of an einsum's kernel: a letter of the kernel "
            r"'DNH' in the output and not the inputs of 'BTD,DNH->BTNH'; letter 'D' is not one of them\. "
            r"Fix: give ColumnParallel\(letter=\.\.\.\) one of 'N', 'H'",
        ),
        (
            _without(r"attn/out$", (r"attn/out$", RowParallel(letter="D"))),
            RuleError,
            r"attn/out: RowParallel splits a contracted dim .* of 'BTNH,NHD->BTD'; letter 'D' is not one "
            r"of them\. Fix: give RowParallel\(letter=\.\.\.\) one of 'N', 'H'",
        ),
        (
            [(r"embed$", ColumnParallel(letter="V"))],
            RuleError,
            r"matches embed, a Embed, which ColumnParallel does not compute",
        ),
        (
            _without(r"mlp/(gate|up)$"),
            RuleError,
            r"mlp/down \(RowParallel\) cannot compute on its slices: its input \(2, 8, 32\) has 32 on "
            r"dim 2 \(letter 'F' of 'BTF,FD->BTD'\), where this device's slice is 16\. .* Fix: make the "
            r"layer that feeds .*mlp/down ColumnParallel, or drop .*mlp/down's rule so it stays whole",
        ),
    ],
    ids=["column-on-a-contracted-letter", "row-on-an-output-letter", "letter-on-an-embed", "row-fed-whole"],
)
@pytest.mark.parametrize("api", APIS)
def test_an_einsum_a_role_cannot_split_is_named_with_its_equation(api, tp, error, match):
    """Each refusal names the layer, the equation, the letter and a fix, in both front ends."""
    with pytest.raises(error, match=match):
        _step(api, tp=tp)


@pytest.mark.parametrize("api", APIS)
def test_kv_heads_the_axis_does_not_divide_are_named(api):
    """2 kv heads on tensor 4: the kv einsum's letter 'K' is named, with the sizes and the fix."""
    match = (
        r"attn/kv: kernel dim 'K' of 'BSD,CDKH->CBSKH' \(size 2\) is not divisible by mesh axis 'tensor' "
        r"\(size 4\); .*or keep its kernel whole with each device's block of the letter: replicated=True"
    )
    with pytest.raises(IndivisibleShapeError, match=match):
        _step(api, mesh_name="fsdp2_tensor4")


@st.composite
def einsum_pairs(draw):
    """A column einsum then a row einsum that contracts what the column one produced, with
    letters in any order, a batch written ``B`` or ``...``, biases or not; the letter split
    over `tensor` (size 4) is one the column einsum produces."""
    batch = draw(st.sampled_from(["B", "..."]))
    contracted = draw(st.sampled_from(["c", "cd"]))
    produced = draw(st.sampled_from(["p", "pq"]))
    out = draw(st.sampled_from(["o", "or"]))
    split = draw(st.sampled_from(produced))
    size = {c: (4 if c == split else draw(st.sampled_from([2, 3]))) for c in contracted + produced + out}
    perm = lambda s: "".join(draw(st.permutations(s)))
    column_kernel, middle, row_kernel = perm(contracted + produced), perm(produced), perm(produced + out)
    column = f"{batch}{perm(contracted)},{column_kernel}->{batch}{middle}"
    row = f"{batch}{middle},{row_kernel}->{batch}{perm(out)}"
    biases = (draw(st.booleans()), draw(st.booleans()))
    x_shape = (8, *(size[c] for c in column.split(",")[0].lstrip("B.")))
    return column, row, split, size, biases, x_shape


def _pair(api, column, row, size, biases):
    """The two einsums with a tanh between, in ``api``'s front end; biases drawn, not zero."""
    shapes = [tuple(size[c] for c in eq.split(",")[1].partition("-")[0]) for eq in (column, row)]
    bias_shapes = [tuple(size[c] for c in eq.split("->")[1] if c in size) for eq in (column, row)]
    normal = jax.nn.initializers.normal(1.0)
    if api == "nnx":

        class Pair(nnx.Module):
            def __init__(self, rngs):
                at = dict(bias_init=normal, rngs=rngs)
                self.col = nnx.Einsum(column, shapes[0], bias_shapes[0] if biases[0] else None, **at)
                self.row = nnx.Einsum(row, shapes[1], bias_shapes[1] if biases[1] else None, **at)

            def __call__(self, x):
                return self.row(jnp.tanh(self.col(x)))

        return Pair

    class LinenPair(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Einsum(shapes[0], column, use_bias=biases[0], bias_init=normal, name="col")(x)
            return nn.Einsum(shapes[1], row, use_bias=biases[1], bias_init=normal, name="row")(jnp.tanh(h))

    return LinenPair


@given(pair=einsum_pairs(), check_vma=st.booleans())
@pytest.mark.parametrize("api", APIS)
def test_any_column_then_row_einsum_pair_equals_unsharded(api, pair, check_vma):
    """Outputs and synced gradients of the pair split on the drawn letter, on data 2 x tensor 4,
    equal the unsharded pair's (float64: only a wrong split, sum or bias can differ)."""
    _check_pair(api, pair, check_vma)


def test_negative_control_a_row_einsum_without_its_sum(monkeypatch):
    """The pair check sees a row einsum whose partial products are not summed (with
    ``check_vma=True`` shard_map itself refuses the output, which varies over `tensor`)."""
    monkeypatch.setattr(tp_matmul, "row_reduce", lambda partial, axis, *_: partial)
    size = dict(c=2, p=4, o=3)
    pair = ("Bc,cp->Bp", "Bp,po->Bo", "p", size, (True, True), (8, 2))
    with pytest.raises(AssertionError, match="output"), switched_off():
        _check_pair("nnx", pair, check_vma=False)
    with pytest.raises(RuleError, match=r"the model's output leaves partial sums"):  # (the plan check)
        _check_pair("nnx", pair, check_vma=False)


def _check_pair(api, pair, check_vma: bool):
    column, row, split, size, biases, x_shape = pair
    rules = [(r"col$", ColumnParallel(letter=split)), (r"row$", RowParallel(letter=split))]
    check_split(api, _pair(api, column, row, size, biases), rules, x_shape, check_vma)


class MyDense(nn.Module):
    """A Linen layer the library has never seen: its kernel `w`, its size `features`."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], self.features), jnp.float64)
        return x @ w


class MyLinear(nnx.Module):
    """An NNX layer the library has never seen: it computes from its parameter's shape."""

    def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (d_in, d_out), jnp.float64))

    def __call__(self, x):
        return x @ self.w[...]


register_einsum(MyDense, "...i,io->...o", kernel="w", sizes={"features": "o"})
register_einsum(MyLinear, "...i,io->...o", kernel="w")


def _own_mlp(api):
    if api == "nnx":

        class OwnMLP(nnx.Module):
            def __init__(self, rngs):
                self.up, self.down = MyLinear(6, 16, rngs), MyLinear(16, 5, rngs)

            def __call__(self, x):
                return self.down(jnp.tanh(self.up(x)))

        return OwnMLP

    class LinenOwnMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return MyDense(5, name="down")(jnp.tanh(MyDense(16, name="up")(x)))

    return LinenOwnMLP


OWN_RULES = [(r"up$", ColumnParallel()), (r"down$", RowParallel())]


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("api", APIS)
def test_a_registered_module_of_your_own_takes_column_and_row_roles(api, check_vma):
    """register_einsum tells the roles what a class the library has never seen computes; its
    MLP split column then row equals the unsharded one."""
    check_split(api, _own_mlp(api), OWN_RULES, (8, 3, 6), check_vma)


@pytest.mark.parametrize("api", APIS)
def test_negative_control_an_unregistered_module_is_refused_by_name(api, monkeypatch):
    """Without the registration the same rules are refused, naming register_einsum."""
    monkeypatch.setattr(fsdp_tp.tp._registered, "_REGISTERED", {})
    with pytest.raises(RuleError, match=r"which has no tensor-parallel role .*register_einsum\(My"):
        check_split(api, _own_mlp(api), OWN_RULES, (8, 3, 6), True)


class MyBiasedDense(nn.Module):
    """A registered Linen layer that also makes a bias, which a row role would add per device."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], self.features))
        return x @ w + self.param("b", nn.initializers.normal(1.0), (self.features,))


register_einsum(MyBiasedDense, "...i,io->...o", kernel="w", sizes={"features": "o"})


def test_a_registered_module_with_more_than_its_kernel_is_refused_at_init():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return MyBiasedDense(5, name="down")(jnp.tanh(MyDense(16, name="up")(x)))

    with pytest.raises(
        RuleError, match=r"matches down, a MyBiasedDense that also computes with b, which "
    ) as refused:
        check_split("linen", Net, OWN_RULES, (8, 3, 6), True)
    # (it said "drop the rule": down's alone, and up's split then reached a whole down, refused)
    named_fix(refused, "leave down whole: drop its rule and those of the layers split with it (the column")
    check_split("linen", Net, [], (8, 3, 6), True)


REPLICATED_KV = _without(r"attn/kv$", (r"attn/kv$", ColumnParallel(letter="K", replicated=True)))


@pytest.mark.parametrize("api, check_vma", [("linen", True), ("nnx", False)])
def test_fewer_kv_heads_than_devices_each_device_keeps_the_kv_head_its_queries_read(api, check_vma):
    """2 kv heads on tensor 4 (4 query heads): the kv kernel stays whole over `tensor`, each
    device computes both kv heads and keeps head t * 2 // 4, the one its query head reads;
    equal to unsharded (invariants 1-5)."""
    with jax.enable_x64(True):
        model, twin = _models(api, "data2_tensor4", tp=REPLICATED_KV, **EXACT)
        case = dataclasses.replace(_case(api, "data2_tensor4", check_vma), model=model, reference=twin)
        check_equivalence(case)


@pytest.mark.parametrize("api", APIS)
def test_kept_kv_heads_are_projected_from_each_device_s_block_of_the_kernel(api):
    """2 kv heads on tensor 4 (the benchmark's plan): each device projects only the kv head
    its query head reads, from its block of the kernel kept whole (the kv matmuls 1/2 of
    the model's, every other matmul 1/4); over `tensor` Megatron's activation all-reduces
    (4 x layers + 2) and one more sum per kept parameter, its gradient on its FSDP block (the
    kv kernel and bias of each block); no weight moves over `tensor`."""
    s = SIZES
    replicated = measure(api, "fsdp2_tensor4", "megatron", **TINY)
    storage = measure(api, "fsdp2_tensor4", "storage", **TINY)
    # the kv einsum 'BSD,CDKH->CBSKH', forward and two backward, on a device's batch of 4
    kv = 3 * 2 * (BATCH // 2) * SEQ * s["d"] * 2 * s["kv_heads"] * s["head_dim"] * s["layers"]
    assert replicated.flops == (storage.flops - kv) // 4 + kv // 2
    tensor = [c for c in replicated.collectives if c.kind == "all-reduce" and c.group_size == 4]
    summed = Counter(t.split("{")[0] for c in tensor for t in c.operand_types)
    d, kv_shape = s["d"] // 2, f"{s['kv_heads']},{s['head_dim']}"  # (the kernel's D over fsdp 2)
    kept = Counter({f"f32[2,{kv_shape}]": s["layers"], f"f32[2,{d},{kv_shape}]": s["layers"]})
    assert summed & kept == kept and (summed - kept).total() == 4 * s["layers"] + 2
    assert replicated.tensor_all_reduces == replicated.megatron_all_reduces == summed.total()
    assert replicated.tensor_all_gathers == 1  # the logits


def test_negative_control_replicated_kv_heads_all_at_one_index():
    """Every device keeping kv head 0 pairs half the query heads with the wrong kv head: the
    harness sees it (the plan check off: it reads the injected slice, a line of the suite's,
    as the model's own, and refuses it first, since the module's operations under Linen's
    ``map_variables`` pair with the unsharded trace's)."""
    with jax.enable_x64(True), pytest.MonkeyPatch.context() as patch, switched_off():
        patch.setattr(tp_matmul, "kept_block", first_block)  # (ColumnParallel(replicated=True)'s)
        model, twin = _models("linen", "data2_tensor4", tp=REPLICATED_KV, **EXACT)
        case = dataclasses.replace(_case("linen", "data2_tensor4", False), model=model, reference=twin)
        with pytest.raises(AssertionError, match="output"):
            check_equivalence(case)


class _KeptBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Einsum((6, 8, 3), "BTD,DKH->BTKH", name="kv")(x)
        return x + nn.Einsum((8, 3, 6), "BTKH,KHD->BTD", name="out")(jnp.tanh(h)), None


class _ScannedKept(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_KeptBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return scan(name="blocks")(x, None)[0]


KEPT_IN_SCAN = [(r"kv$", ColumnParallel(letter="K", replicated=True)), (r"out$", RowParallel(letter="K"))]


def test_a_kept_kernel_is_read_by_its_block_inside_a_linen_scan():
    """Linen reads a kept kernel's block through ``nn.map_variables`` over the module's scope,
    which composes with ``nn.scan`` (each layer's slice of the stacked kernel, then its block):
    8 letters on tensor 4, equal to unsharded; control: every device reading block 0."""
    check_split("linen", _ScannedKept, KEPT_IN_SCAN, (8, 3, 6), True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tp_matmul, "kept_block", first_block)
        with pytest.raises(AssertionError, match="output"):
            check_split("linen", _ScannedKept, KEPT_IN_SCAN, (8, 3, 6), False)


class _NNXDenses(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(6, 8, rngs=rngs), nnx.Linear(8, 6, rngs=rngs)


class _Denses(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="down")(nn.Dense(8, name="up")(x))


@pytest.mark.parametrize("api", APIS)
def test_a_kept_kernel_on_a_dense_layer_is_refused_with_the_fix(api):
    """``replicated=True`` reads a block along an einsum letter; a dense layer has none."""
    rules = [("up$", ColumnParallel(replicated=True)), ("down$", RowParallel())]
    refused = r"up: ColumnParallel\(replicated=True\) reads .* Drop replicated=True"
    with pytest.raises(RuleError, match=refused) as said:
        if api == "nnx":
            fsdp_tp.nnx.tp_splits(nnx.eval_shape(lambda: _NNXDenses(nnx.Rngs(0))), rules)
        else:
            check_split("linen", _Denses, rules, (8, 3, 6), True)
    named_fix(said, "Drop replicated=True")
    fixed = [("up$", ColumnParallel()), ("down$", RowParallel())]
    if api == "nnx":
        fsdp_tp.nnx.tp_splits(nnx.eval_shape(lambda: _NNXDenses(nnx.Rngs(0))), fixed)
    else:
        check_split("linen", _Denses, fixed, (8, 3, 6), True)


# --- sequence parallelism by roles (issue 43 point 2) ------------------------------------------

SEQUENCE_RULES = [(pattern, dataclasses.replace(role, sequence_dim=1)) for pattern, role in RULES]


def _ringed(rules: list, mode: str) -> list:
    """``rules`` with the collective-matmul rings on every role that has them."""
    return [
        (p, dataclasses.replace(r, collective_matmul=mode) if hasattr(r, "collective_matmul") else r)
        for p, r in rules
    ]


def _sequence_case(api: str, check_vma: bool, ring: str | None = None) -> Case:
    rules = SEQUENCE_RULES if ring is None else _ringed(SEQUENCE_RULES, ring)
    with jax.enable_x64(True):
        model, twin = _models(api, "data2_fsdp2_tensor2", tp=rules, **EXACT)
        return dataclasses.replace(_case(api, "data2_fsdp2_tensor2", check_vma), model=model, reference=twin)


@pytest.mark.parametrize(
    "api, ring", [("linen", None), ("nnx", None), ("linen", "bidirectional"), ("nnx", "unidirectional")]
)
def test_sequence_parallel_roles_equal_unsharded(api, ring):
    """Every role with sequence_dim=1 (data 2 x fsdp 2 x tensor 2, check_vma on): between the
    layers each device holds its slice of the sequence, which the RMSNorm scales and the row
    biases read; invariants 1-5. With the rings (``collective_matmul``) the einsum projections
    compute chunk by chunk as the sequence arrives, and the output and down einsums' sums
    travel round the ring."""
    with jax.enable_x64(True):
        check_equivalence(_sequence_case(api, True, ring))


def test_sequence_parallel_roles_gather_and_scatter_and_all_reduce_only_the_row_biases():
    """On fsdp 4 x tensor 2, over `tensor`: per block forward one all-gather of the sequence for
    the attention (q and kv share it) and one for the MLP (gate and up), one reduce-scatter
    each (out, down), each reversed backward: 4 x layers of both; the embedding's
    reduce-scatter and its backward all-gather; the tied logits' sequence all-gather, its
    backward reduce-scatter and the logits' vocabulary gather. The only all-reduces over
    `tensor` are the output einsums' bias gradients (the bias read on sequence slices)."""
    lowered = _step("nnx", tp=SEQUENCE_RULES).lowered
    found = parse_collectives(lowered.compile().as_text())
    layers = SIZES["layers"]
    assert operand_count(found, "all-gather", 2) == 4 * layers + 3
    assert operand_count(found, "reduce-scatter", 2) == 4 * layers + 2
    over_tensor = [c for c in found if c.kind == "all-reduce" and c.group_size == 2]
    reduced = [t for c in over_tensor for t in c.operand_types for _ in range(c.executions)]
    bias = re.compile(rf"f32\[(1,)*{SIZES['d']}\]")  # (broadcast as the output einsum adds it)
    assert len(reduced) == layers and all(bias.match(t) for t in reduced), reduced


@pytest.mark.parametrize("api", APIS)
def test_sequence_parallel_roles_without_check_vma_are_refused(api):
    match = r"VocabParallel\(sequence_dim=1\) splits .* this step runs with check_vma=False"
    model, _ = _models(api, "fsdp4_tensor2", tp=SEQUENCE_RULES)
    mesh = fsdp_tp.make_mesh(MESHES["fsdp4_tensor2"])
    with pytest.raises(RuleError, match=match) as refused:
        lowered_lm_step(model, mesh, ("fsdp",), jnp.zeros((BATCH, SEQ), jnp.int32), check_vma=False)
    named_fix(refused, "Run the step (init_sharded and shard_step) with check_vma=True")
    lowered_lm_step(model, mesh, ("fsdp",), jnp.zeros((BATCH, SEQ), jnp.int32), check_vma=True)


def test_negative_control_unchecked_sequence_slices_give_the_norms_a_share_of_their_gradient(monkeypatch):
    """With the refusal patched out, the same model under check_vma=False: the RMSNorm scales'
    gradients are each device's share, not the unsharded model's."""
    monkeypatch.setattr(fsdp_tp.tp._role, "_sequence_checked", lambda role, layer: role.sequence_dim)
    with jax.enable_x64(True), pytest.raises(AssertionError, match="norm"):
        check_equivalence(_sequence_case("linen", False))

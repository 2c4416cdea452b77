"""Issue 13 point 2: Megatron tensor parallelism by rules on a model the user cannot edit.

``tests.plain_models.PlainLM`` (plain Flax: ``nn.MultiHeadDotProductAttention``, a
Dense-Dense MLP, ``nn.Embed``, ``nn.LayerNorm``) with its attention head-parallel, its MLPs
column- then row-parallel, the embedding vocab-parallel and the logits column-parallel
(gathered for the loss), named by path from outside. Properties: docs/design.md invariants 1-5
against the unsharded twin on data 2 x tensor 4 and on data 2 x fsdp 2 x tensor 2 in both
``check_vma`` modes; the compiled step holds exactly Megatron's activation collectives and
no all-gather of a tensor-split weight; the matmuls are 1/4 the size. Negative controls:
the same rules as storage only (the issue's measured state), a row bias added on every
device, a column input without Megatron's *f*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import (
    array_bytes,
    collective_summary,
    dot_flops,
    parse_collectives,
    state_bytes_per_device,
)
from fsdp_tp.bench.lm_step import lowered_lm_step
from fsdp_tp.errors import IndivisibleShapeError, RuleError
from fsdp_tp.linen.tp_rules import attention_rules, mlp_rules
from fsdp_tp.testing import NNXSharded as Sharded
from fsdp_tp.testing import NNXTwin as Twin
from fsdp_tp.tp import ColumnParallel, HeadParallel, RowParallel, VocabParallel
from fsdp_tp.tp import _heads as tp_heads
from fsdp_tp.tp import _matmul as tp_matmul
from fsdp_tp.tp import _vocab as tp_vocab
from fsdp_tp.tp._role import Local
from tests.conftest import mesh_of
from tests.equivalence import Case, check_equivalence, next_token_loss
from tests.models import GATED_RULES, GatedLM, TiedLM
from tests.nnx_models import NNX_MEGATRON, NNXGatedLM, NNXTiedLM, lm_maker
from tests.plain_models import MEGATRON, MLP, PlainLM
from tests.refusals import named_fix, role_named, stored_as_named

# FSDP over the dim each parameter's tp split leaves whole: in the blocks, then outside them
# (the embedding and the logits head).
_IN_BLOCKS = [
    (r"Dense_1/kernel$", (None, "fsdp")),
    (r"out/kernel$", (None, None, "fsdp")),
    (r"kernel$", ("fsdp",)),
]
_OUTSIDE = [(r"embedding$", (None, "fsdp")), (r"kernel$", ("fsdp",))]
MESHES = {
    "data2_tensor4": {"data": 2, "tensor": 4},
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
}


def _storage_rules(scan: bool, fsdp: bool, api: str = "linen"):
    """The FSDP rules on the Linen LM's paths, or on the NNX LM's (its stack is ``blocks``, its
    MLP's second layer ``down``)."""
    if not fsdp:
        return []
    stack, in_blocks = "^layers/", _IN_BLOCKS
    if api == "nnx":
        stack, in_blocks = "^blocks/", [(p.replace("Dense_1", "down"), spec) for p, spec in _IN_BLOCKS]
    if scan:  # the stacked layer dim comes first
        blocks = [(stack + ".*" + pattern, P(None, *spec)) for pattern, spec in in_blocks]
        return blocks + [(pattern, P(*spec)) for pattern, spec in _OUTSIDE]
    return [(pattern, P(*spec)) for pattern, spec in [*in_blocks[:2], _OUTSIDE[0], in_blocks[2]]]


APIS = ["linen", "nnx"]


def _model(
    mesh_name: str, sizes: dict, scan: bool = False, remat: bool = False, tp=None, rules=None, api="linen"
):
    fsdp = "fsdp" in MESHES[mesh_name]
    if api == "nnx":
        return Sharded(
            lm_maker(**sizes, scan=scan),
            _storage_rules(scan, fsdp, api) if rules is None else rules,
            batch_axes=_batch(mesh_name),
            tp_rules=NNX_MEGATRON if tp is None else tp,
        )
    model = fsdp_tp.shard_by_rules(
        PlainLM,
        _storage_rules(scan, fsdp) if rules is None else rules,
        batch_axes=_batch(mesh_name),
        tp_rules=MEGATRON if tp is None else tp,
    )
    return model(**sizes, scan=scan, remat=remat)


def _batch(mesh_name: str) -> tuple[str, ...]:
    return ("data", "fsdp") if "fsdp" in MESHES[mesh_name] else ("data",)


SMALL = dict(vocab=32, d_model=16, heads=4, layers=2)
# The equivalence cases compute in float64 (under jax.enable_x64): they check the algebra of
# the rules, and in float32 this LM's outputs (up to 3.2) sit at the tolerance's own floor.
# Measured on an AVX-512 CPU (jax 0.10.2 and 0.11.2 alike), data 2 x fsdp 2 x tensor 2 in
# nn.scan: the twin is 1.1e-6 from the float64 result, the sharded run 2.2e-6 (its tensor
# sums add in another order), and one logit of 0.0617, a sum of O(1) terms, is 2.0e-6 from
# the twin's where rtol 1e-5 + atol 1e-6 allow 1.6e-6 (0.65-1.22 of the bound across the
# four cases). In float64 rounding is ~1e-15, so the unchanged tolerances see only a
# wrong collective, bias or split. The same rules in float32: bring_your_own_model.md (losses
# and parameters after training, at these tolerances).
EXACT = dict(param_dtype=jnp.float64)


def _case(mesh_name: str, scan: bool, check_vma: bool, model=None, api="linen") -> Case:
    with jax.enable_x64(True):  # an NNX model's constructor runs here, and keeps its dtypes
        twin = Twin(lm_maker(**SMALL, **EXACT, scan=scan)) if api == "nnx" else None
        model = model or _model(mesh_name, {**SMALL, **EXACT}, scan=scan, remat=scan, api=api)
    return Case(
        model,
        twin or PlainLM(**SMALL, **EXACT, scan=scan, remat=scan),
        fsdp_tp.make_mesh(MESHES[mesh_name]),
        _batch(mesh_name),
        check_vma,
        0,
        0,
        seq_len=8,
        vocab=32,
        loss=next_token_loss,
        reference_loss=next_token_loss,
    )


def _check_exact(case: Case) -> None:
    with jax.enable_x64(True):
        check_equivalence(case)


@pytest.mark.parametrize(
    "mesh_name, scan, check_vma",
    [
        ("data2_tensor4", False, True),
        ("data2_tensor4", True, False),
        ("data2_fsdp2_tensor2", False, False),
        ("data2_fsdp2_tensor2", True, True),
    ],
)
@pytest.mark.parametrize("api", APIS)
def test_megatron_by_rules_equals_unsharded(mesh_name, scan, check_vma, api):
    """Invariants 1-5 (6 across the cases): init bit for bit, outputs, loss, gradients and
    3 SGD / AdamW steps, in a loop and in scan + remat (in float64: see EXACT), for the Linen
    model and the same model written in NNX."""
    _check_exact(_case(mesh_name, scan, check_vma, api=api))


@pytest.mark.parametrize(
    "api, bias", [("linen", "['layer_0']['Dense_1']"), ("nnx", "['blocks'][0]['attn']['out']")]
)
def test_negative_control_a_row_bias_added_on_every_device(monkeypatch, api, bias):
    """The row layer computing its own bias: each device adds it, the sum holds it 4 times (the
    init's zero bias hides it in the output; its gradient is 5 times the twin's)."""
    monkeypatch.setattr(RowParallel, "local", lambda self, *args: Local())
    with pytest.raises(AssertionError, match=re.escape(f"grads{bias}['bias']")), switched_off():
        _check_exact(_case("data2_tensor4", False, True, api=api))
    # The plan check refuses it before anything trains: the bias meets the partial sums.
    with pytest.raises(RuleError, match=r"add adds a value whole on every device to the partial sums"):
        _check_exact(_case("data2_tensor4", False, True, api=api))


@pytest.mark.parametrize("api", APIS)
def test_negative_control_a_column_input_without_f(monkeypatch, api):
    """Without Megatron's f (psum of the input's gradient) the layers before get a partial gradient."""
    for role_module in (tp_matmul, tp_heads, tp_vocab):  # every role's f, as before the roles' split
        monkeypatch.setattr(role_module, "copied", lambda args, kwargs, axis, *_: (args, kwargs))
    with pytest.raises(AssertionError, match="grads"):
        _check_exact(_case("data2_tensor4", False, False, api=api))


LM = dict(vocab=256, d_model=64, heads=8, layers=3)
SEQ, BATCH = 32, 16


def _lowered_step(model, mesh_name: str, check_vma: bool = True):
    mesh, tokens = fsdp_tp.make_mesh(MESHES[mesh_name]), jnp.zeros((BATCH, SEQ), jnp.int32)
    return lowered_lm_step(model, mesh, _batch(mesh_name), tokens, check_vma)


def _activation_collectives(collectives, local_batch: int) -> dict[str, int]:
    """Collectives of activations ([local batch, seq, ...]) by kind, counting operands."""
    counts: dict[str, int] = {}
    prefix = f"[{local_batch},{SEQ},"
    for c in collectives:
        moved = sum(t.partition("{")[0].endswith("]") and prefix in t for t in c.operand_types)
        if moved:
            counts[c.kind] = counts.get(c.kind, 0) + moved * c.executions
    return counts


# Per block: attention and MLP, one all-reduce forward (the row sum) and one backward (the
# column input's gradient) each; the vocab-parallel embedding's sum forward; the logits
# head's input gradient backward and its gathered output forward.
MEGATRON_MINIMUM = {"all-reduce": 4 * LM["layers"] + 2, "all-gather": 1}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("api", APIS)
def test_the_step_has_megatrons_activation_collectives_and_no_weight_gather(check_vma, api):
    lowered = _lowered_step(_model("data2_tensor4", LM, api=api), "data2_tensor4", check_vma).lowered
    found = parse_collectives(lowered.compile().as_text())
    over_tensor = [c for c in found if c.group_size == 4]
    assert _activation_collectives(over_tensor, BATCH // 2) == MEGATRON_MINIMUM
    # Everything over `tensor` is an activation: no weight moves there.
    assert sum(c.operands * c.executions for c in over_tensor) == sum(MEGATRON_MINIMUM.values())
    # The one gather is the logits slice: [batch, seq, vocab / 4].
    (gather,) = [c for c in over_tensor if c.kind == "all-gather"]
    assert gather.operand_types[0].startswith(f"f32[{BATCH // 2},{SEQ},{LM['vocab'] // 4}]")


def test_with_fsdp_weights_are_gathered_over_fsdp_only_and_nnx_moves_the_linen_bytes():
    """On data 2 x fsdp 2 x tensor 2, for each front end: the same activation collectives; the
    weight all-gathers move exactly each FSDP-split parameter's tensor slice, once (no remat),
    never over tensor (W_min). And the model written in NNX holds and moves exactly the Linen
    model's bytes: state per device, and every collective kind's count and wire bytes."""
    held, moved = {}, {}
    for api in APIS:
        lowered, state, _ = _lowered_step(
            _model("data2_fsdp2_tensor2", LM, api=api), "data2_fsdp2_tensor2", False
        )
        found = parse_collectives(lowered.compile().as_text())
        assert _activation_collectives(found, BATCH // 4) == MEGATRON_MINIMUM
        gathered = sum(c.operand_bytes * c.group_size * c.executions for c in found if c.kind == "all-gather")
        logits = (BATCH // 4) * SEQ * LM["vocab"] * 4
        expected = 0
        for leaf in jax.tree.leaves(state.params):
            spec = leaf.sharding.spec
            if "fsdp" in spec:
                expected += array_bytes(leaf) // (2 if "tensor" in spec else 1)
        assert gathered - logits == expected, api
        held[api] = sorted(state_bytes_per_device(state).values())
        moved[api] = collective_summary(found)
    assert held["nnx"] == held["linen"]
    assert moved["nnx"] == moved["linen"]


@pytest.mark.parametrize("api", APIS)
def test_matmuls_are_a_quarter_the_size(api):
    """Every matmul of the step (forward and backward, attention included) on data 2 x tensor 4
    is 1/4 of the same model's without tp rules: the dot FLOPs, exactly."""
    plain = _lowered_step(_model("data2_tensor4", LM, tp=(), api=api), "data2_tensor4").lowered
    split = _lowered_step(_model("data2_tensor4", LM, api=api), "data2_tensor4").lowered
    assert dot_flops(plain.as_text(dialect="hlo")) == 4 * dot_flops(split.as_text(dialect="hlo"))


def test_negative_control_storage_only_tp_repeats_the_whole_computation():
    """The issue's measured state: kernels stored on `tensor` by plain rules are all-gathered
    and every tensor device computes all of it (full-size matmuls)."""
    storage = [(r"(query|key|value)/kernel$", P(None, "tensor")), (r"kernel$|embedding$", P("tensor"))]
    plain = _lowered_step(_model("data2_tensor4", LM, tp=()), "data2_tensor4").lowered
    stored = _lowered_step(_model("data2_tensor4", LM, tp=(), rules=storage), "data2_tensor4").lowered
    assert dot_flops(stored.as_text(dialect="hlo")) == dot_flops(plain.as_text(dialect="hlo"))
    found = parse_collectives(stored.compile().as_text())
    assert _activation_collectives([c for c in found if c.group_size == 4], BATCH // 2) != MEGATRON_MINIMUM
    assert any(c.kind == "all-gather" and c.group_size == 4 for c in found)


@pytest.mark.parametrize("api", APIS)
def test_tied_embeddings_and_dense_general_equal_unsharded(api):
    if api == "nnx":
        rules = [(r"embed$", VocabParallel()), (r"up$", ColumnParallel()), (r"down$", RowParallel())]
        model, twin = Sharded(NNXTiedLM, batch_axes=("data",), tp_rules=rules), Twin(NNXTiedLM)
    else:
        rules = [(r"Embed_0$", VocabParallel()), *mlp_rules(r"up$", r"down$")]
        model, twin = fsdp_tp.shard_by_rules(TiedLM, batch_axes=("data",), tp_rules=rules)(), TiedLM()
    check_equivalence(dataclasses.replace(_case("data2_tensor4", False, True, model=model), reference=twin))


def _all_reduces_over_tensor(model) -> int:
    """All-reduce operands over `tensor` (size 4) in one step of ``model`` on data 2 x tensor 4."""
    mesh = fsdp_tp.make_mesh(MESHES["data2_tensor4"])
    lowered = lowered_lm_step(model, mesh, ("data",), jnp.zeros((8, 8), jnp.int32)).lowered
    found = parse_collectives(lowered.compile().as_text())
    return sum(c.operands * c.executions for c in found if c.kind == "all-reduce" and c.group_size == 4)


def _gated(api: str, param_dtype=jnp.float32):
    if api == "nnx":
        make = functools.partial(NNXGatedLM, param_dtype=param_dtype)
        return Sharded(make, batch_axes=("data",), tp_rules=GATED_RULES["nnx"]), Twin(make)
    sharded = fsdp_tp.shard_by_rules(GatedLM, batch_axes=("data",), tp_rules=GATED_RULES["linen"])
    return sharded(param_dtype=param_dtype), GatedLM(param_dtype=param_dtype)


@pytest.mark.parametrize("api", APIS)
def test_a_gated_mlp_equals_unsharded_with_one_all_reduce_each_way(api):
    """gate and up read the same activation: one Megatron *f* for both, so per MLP one
    all-reduce forward (down's sum) and one backward (the input's gradient), as an ungated
    MLP; plus the vocabulary-parallel embedding's sum and the tied logits' input gradient.
    In float64, as the LM cases above (EXACT): in float32 a logit that sums O(1) terms sits
    at the tolerance's floor (seen: 1.1e-6 from the twin's at XLA's -O0, where 1.0e-6 is allowed)."""
    with jax.enable_x64(True):
        model, twin = _gated(api, jnp.float64)
        _check_exact(dataclasses.replace(_case("data2_tensor4", False, True, model=model), reference=twin))
    assert _all_reduces_over_tensor(_gated(api)[0]) == 2 * 2 + 2


def test_negative_control_an_f_per_column_layer_all_reduces_the_gated_input_twice(monkeypatch):
    """Without the shared *f* (each column layer its own, as before issue 44), the backward pass
    all-reduces the MLP input's gradient once for gate and once for up."""
    monkeypatch.setattr(fsdp_tp.train, "shared_column_inputs", contextlib.nullcontext)
    model, _ = _gated("linen")
    assert _all_reduces_over_tensor(model) == 3 * 2 + 2


def _init(model, mesh_name="data2_tensor4", tokens=None):
    tokens = jnp.zeros((8, 8), jnp.int32) if tokens is None else tokens
    mesh = fsdp_tp.make_mesh(MESHES[mesh_name])
    return fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"], mesh, (P(), P(_batch(mesh_name))), jax.random.key(0), tokens
    )


def _plain(tp, rules=(), **sizes):
    return fsdp_tp.shard_by_rules(PlainLM, rules, batch_axes=("data",), tp_rules=tp)(**{**SMALL, **sizes})


@pytest.mark.parametrize(
    "tp, sizes, error, match",
    [
        # a rule on a block, not a layer: its children are named
        (
            [(r"layer_0$", ColumnParallel())],
            {},
            RuleError,
            r"matches layer_0, a DecoderBlock; ColumnParallel computes nn.Dense or nn.DenseGeneral or "
            r"nn.Conv or nn.Einsum on its slices. Name the submodules a role computes, e.g. "
            r"\('layer_0/Dense_0\$', ColumnParallel\(\)\); under layer_0: "
            r"layer_0/MultiHeadDotProductAttention_0 \(HeadParallel\), "
            r"layer_0/Dense_0 \(ColumnParallel or RowParallel\), "
            r"layer_0/Dense_1 \(ColumnParallel or RowParallel\)\.",
        ),
        # a layer no role computes: said so, never a pattern that is refused in turn (issue 34.5)
        (
            [(r"layer_0/LayerNorm_0$", ColumnParallel())],
            {},
            RuleError,
            r"matches layer_0/LayerNorm_0, a LayerNorm, which has no tensor-parallel role and no submodule "
            r"one computes \(roles compute ColumnParallel: nn.Dense, .*"
            r"VocabParallel: nn.Embed; ExpertParallel: nn.Einsum\). If it computes an einsum of its "
            r"input and one kernel parameter, "
            r"tell the roles so: fsdp_tp.tp.register_einsum\(LayerNorm, equation, kernel=\.\.\., "
            r"sizes=\.\.\.\); if its own code reads several raw kernels, name each one's split: "
            r"fsdp_tp.tp.Region\(dims=\{'<parameter>': <dim from the end>, \.\.\.\}\); else drop the rule",
        ),
        # a layer another role computes: that role is named
        (
            [(r"^Embed_0$", ColumnParallel())],
            {},
            RuleError,
            r"matches Embed_0, a Embed, which ColumnParallel does not compute .* give it VocabParallel\(\)",
        ),
        # a rule on a parameter: rules name modules, and the module's pattern is given
        (
            [(r"Dense_0/kernel$", ColumnParallel())],
            {},
            RuleError,
            r"matches no submodule; it matches parameters .*e.g. 'layer_0/Dense_0\$'",
        ),
        # a typo: the submodules the role can name are listed
        (
            [(r"Dens_0$", ColumnParallel())],
            {},
            RuleError,
            r"'Dens_0\$' -> ColumnParallel matches no submodule.*"
            r"layer_0/Dense_0 \(ColumnParallel or RowParallel\)",
        ),
        # heads the axis does not divide
        (
            attention_rules(),
            dict(heads=6, d_model=24),
            IndivisibleShapeError,
            r": num_heads \(size 6\) is not divisible by mesh axis 'tensor' \(size 4\)",
        ),
    ],
    ids=["block", "no-role", "other-role", "parameter", "nothing", "indivisible"],
)
def test_a_wrong_tp_rule_is_named_at_init(tp, sizes, error, match):
    with pytest.raises(error, match=match):
        _init(_plain(tp, **sizes))


def _nnx_lm(tp, rules=(), heads=4, d_model=16):
    make = lm_maker(**{**SMALL, "heads": heads, "d_model": d_model})
    return Sharded(make, rules, batch_axes=("data",), tp_rules=tp)


# The rules the fix each refusal below names gives, read off its message.
_NAMED_FIXES = {
    "block": lambda said: [role_named(said, r"\('blocks/0/down\$', ColumnParallel\(\)\)")],
    "no-role": lambda said: [] if named_fix(said, "else drop the rule") else None,
    "other-role": lambda said: [("embed$", role_named(said, r"VocabParallel\(\)"))],
    "parameter": lambda said: [
        (re.search(r"e\.g\. '([^']+)'", named_fix(said, "e.g. 'blocks/0/up$'"))[1], ColumnParallel())
    ],
}


@pytest.mark.parametrize(
    "tp, sizes, match",
    [
        (
            [(r"blocks/0$", ColumnParallel())],
            {},
            r"'blocks/0\$' -> ColumnParallel matches blocks/0, a DecoderBlock; ColumnParallel computes "
            r"nnx.Linear or nnx.LinearGeneral or nnx.Conv or nnx.Einsum on its slices. Name the submodules "
            r"a role computes, e.g. \('blocks/0/down\$', ColumnParallel\(\)\); under blocks/0: blocks/0/attn "
            r"\(HeadParallel\), blocks/0/down \(ColumnParallel or RowParallel\), blocks/0/up",
        ),
        ([(r"ln1$", RowParallel())], {}, r"a LayerNorm, which has no tensor-parallel role"),
        ([(r"embed$", ColumnParallel())], {}, r"a Embed, which ColumnParallel does not .*VocabParallel\(\)"),
        (
            [(r"up/kernel$", ColumnParallel())],
            {},
            r"matches no submodule; it matches parameters .*'blocks/0/up\$'",
        ),
    ],
    ids=["block", "no-role", "other-role", "parameter"],
)
def test_a_wrong_tp_rule_on_an_nnx_model_is_named_before_anything_runs(tp, sizes, match, request):
    """The rules meet the abstract model at shard_by_rules: the same wordings as Linen's, in
    NNX's class names, before an init runs; the fix each names is accepted there."""
    with pytest.raises(RuleError, match=match) as refused:
        _nnx_lm(tp, **sizes)
    _nnx_lm(_NAMED_FIXES[request.node.callspec.id](refused), **sizes)


def test_nnx_heads_the_axis_does_not_divide_are_named_at_init():
    sharded = _nnx_lm([(r"attn$", HeadParallel())], heads=6, d_model=24).sharded
    with pytest.raises(IndivisibleShapeError, match=r"blocks/0/attn: num_heads \(size 6\) is not divisible"):
        fsdp_tp.init_sharded(sharded.init, fsdp_tp.make_mesh(MESHES["data2_tensor4"]), P(), jax.random.key(0))


class NNXUpDown(nnx.Module):
    """An embedding, then ``up`` and ``down`` (``up_type``: a Linear of the user's)."""

    def __init__(self, rngs: nnx.Rngs, up_type: type = nnx.Linear):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.up = up_type(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, tokens):
        return self.down(self.up(self.embed(tokens)))


class Float16Only(nnx.Linear):
    """A user's layer that refuses what it does not support, with its own TypeError."""

    def __call__(self, x):
        if x.dtype != jnp.float16:
            raise TypeError(f"Float16Only takes float16 inputs, got {x.dtype}")
        return super().__call__(x)


def _nnx_up_down(up_type, tp):
    return Sharded(functools.partial(NNXUpDown, up_type=up_type), batch_axes=("data",), tp_rules=tp)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: _plain([(r"Dense_1$", RowParallel())]),
            RuleError,
            r"layer_0/Dense_1 \(RowParallel\) takes the split features a ColumnParallel \(or HeadParallel\) "
            r"layer returns, and its input arrived whole .* Fix: make the layer that feeds layer_0/Dense_1 "
            r"ColumnParallel, or drop layer_0/Dense_1's rule so it stays whole",
        ),
        (
            lambda: _nnx_up_down(nnx.Linear, [(r"down$", RowParallel())]),
            RuleError,
            r"down \(RowParallel\) takes the split features .* its input arrived whole",
        ),
        # issue 61: a column layer fed a column layer's split was told to be made ColumnParallel
        (
            lambda: _plain([(r"Dense_0$", ColumnParallel()), (r"Dense_1$", ColumnParallel())]),
            RuleError,
            r"layer_0/Dense_1 \(ColumnParallel\) reads its input whole, and it arrived split .* Fix: make "
            r"layer_0/Dense_1 RowParallel, so the split ends here, or drop the rule of the layer before it",
        ),
        (
            lambda: _nnx_up_down(nnx.Linear, [(r"up$", ColumnParallel()), (r"down$", ColumnParallel())]),
            RuleError,
            r"down \(ColumnParallel\) reads its input whole, and it arrived split",
        ),
        # A column layer's own TypeError is the user's to read, not a row layer's advice.
        (
            lambda: _nnx_up_down(Float16Only, [(r"up$", ColumnParallel()), (r"down$", RowParallel())]),
            TypeError,
            r"^Float16Only takes",
        ),
    ],
    ids=[
        "linen-row-fed-whole",
        "nnx-row-fed-whole",
        "linen-column-fed-split",
        "nnx-column-fed-split",
        "nnx-own-type-error",
    ],
)
def test_a_layer_that_cannot_compute_says_why(make, error, match):
    """Refused where the layer first computes on its slices: the plan check's trace at init
    (Linen), or the step (NNX)."""
    model = make()
    mesh = fsdp_tp.make_mesh(MESHES["data2_tensor4"])
    with pytest.raises(error, match=match):
        params, specs = _init(model)
        apply = jax.jit(
            jax.shard_map(
                lambda p, x: model.apply({"params": p}, x),
                mesh=mesh,
                in_specs=(specs, P("data")),
                out_specs=P("data"),
            )
        )
        apply(params, jnp.zeros((8, 8), jnp.int32))


def test_a_storage_rule_on_the_split_dim_gets_the_fix():
    with pytest.raises(
        RuleError,
        match=r"layer_0/Dense_0/kernel: storage rule 'kernel\$' gives P\(None, 'fsdp'\).*"
        r"Store it as P\('fsdp', None\)",
    ) as refused:
        model = fsdp_tp.shard_by_rules(PlainLM, [("kernel$", P(None, "fsdp"))], tp_rules=MLP)(**SMALL)
        _init(model, "data2_fsdp2_tensor2")
    specs = {}

    def build(fixes):  # (the fixes first, the rule as written after them)
        model = fsdp_tp.shard_by_rules(PlainLM, [*fixes, ("kernel$", P(None, "fsdp"))], tp_rules=MLP)(**SMALL)
        specs.update(_init(model, "data2_fsdp2_tensor2")[1])

    fixes, refused_again = stored_as_named(refused, build)
    assert refused_again is None and specs["layer_0"]["Dense_0"]["kernel"] == P("fsdp", "tensor"), fixes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(batch_axes=("data", "tensor")),
            r"computes over mesh axis 'tensor', which batch_axes also names",
        ),
        (dict(tp_rules=[("Dense_0$", "column")]), r"tp rule 'Dense_0\$' -> 'column': give a role"),
    ],
)
def test_conflicting_or_malformed_tp_rules_are_refused_at_once(kwargs, match):
    with pytest.raises(RuleError, match=match) as refused:
        fsdp_tp.shard_by_rules(PlainLM, **{"tp_rules": MLP, **kwargs})
    if "batch_axes" in kwargs:
        named_fix(refused, "Split the batch over other axes (e.g. 'data', 'fsdp')")
        fixed = {"batch_axes": ("data", "fsdp")}
    else:
        named_fix(refused, "give a role, one of ColumnParallel, RowParallel")
        fixed = {"tp_rules": [("Dense_0$", ColumnParallel())]}
    fsdp_tp.shard_by_rules(PlainLM, **{"tp_rules": MLP, **fixed})


def test_mlp_rules_need_the_mlp_named():
    """Issue 34 point 6: the defaults Dense_0$ / Dense_1$ matched every such layer of a model."""
    with pytest.raises(TypeError, match=r"name the MLP's two layers by path, e\.g\. mlp_rules\(r'mlp/"):
        mlp_rules()


def test_init_is_the_unsplit_models_bit_for_bit_and_split_as_megatron():
    params, specs = _init(_model("data2_fsdp2_tensor2", SMALL), "data2_fsdp2_tensor2")
    block = specs["layer_0"]
    assert block["Dense_0"]["kernel"] == P("fsdp", "tensor")
    assert block["Dense_1"]["kernel"] == P("tensor", "fsdp")
    assert block["MultiHeadDotProductAttention_0"]["query"]["kernel"] == P("fsdp", "tensor", None)
    assert block["MultiHeadDotProductAttention_0"]["out"]["kernel"] == P("tensor", None, "fsdp")
    assert specs["Embed_0"]["embedding"] == P("tensor", "fsdp")
    reference = PlainLM(**SMALL).init(jax.random.key(0), jnp.zeros((8, 8), jnp.int32))["params"]
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(params), reference)


class ConvNet(nn.Module):
    """Two 1-d convolutions with a gelu between: Megatron's MLP with convs (its channels split)."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Conv(8, kernel_size=(3,), name="up")(x))
        return nn.Conv(4, kernel_size=(3,), name="down")(h)


CONV_RULES = mlp_rules(r"up$", r"down$")


@pytest.mark.parametrize("mesh, check_vma", [((1, 1, 4), True), ((1, 2, 4), False), ((2, 2, 2), True)])
def test_convolutions_by_rules_equal_unsharded(mesh, check_vma):
    """nn.Conv takes the column and row roles as nn.Dense does (the channels are its features):
    invariants 1-5 with FSDP over the kernel's other dims."""
    storage = [(r"up/kernel$", P(None, "fsdp")), (r"down/kernel$", P(None, None, "fsdp"))]
    model = fsdp_tp.shard_by_rules(ConvNet, storage, batch_axes=("data", "fsdp"), tp_rules=CONV_RULES)()
    check_equivalence(Case(model, ConvNet(), mesh_of(*mesh), ("data", "fsdp"), check_vma, 4, 4, seq_len=6))


def test_a_grouped_convolution_is_refused_by_name():
    class Grouped(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(8, kernel_size=(3,), feature_group_count=2)(x)

    model = fsdp_tp.shard_by_rules(Grouped, batch_axes=("data",), tp_rules=[(r"Conv_0$", ColumnParallel())])()
    with pytest.raises(RuleError, match=r"Conv_0 .*feature_group_count=2.*Leave Conv_0 whole") as refused:
        _init(model, tokens=jnp.ones((8, 6, 4)))
    named_fix(refused, "Leave Conv_0 whole (drop it from the tp rules)")
    _init(fsdp_tp.shard_by_rules(Grouped, batch_axes=("data",), tp_rules=[])(), tokens=jnp.ones((8, 6, 4)))

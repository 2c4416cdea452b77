"""Issue 84: a model the user wrote, its sequence split over ``context`` by the train step, equal to
the unsharded model through ``fsdp_tp.testing`` (invariants 1-5, float64).

The model takes positions and segment ids with its tokens (packed documents with padding, RoPE
from each token's position in its document) and calls :func:`fsdp_tp.attention.attend`; nothing
else in it knows the sequence is split. The step lays the batch out (balanced by default), its
attention computes across the axis, and the context axis is a batch axis for the gradients and
for FSDP's gathers (the parameters stored over ``fsdp`` and ``context``). Negative controls: the
same model building its positions from its local length, and an attention written out, are
caught by the harness.
"""

from __future__ import annotations

import functools
import inspect
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.attention
import fsdp_tp.routing
from fsdp_tp import sync_gradients
from fsdp_tp._check.driver import switched_off
from fsdp_tp.analysis import parse_collectives
from fsdp_tp.attention import attend
from fsdp_tp.context import SequenceSplit
from fsdp_tp.errors import IndivisibleShapeError, RuleError, UncheckedPlanWarning
from fsdp_tp.gradients import global_mean_loss
from fsdp_tp.models.moe import LinenMoE
from fsdp_tp.testing import Reference, check_sharded
from fsdp_tp.tp import ColumnParallel, ExpertParallel, RowParallel
from fsdp_tp.train._sequence_layout import LaidOut
from tests.packed_lm import (
    BATCH,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV,
    LENGTH,
    NNXLM,
    ROWS,
    VOCAB,
    D,
    LinenLM,
    attention,
    heads_of,
    packed_batch,
    rms,
)
from tests.refusals import named_fix

_JAX_ATTENTION = jax.nn.dot_product_attention


def _rows(n: int):
    """A packed batch of ``n`` rows (each pair of rows drawn as :func:`packed_batch` draws it)."""
    parts = [packed_batch(seed) for seed in range(n // ROWS)]
    joined = lambda *xs: jnp.concatenate(xs)
    return jax.tree.map(joined, *[p[0] for p in parts]), jnp.concatenate([p[1] for p in parts])


def _source_line(code, text: str) -> int:
    """The number of the line of ``code``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(code)
    return first + next(i for i, line in enumerate(lines) if text in line)


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# FSDP over fsdp and context (a data axis for the weights), each kernel on its input dim
FSDP = [
    (r"(q|k|v|up|head)/kernel$", P(("fsdp", "context"))),
    (r"(out|down)/kernel$", P(None, ("fsdp", "context"))),
]
TP = [(r"(q|k|v|up)$", ColumnParallel()), (r"(out|down)$", RowParallel())]
# The unsharded runs the mesh list below compares with: five of its cases share one (the same
# model, batch and loss), computed once a test process.
LINEN_TWINS = Reference()


@pytest.mark.parametrize(
    "mesh, tp_rules, sequence, kv_heads",
    [
        ({"fsdp": 2, "context": 4}, [], None, KV),
        ({"context": 2, "tensor": 2, "fsdp": 2}, TP, SequenceSplit(balanced=False), KV),
        ({"fsdp": 2, "context": 2, "tensor": 2}, [], SequenceSplit(strategy="all_to_all"), KV),
        ({"fsdp": 1, "context": 8}, [], None, KV),
        ({"fsdp": 1, "context": 4, "tensor": 2}, TP, None, KV),
        ({"fsdp": 2, "context": 2, "tensor": 2}, "auto", None, KV),
        ({"fsdp": 4, "context": 2}, [], None, 1),  # (H/G = 4: one kv head for every query head)
        ({"data": 2, "fsdp": 1, "context": 2, "tensor": 2}, TP, None, HEADS),  # (H/G = 1: multi-head)
    ],
    ids=[
        "fsdp2-context4",
        "fsdp2-context2-tensor2-contiguous",
        "fsdp2-context2-all-to-all-unchecked",
        "context8",
        "context4-tensor2",
        "fsdp2-context2-tensor2-auto",
        "fsdp4-context2-gqa4",
        "data2-context2-tensor2-mha",
    ],
)
def test_a_linen_model_with_its_sequence_split_is_the_unsharded_model(mesh, tp_rules, sequence, kv_heads):
    check_vma = sequence is None or sequence.strategy != "all_to_all"  # (and both check_vma settings)
    rows = math.prod(mesh.get(axis, 1) for axis in ("data", "fsdp"))
    check_sharded(
        LinenLM(kv_heads=kv_heads),
        BATCH if rows <= ROWS else _rows(rows),
        cross_entropy,
        mesh,
        FSDP,
        tp_rules=tp_rules,
        sequence=sequence,
        steps=2,
        check_vma=check_vma,
        reference=LINEN_TWINS,
    )


def test_an_nnx_model_with_its_sequence_split_is_the_unsharded_model():
    mesh = {"data": 2, "context": 2, "tensor": 2}
    nnx_tp = [(r"blocks/\d+/(q|k|v|up)$", ColumnParallel()), (r"blocks/\d+/(out|down)$", RowParallel())]
    check_sharded(NNXLM, BATCH, cross_entropy, mesh, tp_rules=nnx_tp, steps=2)
    check_sharded(NNXLM, BATCH, cross_entropy, mesh, tp_rules="auto", steps=1, optimizers={})  # (beside it)


@pytest.mark.parametrize("bound", ["causal", "imported", "partial"])
def test_jax_attention_as_the_model_calls_it_is_computed_across_and_a_local_mask_refused(bound):
    """``jax.nn.dot_product_attention(..., is_causal=True)`` inside the step computes across the
    axis however the model bound it (issue 99 point 5: by its attribute, imported by name, a
    partial made at import); with a mask (built from a device's tokens) it is refused with the
    fix; outside the step it is JAX's own again."""
    tokens, targets = BATCH
    plain = {"tokens": tokens["tokens"], "positions": jnp.broadcast_to(jnp.arange(LENGTH), (ROWS, LENGTH))}
    mesh = {"data": 2, "context": 4}
    check_sharded(LinenLM(jax_attention=bound), (plain, targets), cross_entropy, mesh, steps=1)
    assert jax.nn.dot_product_attention is _JAX_ATTENTION
    if bound != "causal":
        return
    line = _source_line(attention, "mask=jnp.tril")  # (the call with the model's own mask)
    with pytest.raises(
        RuleError,
        match=rf"packed_lm\.py:{line} \(attention\): jax\.nn\.dot_product_attention\(mask=\.\.\.\) inside "
        r"a step .*\.attend\(q, k, v, segment_ids",
    ) as refused:
        check_sharded(LinenLM(jax_attention="mask"), (plain, targets), cross_entropy, mesh, steps=1)
    assert jax.nn.dot_product_attention is _JAX_ATTENTION
    named_fix(refused, "pass is_causal=True for a causal mask")  # (the model above, is_causal=True)


def test_negative_control_jax_attention_bound_by_name_left_to_the_check_is_refused(monkeypatch):
    """Without the interception by identity (JAX's attention caught only where it is called by
    its attribute), a model that imported it by name attends over a device's tokens: the check
    refuses it at the model's line, never silently."""
    across = fsdp_tp.context._across
    monkeypatch.setattr(across, "_PATCHED", across._PATCHED[:1])  # (the attribute alone, as before)
    tokens, targets = BATCH
    plain = {"tokens": tokens["tokens"], "positions": jnp.broadcast_to(jnp.arange(LENGTH), (ROWS, LENGTH))}
    with pytest.raises(RuleError, match=r"packed_lm\.py:\d+ ") as refused:
        check_sharded(
            LinenLM(jax_attention="imported"), (plain, targets), cross_entropy, {"context": 8}, steps=1
        )
    named_fix(refused, "fsdp_tp.attention.attend")  # (the model's attention by attend, with its segments)
    check_sharded(LinenLM(), BATCH, cross_entropy, {"context": 8}, steps=1, optimizers={})


def test_all_to_all_where_the_axis_does_not_divide_a_device_s_kv_heads_is_refused_with_its_fix():
    """Under TP over 2 a device holds 1 of the 2 kv heads: all-to-all over 2 cannot split it."""
    mesh, all_to_all = {"fsdp": 2, "context": 2, "tensor": 2}, SequenceSplit(strategy="all_to_all")
    with pytest.raises(
        IndivisibleShapeError, match=r"the kv heads a device holds \(size 1\).*strategy='ring'"
    ):
        check_sharded(LinenLM(), BATCH, cross_entropy, mesh, tp_rules=TP, sequence=all_to_all, steps=1)
    check_sharded(
        LinenLM(), BATCH, cross_entropy, mesh, tp_rules=TP, sequence=SequenceSplit(strategy="auto"), steps=1
    )


def test_attention_left_on_a_device_s_tokens_is_caught(monkeypatch):
    """(negative control) the step's split ignored by the attention: each device attends over
    its own tokens only."""
    monkeypatch.setattr(fsdp_tp.attention, "split_here", lambda: None)
    with pytest.raises(AssertionError, match="output"):
        check_sharded(LinenLM(), BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1, optimizers={})


def test_positions_built_from_the_local_length_are_refused_and_unchecked_caught():
    """The same model with RoPE at ``arange`` of a device's tokens: refused before the first step
    at its line; (negative control) with the check off, caught by the harness."""
    line = inspect.getsourcelines(attention)[1] + 2
    mesh = {"data": 2, "context": 4}
    with pytest.raises(RuleError, match=rf"packed_lm\.py:{line} ") as refused:
        check_sharded(LinenLM(local_positions=True), BATCH, cross_entropy, mesh, steps=1)
    with switched_off(), pytest.raises(AssertionError, match="output"):
        check_sharded(LinenLM(local_positions=True), BATCH, cross_entropy, mesh, steps=1)
    named_fix(refused, "take positions (and masks' segment ids) as inputs with the batch")
    check_sharded(LinenLM(), BATCH, cross_entropy, mesh, steps=1, optimizers={})  # (the batch's positions)


# The step itself, as a user writes one: a token-weighted loss (padding weighs 0) over data x
# context, its outputs returned per token, in float64. Compiled once for the tests that read it.
STEP_MESH = {"data": 2, "context": 4}
CHECK_VMA = True


def _weighted_loss(model, params, batch, targets, weights):
    logits = model.apply({"params": params}, batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce * weights).sum(), (weights.sum(), logits)


@functools.cache
def _step(per_device_count: bool):
    """The step over ``STEP_MESH`` and the unsharded loss and gradients, float64; with
    ``per_device_count`` the loss a device's tokens' mean (torchtitan#2990's bug)."""
    model, mesh = LinenLM(), fsdp_tp.make_mesh(STEP_MESH)
    axes = ("data", "context")

    def step_fn(state, data):
        batch, targets, weights = data
        if per_device_count:
            loss = lambda p: (lambda s, aux: (s / aux[0], aux))(
                *_weighted_loss(model, p, batch, targets, weights)
            )
        else:
            loss = lambda p: (lambda s, aux: (global_mean_loss(s, aux[0], axes), aux))(
                *_weighted_loss(model, p, batch, targets, weights)
            )
        (value, (_, logits)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        grads = sync_gradients(grads, axes)
        return grads, (jax.lax.pmean(value, axes), grads, logits)

    def init_fn(rng):
        params = jax.tree.map(lambda p: p.astype(jnp.float64), model.init(rng, BATCH[0])["params"])
        return fsdp_tp.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1), rng=rng)

    token = P("data", "context")
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    batch_specs = ({"tokens": token, "positions": token, "segments": token}, token, token)
    step = fsdp_tp.shard_step(
        step_fn,
        mesh,
        specs,
        batch_specs,
        metrics_specs=(P(), specs.params, token),
        donate_state=False,
        check_vma=CHECK_VMA,
    )

    def unsharded(params, batch, targets, weights):
        total, (count, logits) = _weighted_loss(model, params, batch, targets, weights)
        return total / count, logits

    return step, state, jax.jit(jax.value_and_grad(unsharded, has_aux=True))


def _weighted_batch():
    batch, targets = BATCH
    weights = (batch["segments"] != 0).astype(jnp.float64)  # (padding: 0; rows of unequal counts)
    return batch, targets, weights


def test_the_step_s_token_weighted_loss_is_the_global_one_and_its_outputs_in_the_user_s_order():
    with jax.enable_x64(True):
        step, state, unsharded = _step(False)
        data = _weighted_batch()
        _, (loss, grads, logits) = step(state, data)
        (want, want_logits), want_grads = unsharded(state.params, *data)
        np.testing.assert_allclose(loss, want, rtol=1e-12)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-11, atol=1e-12)  # (the order written)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), grads, want_grads)
        # Each device's loss its own tokens' mean is refused before it trains, at its division,
        # naming the fix this test's step applies (issue 99); (negative control) the check off,
        # it computes another loss.
        step, state, _ = _step(True)
        with pytest.raises(
            RuleError, match=r"(?s)div reads the partial sums.*_weighted_loss.*global_mean_loss"
        ) as refused:
            step(state, data)
        named_fix(refused, "fsdp_tp.gradients.global_mean_loss(local_sum, local_count")  # (the step above)
        with switched_off():
            _, (loss, grads, _) = step(state, data)
        assert not np.isclose(loss, want, rtol=1e-6)


def test_the_step_sends_only_the_ring_s_bytes_over_context():
    """Per layer, forward: k and v in cp-1 hops, 2(cp-1)/cp · B·S·G·D·b; backward: those again,
    and the accumulators' cp hops, 2 · B·S·G·D·b (float64 here); no k or v all-gathered."""
    with jax.enable_x64(True):
        step, state, _ = _step(False)
        hlo = step.lower(state, _weighted_batch()).compile().as_text()
    cp, rows = STEP_MESH["context"], ROWS // STEP_MESH["data"]
    kv = rows * LENGTH * KV * HEAD_DIM * 8  # one of k, v over the whole sequence, one row's share
    per_layer = 2 * (cp - 1) * kv // cp + 2 * (cp - 1) * kv // cp + 2 * kv
    found = parse_collectives(hlo)
    permuted = sum(c.wire_bytes for c in found if c.kind == "collective-permute")
    assert permuted == 2 * per_layer, {c.name: (c.wire_bytes, c.operand_types) for c in found}
    gathered = [
        c.operand_bytes for c in found if c.kind == "all-gather" and "f64" in "".join(c.operand_types)
    ]
    assert gathered == [rows * LENGTH // cp * VOCAB * 8], (
        gathered
    )  # (the logits put back in order; k, v never)


def _tiny_step(batch_specs, sequence=None, mesh=STEP_MESH):
    mesh = fsdp_tp.make_mesh(mesh)
    init_fn = lambda rng: fsdp_tp.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(())}, tx=optax.sgd(1.0), rng=rng
    )
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    axes = tuple(mesh.axis_names)

    def step_fn(state, x):
        loss, grads = jax.value_and_grad(lambda p: (p["w"] * x).mean())(state.params)
        return sync_gradients(grads, axes), jax.lax.pmean(loss, axes)

    return state, fsdp_tp.shard_step(step_fn, mesh, specs, batch_specs, sequence=sequence)


@pytest.mark.parametrize(
    "specs, sequence, mesh, said",
    [
        (
            P("context"),
            None,
            STEP_MESH,
            r"batch spec .* names the sequence axis 'context' on dim 0, the rows",
        ),
        (
            P("data"),
            SequenceSplit(),
            STEP_MESH,
            r"sequence=SequenceSplit.* but no batch spec names 'context'",
        ),
        (P("data", "context"), None, {"data": 8}, r"over 'context', which is no axis of the mesh"),
    ],
    ids=["context-on-the-rows", "split-not-in-the-specs", "axis-not-in-the-mesh"],
)
def test_a_step_s_sequence_split_asked_wrong_is_refused_and_the_fix_runs(specs, sequence, mesh, said):
    with pytest.raises(ValueError, match=said):
        _tiny_step(specs, sequence, mesh)
    state, step = _tiny_step(P("data", "context"), sequence)  # (the fix each names)
    x = jnp.arange(2 * LENGTH, dtype=jnp.float32).reshape(2, LENGTH)
    with pytest.warns(UncheckedPlanWarning, match="no model call in it was checked against the whole"):
        _, loss = step(state, x)  # (its "model" a product: no call the check could read)
    assert float(loss) == float(x.mean())


def test_a_sequence_axis_of_another_name_is_told_to_the_step_and_the_fix_runs():
    """Issue 99 point 4: a batch spec that splits the tokens over an axis named 'seq' was taken
    for a batch over 'data' alone, and the refusal (sync_gradients') advised axes=('data',),
    which ends raw; the fix is to name the axis to the step, and then the step runs."""
    mesh = {"data": 2, "seq": 4}
    with pytest.raises(ValueError, match=r"dim 1 over 'seq'.*sequence=SequenceSplit\(axis='seq'\)"):
        _tiny_step(P("data", "seq"), None, mesh)
    state, step = _tiny_step(P("data", "seq"), SequenceSplit(axis="seq"), mesh)  # (the fix it names)
    x = jnp.arange(2 * LENGTH, dtype=jnp.float32).reshape(2, LENGTH)
    with pytest.warns(UncheckedPlanWarning, match="no model call in it was checked against the whole"):
        _, loss = step(state, x)
    assert float(loss) == float(x.mean())


TAPS, TIME = jnp.ones((3, 1, D)), ("NWC", "WIO", "NWC")


# Issue 84 point 3: a model that mixes tokens itself under a sequence split is refused at its
# line before anything runs, with the fix (positions as inputs; the library's attention).
def _mix(x, how, table=None):
    length = x.shape[1]
    if how == "positions from the local length":
        return x + jnp.arange(length)[None, :, None]  # refused
    if how == "a position table cut to it":
        return x + table[:length]  # refused
    if how == "a causal mask from local shapes":
        return jnp.einsum("qk,bkd->bqd", jnp.tril(jnp.ones((length, length))), x)  # refused
    if how == "a softmax over the keys written out":
        return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", x, x), axis=-1) @ x  # refused
    if how == "a cumsum":
        return jnp.cumsum(x, axis=1)  # refused
    if how == "a roll":
        return jnp.roll(x, 1, axis=1)  # refused
    if how == "a mean over the sequence":
        return x - x.mean(axis=1, keepdims=True)  # refused
    if how == "a convolution over time":  # (depthwise, 3 taps, as a Mamba or Hyena block's)
        return jax.lax.conv_general_dilated(
            x, TAPS.astype(x.dtype), (1,), "SAME", dimension_numbers=TIME, feature_group_count=D
        )
    if how == "the fix: the library's attention":  # (every query over the keys before it)
        return x + attend(x[:, :, None], x[:, :, None], x[:, :, None])[:, :, 0]
    raise AssertionError(how)


class LinenMixed(nn.Module):
    how: str

    @nn.compact
    def __call__(self, batch):
        x = nn.Embed(VOCAB, D, name="embed")(batch["tokens"])
        table = self.param("positions", nn.initializers.normal(), (LENGTH, D))
        return nn.Dense(VOCAB, name="head")(_mix(x, self.how, table))


class NNXMixed(nnx.Module):
    def __init__(self, how, rngs):
        self.how, self.embed, self.head = how, nnx.Embed(VOCAB, D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)
        self.table = nnx.Param(jax.random.normal(rngs.params(), (LENGTH, D)))

    def __call__(self, batch):
        return self.head(_mix(self.embed(batch["tokens"]), self.how, self.table[...]))


MIXES = [
    "positions from the local length",
    "a position table cut to it",
    "a causal mask from local shapes",
    "a softmax over the keys written out",
    "a cumsum",
    "a roll",
    "a mean over the sequence",
    "a convolution over time",
]


@functools.cache
def _the_fix_runs() -> bool:
    """The fix the refusals name, applied: the tokens mixed through the library's attention."""
    fixed = LinenMixed("the fix: the library's attention")
    check_sharded(fixed, BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1, optimizers={})
    return True


def _apply_the_fix(refused) -> None:
    named_fix(refused, "mix tokens only through the attention the library computes across devices")
    assert _the_fix_runs()


def _line_of(how: str) -> int:
    lines, first = inspect.getsourcelines(_mix)
    at = next(i for i, text in enumerate(lines) if f'"{how}"' in text)
    return first + at + 1


def _plain_losses(api: str, how: str) -> tuple[float, float]:
    """A user's own step around a plain model call (Linen's ``apply``, NNX's ``nnx.merge``),
    over data x context: its loss, and the unsharded model's."""
    if api == "linen":
        model = LinenMixed(how)
        params = model.init(jax.random.key(0), BATCH[0])["params"]
        call = lambda p, batch: model.apply({"params": p}, batch)
    else:
        graphdef, params = nnx.split(NNXMixed(how, nnx.Rngs(0)))
        call = lambda p, batch: nnx.merge(graphdef, p)(batch)
    axes, mesh = ("data", "context"), fsdp_tp.make_mesh(STEP_MESH)

    def step_fn(state, data):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(call(p, data[0]), data[1]))(state.params)
        return sync_gradients(grads, axes), jax.lax.pmean(loss, axes)  # (every device as many tokens)

    init_fn = lambda rng: fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), rng=rng)
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    token = P("data", "context")
    step = fsdp_tp.shard_step(step_fn, mesh, specs, ({k: token for k in BATCH[0]}, token), donate_state=False)
    return float(step(state, BATCH)[1]), float(cross_entropy(call(params, BATCH[0]), BATCH[1]))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_plain_model_call_in_the_user_s_own_step_is_checked_against_the_whole_sequence(api):
    """No ``shard_by_rules``: the step's own ``model.apply`` (or ``nnx.merge``'s model) building
    positions from a device's length is refused at its line at the first step; (negative
    control) with the check off it trains on, wrong; the fix named runs, equal to unsharded."""
    at = rf"test_context_step\.py:{_line_of('positions from the local length')} "
    said = rf"^shard_step.*: the sequence split over 'context' reaches .*{at}.*Fix: take positions"
    with pytest.raises(RuleError, match=said) as refused:
        _plain_losses(api, "positions from the local length")
    with switched_off():
        wrong, want = _plain_losses(api, "positions from the local length")
    assert not np.isclose(wrong, want, rtol=1e-3), (wrong, want)
    named_fix(refused, "mix tokens only through the attention the library computes across devices")
    got, want = _plain_losses(api, "the fix: the library's attention")
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("how", MIXES)
def test_a_model_mixing_tokens_itself_under_the_sequence_split_is_refused_at_its_line(how):
    at = rf"test_context_step\.py:{_line_of(how)} "
    said = rf"^shard_by_rules\(LinenMixed\): the sequence split over 'context' reaches .*{at}.*Fix: take posi"
    run = lambda mesh: check_sharded(LinenMixed(how), BATCH, cross_entropy, mesh, steps=1, optimizers={})
    with pytest.raises(RuleError, match=said) as refused:
        run({"data": 2, "context": 4})
    assert "fsdp_tp.attention.attend" in str(refused.value)
    _apply_the_fix(refused)


def test_an_nnx_model_mixing_tokens_itself_is_refused_too_and_a_token_wise_one_runs():
    said = rf"the sequence split over 'context' reaches .*test_context_step\.py:{_line_of('a roll')} "
    with pytest.raises(RuleError, match=said) as refused:
        check_sharded(
            lambda rngs: NNXMixed("a roll", rngs), BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1
        )
    _apply_the_fix(refused)


# Issue 84 point 5: dropout under the sequence split draws each device's tokens' block of the
# unsharded mask (the balanced layout's two chunks each in its place).
class LinenDrop(nn.Module):
    transposed: bool = False

    @nn.compact
    def __call__(self, batch):
        x = nn.Embed(VOCAB, D, name="embed")(batch["tokens"])
        if self.transposed:  # (rows, features, tokens): refused, no place for the mask
            return nn.Dense(VOCAB, name="head")(
                nn.Dropout(0.5, deterministic=False)(x.swapaxes(1, 2)).swapaxes(1, 2)
            )
        return nn.Dense(VOCAB, name="head")(nn.Dropout(0.5, deterministic=False)(x))


class NNXDrop(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.head = nnx.Embed(VOCAB, D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, batch, rngs=None):
        return self.head(self.drop(self.embed(batch["tokens"]), rngs=rngs))


DROP = {"dropout": jax.random.key(3)}
DROP_MESH = {"data": 2, "context": 4}


def test_dropout_under_the_sequence_split_is_the_unsharded_mask_linen_and_nnx():
    check_sharded(LinenDrop(), BATCH, cross_entropy, DROP_MESH, rngs=DROP, steps=1)
    contiguous = SequenceSplit(balanced=False)
    check_sharded(NNXDrop, BATCH, cross_entropy, DROP_MESH, rngs=DROP, steps=1, sequence=contiguous)


def test_dropout_placed_as_rows_is_caught_and_a_transposed_one_refused(monkeypatch):
    with pytest.raises(
        ValueError, match=r"dropout on an activation of local shape \(1, 16, 4\) .* before any transpose"
    ):
        check_sharded(LinenDrop(transposed=True), BATCH, cross_entropy, DROP_MESH, rngs=DROP, steps=1)
    # (negative control) the mask placed as if context split the rows, as 0.2 drew it
    monkeypatch.setattr(LaidOut, "tokens", lambda self, tree: None)
    with pytest.raises(AssertionError, match="output"):
        check_sharded(LinenDrop(), BATCH, cross_entropy, DROP_MESH, rngs=DROP, steps=1, optimizers={})


# Issue 84 points 4 and 5: flax's own attention. Its function computes across (NNX's through
# jax.nn.dot_product_attention where it draws no dropout), causal by NNX's is_causal; with
# attention dropout each block of the ring drops with its block of the unsharded mask, in the
# forward and again in the backward. A mask built from local shapes is refused with the fix.
class NNXAttentionLM(nnx.Module):
    def __init__(self, rngs, causal: bool = True, dropout: float = 0.0):
        attention = functools.partial(nnx.dot_product_attention, is_causal=causal)
        self.embed, self.head = nnx.Embed(VOCAB, D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            4, D, decode=False, attention_fn=attention, rngs=rngs, dropout_rate=dropout, deterministic=False
        )

    def __call__(self, batch, rngs=None):  # (rngs: at call time, else the module's own)
        return self.head(self.attn(self.embed(batch["tokens"]), rngs=rngs))


class LinenDroppingLM(nn.Module):
    broadcast: bool = False  # (flax's broadcast_dropout: one mask over rows and heads)

    @nn.compact
    def __call__(self, batch):
        x = nn.Embed(VOCAB, D, name="embed")(batch["tokens"])
        attention = nn.MultiHeadDotProductAttention(
            4, dropout_rate=0.3, broadcast_dropout=self.broadcast, deterministic=False, name="attn"
        )
        return nn.Dense(VOCAB, name="head")(attention(x))


HEADS_SPLIT = [("attn$", fsdp_tp.tp.HeadParallel())]
NNX_DROPPING = functools.partial(NNXAttentionLM, dropout=0.3)


def test_attention_dropout_across_devices_is_the_unsharded_mask_linen_and_nnx():
    """Ring (balanced, contiguous) and all-to-all, with heads split over tensor, both
    check_vma settings, broadcast or not, causal (NNX) and full (Linen): equal to unsharded."""
    mesh = {"data": 2, "context": 2, "tensor": 2}
    check_sharded(LinenDroppingLM(), BATCH, cross_entropy, mesh, tp_rules=HEADS_SPLIT, rngs=DROP, steps=1)
    check_sharded(NNX_DROPPING, BATCH, cross_entropy, DROP_MESH, rngs=DROP, steps=1)
    a2a, contiguous = SequenceSplit(strategy="all_to_all"), SequenceSplit(balanced=False)
    once = dict(rngs=DROP, steps=1, optimizers={})
    check_sharded(NNX_DROPPING, BATCH, cross_entropy, mesh, tp_rules=HEADS_SPLIT, sequence=a2a, **once)
    broadcast = LinenDroppingLM(broadcast=True)
    check_sharded(broadcast, BATCH, cross_entropy, DROP_MESH, sequence=contiguous, check_vma=False, **once)


def test_attention_dropout_s_negative_controls_the_keys_block_and_the_backward(monkeypatch):
    """Each block's mask drawn at the queries' own place for the keys' (the visiting device's
    forgotten), or the backward without the mask: the harness sees other numbers."""
    import fsdp_tp.context._blocks as blocks
    from fsdp_tp.context._schedule import Schedule

    once = dict(rngs=DROP, steps=1, optimizers={})
    run = lambda: check_sharded(LinenDroppingLM(), BATCH, cross_entropy, DROP_MESH, **once)
    with monkeypatch.context() as patched:
        starts = Schedule.starts
        patched.setattr(Schedule, "starts", lambda self, me, source, *rest: starts(self, me, me, *rest))
        with pytest.raises(AssertionError, match="output"):
            run()
    backward = blocks.backward
    monkeypatch.setattr(blocks, "backward", lambda *args: backward(*args[:-1], None))
    with pytest.raises(AssertionError, match=r"grads\['attn'\]"):
        run()


class LinenAttentionLM(nn.Module):
    fixed: bool = False  # (the fix: its attention function jax.nn.dot_product_attention, causal)

    @nn.compact
    def __call__(self, batch):
        x = nn.Embed(VOCAB, D, name="embed")(batch["tokens"])
        if self.fixed:
            causal = lambda q, k, v, **_: jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return nn.Dense(VOCAB, name="head")(nn.MultiHeadDotProductAttention(4, attention_fn=causal)(x))
        mask = nn.make_causal_mask(batch["tokens"])  # refused: a mask from local shapes
        return nn.Dense(VOCAB, name="head")(nn.MultiHeadDotProductAttention(4, name="attn")(x, mask=mask))


def test_flax_attention_nnx_computes_across_and_a_mask_from_local_shapes_is_refused():
    check_sharded(NNXAttentionLM, BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1)
    full = lambda rngs: NNXAttentionLM(rngs, causal=False)
    check_sharded(full, BATCH, cross_entropy, {"data": 2, "context": 2, "tensor": 2}, steps=1, optimizers={})
    line = _source_line(LinenAttentionLM, "(x, mask=mask)")  # (the module's call, with the mask)
    said = (
        rf"MultiHeadDotProductAttention at attn \(called at tests/test_context_step\.py:{line} "
        rf"\(LinenAttentionLM\.__call__\)\): flax's attention function given mask=\.\.\. inside a step"
    )
    with pytest.raises(RuleError, match=said) as refused:
        check_sharded(LinenAttentionLM(), BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1)
    named_fix(refused, "jax.nn.dot_product_attention with is_causal=True")
    fixed = LinenAttentionLM(fixed=True)
    check_sharded(fixed, BATCH, cross_entropy, {"data": 2, "context": 4}, steps=1, optimizers={})


def test_the_model_step_s_temporaries_fall_as_one_over_cp():
    """Issue 84's memory proof on a model's train step (the GPT preset, AdamW, as ``fsdp-tp
    train --mesh context=k`` compiles it): at k devices a device's temporaries are at most
    1/k of one device's. (Its negative control, k and v all-gathered instead of passed round,
    is the attention's: tests/test_context.py.)"""
    from fsdp_tp.bench.context_step_rows import step_temp_bytes

    whole = step_temp_bytes(1, 512)
    assert [step_temp_bytes(k, 512) <= whole / k for k in (2, 4)] == [True, True]


# Issue 84 point 5: expert parallelism under the sequence split. Each device routes its own
# tokens: dropless routing is each token's own choice, exact; a capacity is refused (its slots
# would fill in another order than the unsharded model's).
class LinenMoEBlock(nn.Module):
    capacity_factor: float | None = None

    @nn.compact
    def __call__(self, x, batch):
        h = rms(x)
        q, k, v = (
            heads_of(nn.Dense(n * HEAD_DIM, name=name)(h)) for name, n in (("q", HEADS), ("k", KV), ("v", KV))
        )
        x = x + nn.Dense(D, name="out")(attention(q, k, v, batch).reshape(*x.shape[:2], -1))
        y, (balance, _) = LinenMoE(4, 2, HIDDEN, self.capacity_factor, name="moe")(rms(x))
        return x + y, balance


class LinenMoELM(nn.Module):
    capacity_factor: float | None = None

    @nn.compact
    def __call__(self, batch):
        x, aux = nn.Embed(VOCAB, D, name="embed")(batch["tokens"]), 0.0
        for i in range(2):
            x, balance = LinenMoEBlock(self.capacity_factor, name=f"block_{i}")(x, batch)
            aux = aux + 1e-2 * balance  # (the load balance over the whole batch: data, expert, context)
        return nn.Dense(VOCAB, name="head")(rms(x)), aux


def moe_loss(out, targets):
    logits, aux = out
    return cross_entropy(logits, targets) + aux


EP = [(r"moe/experts/(gate|up)$", ExpertParallel()), (r"moe/experts/down$", ExpertParallel(returns=True))]


def test_expert_parallel_under_the_sequence_split_is_the_unsharded_model_and_a_capacity_refused(
    monkeypatch,
):
    """data x context x expert: tokens sent to the experts by all_to_all from each device's
    share of the sequence, equal to unsharded dropless; a capacity is refused before the first
    step with the fix; (negative control) let through, the harness sees other tokens dropped."""
    mesh, batch = {"data": 2, "context": 2, "expert": 2}, _rows(4)
    run = lambda factor: check_sharded(
        LinenMoELM(factor), batch, moe_loss, mesh, tp_rules=EP, batch_axes=("data", "expert"), steps=2
    )
    said = r"capacity=\d+ slots an expert, in a step that splits the sequence over 'context'"
    with pytest.raises(ValueError, match=said) as refused:
        run(1.0)
    with monkeypatch.context() as patched:
        patched.setattr(fsdp_tp.routing, "_require_whole_sequence", lambda *_: None)
        with pytest.raises(AssertionError, match="output"):
            run(1.0)
    named_fix(refused, "Route dropless under the split (capacity_factor=None")
    run(None)


def test_a_per_token_output_split_past_the_sequence_comes_back_in_the_batchs_order():
    # Logits split on their vocabulary over tensor (a column-parallel head's) are per-token:
    # P("data", "context", "tensor") starts as the tokens' spec does. They were left in the
    # split's order, silently (found loading a checkpoint: issue 100).
    laid = LaidOut(SequenceSplit(), 4, {"tokens": P("data", "context")})
    logits = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    spread = laid.batch({"tokens": logits})["tokens"]
    assert not jnp.array_equal(spread, logits)  # (the balanced split reorders: the test can fail)
    assert jnp.array_equal(laid.outputs(spread, P("data", "context", "tensor")), logits)
    assert jnp.array_equal(laid.outputs(spread, P("data", None, "tensor")), spread)  # (not split: as it is)

"""Issue 99: the whole step proved, not only the model's call. A user's own ``shard_step`` around a
plain model call (Linen's ``apply``, NNX's ``nnx.merge``), its batch split over rows and sequence:
the idioms that train silently wrong there (a next-token shift inside the step, a ratio of
per-device sums, a ``pmean`` that forgets an axis) are refused before the first step at their
line with a fix; the fix, applied, is equal to the unsharded step in float64; (negative
controls) the check off, each trains wrong, measured here.
"""

from __future__ import annotations

import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp import sync_gradients
from fsdp_tp._check.driver import switched_off
from fsdp_tp.attention import attend
from fsdp_tp.context import SequenceSplit, next_token_targets
from fsdp_tp.errors import IndivisibleShapeError, RuleError
from fsdp_tp.gradients import global_mean_loss
from fsdp_tp.testing import Inputs, check_sharded
from tests.packed_lm import BATCH, NNXLM, LinenLM
from tests.refusals import named_fix

MESHES = {
    "data2-context4": {"data": 2, "context": 4},
    "data2-context2-tensor2": {"data": 2, "context": 2, "tensor": 2},
}
AXES = ("data", "context")


def _ce(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def _loss(how: str, logits_of, batch, axes):
    """The loss as a step writes it, ``how``; ``axes=None``: on the whole batch, unsharded
    (the loss the step means)."""
    tokens = batch["tokens"]
    if how == "roll":  # (a next-token shift of the tokens, in the step)
        return _ce(logits_of(batch), jnp.roll(tokens, -1, axis=1)).mean()
    if how == "logits sliced":  # (the tutorials' shift before issue 99)
        return _ce(logits_of(batch)[:, :-1], tokens[:, 1:]).mean()
    if how == "model on tokens[:, :-1]":
        return _ce(logits_of({k: v[:, :-1] for k, v in batch.items()}), tokens[:, 1:]).mean()
    ce = _ce(logits_of(batch), batch["targets"]) * batch["weights"]
    if how == "ratio" or axes is None:  # (a device's token-weighted mean; the whole batch's)
        return ce.sum() / batch["weights"].sum()
    return global_mean_loss(ce.sum(), batch["weights"].sum(), axes)  # "the fix", "pmean over data"


def _batch():
    """The packed batch with its targets and weights shifted whole (the fix's batch)."""
    batch = dict(BATCH[0])
    batch["targets"], batch["weights"] = next_token_targets(batch["tokens"], batch["segments"])
    return jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, batch)


@functools.cache
def _model(api: str):
    with jax.enable_x64(True):
        if api == "linen":
            model = LinenLM()
            params = model.init(jax.random.key(0), BATCH[0])["params"]
            call = lambda p, batch: model.apply({"params": p}, batch)
        else:
            graphdef, params = nnx.split(NNXLM(nnx.Rngs(0)))
            call = lambda p, batch: nnx.merge(graphdef, p)(batch)
        return call, jax.tree.map(lambda x: x.astype(jnp.float64), params)


def _run(api: str, how: str, mesh: dict, sequence=None, check_vma: bool = True):
    """The user's step ``how`` over ``mesh`` (its loss and gradients), and the unsharded step's."""
    call, params = _model(api)
    mesh = fsdp_tp.make_mesh(mesh)
    over = "data" if how == "pmean over data" else AXES

    def step_fn(state, batch):
        value, grads = jax.value_and_grad(lambda p: _loss(how, lambda b: call(p, b), batch, AXES))(
            state.params
        )
        return sync_gradients(grads, AXES), (jax.lax.pmean(value, over), sync_gradients(grads, AXES))

    init_fn = lambda rng: fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), rng=rng)
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    batch = _batch()
    token = P("data", "context")
    step = fsdp_tp.shard_step(
        step_fn,
        mesh,
        specs,
        {k: token for k in batch},
        metrics_specs=(P(), specs.params),
        donate_state=False,
        sequence=sequence,
        check_vma=check_vma,
    )
    got = step(state, batch)[1]
    want = jax.value_and_grad(lambda p: _loss(how, lambda b: call(p, b), batch, None))(params)
    return got, want


def _line(text: str) -> int:
    lines, first = inspect.getsourcelines(_loss)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _far(got, want) -> float:
    """The largest difference of the losses and gradients, relative to the unsharded's scale
    (a nan: infinitely far; a device whose tokens all weigh 0 divides 0 by 0)."""
    gap = lambda a, b: np.nan_to_num(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30), nan=np.inf)
    return max(float(x) for x in jax.tree.leaves(jax.tree.map(gap, got, want)))


SILENT = [  # (how, the refusal's words, its line's text in _loss, the fix it names: "the fix" applies each)
    (
        "roll",
        r"slice .*Fix: shift the targets with the batch",
        "jnp.roll",
        "fsdp_tp.context.next_token_targets",
    ),
    (
        "logits sliced",
        r"slice .*Fix: shift the targets with the batch",
        "[:, :-1], tokens",
        "fsdp_tp.context.next_token_targets",
    ),
    ("ratio", r"div reads the partial sums .*Fix: complete the sum", "ce.sum() / ", "global_mean_loss"),
    (
        "pmean over data",
        r"the step returns partial sums .*summed over data only",
        None,
        "jax.lax.pmean(x, ('data', 'context'))",
    ),
]


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_silent_idioms_are_refused_at_their_line_and_the_fix_is_the_unsharded_step(api, mesh):
    with jax.enable_x64(True):
        for how, said, text, fix in SILENT:
            at = rf"test_whole_step\.py:{_line(text)} " if text else ""
            with pytest.raises(RuleError, match=rf"(?s)^shard_step: .*{at}.*{said}") as refused:
                _run(api, how, MESHES[mesh])
            named_fix(refused, fix)
            # (negative control: the check off, it trains wrong; a pmean over too few axes is
            # JAX's own error under check_vma, silent without)
            if mesh != "data2-context4":  # (the controls once an API: each compiles a step)
                continue
            with switched_off():
                wrong, want = _run(api, how, MESHES[mesh], check_vma=how != "pmean over data")
            assert _far(wrong, want) > 1e-3, (how, _far(wrong, want))
        got, want = _run(api, "the fix", MESHES[mesh])  # (the targets shifted whole, the global mean)
    assert _far(got, want) < 1e-11, _far(got, want)


def test_a_model_called_on_a_cut_sequence_is_refused_naming_the_shift_with_the_batch():
    """The refusal of a device's odd length once advised ``balanced=False``, which trained wrong;
    it names the shift with the batch now, and the contiguous split is refused at the slice."""
    with jax.enable_x64(True):
        with pytest.raises(
            IndivisibleShapeError, match=r"step's code cut them.*next_token_targets"
        ) as refused:
            _run("linen", "model on tokens[:, :-1]", MESHES["data2-context4"])
        assert "balanced=False" not in str(refused.value)
        at = rf"test_whole_step\.py:{_line('v[:, :-1]')} "
        with pytest.raises(RuleError, match=rf"(?s){at}.*next_token_targets") as refused:
            _run("linen", "model on tokens[:, :-1]", MESHES["data2-context4"], SequenceSplit(balanced=False))
        named_fix(refused, "fsdp_tp.context.next_token_targets")
        got, want = _run("linen", "the fix", MESHES["data2-context4"])
    assert _far(got, want) < 1e-11, _far(got, want)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_next_token_targets_pair_each_token_with_its_document_s_next(data):
    rows, length = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    segments = np.array(
        [
            sorted(data.draw(st.lists(st.integers(0, 3), min_size=length, max_size=length)))
            for _ in range(rows)
        ]
    )[:, ::-1]  # (documents contiguous, padding 0 at the end)
    tokens = np.array(data.draw(st.lists(st.integers(0, 99), min_size=rows * length, max_size=rows * length)))
    tokens = tokens.reshape(rows, length)
    targets, weights = map(np.asarray, next_token_targets(tokens, segments))
    for r in range(rows):
        for t in range(length):
            kept = t + 1 < length and segments[r, t] != 0 and segments[r, t + 1] == segments[r, t]
            assert weights[r, t] == float(kept), (segments[r], t)
            assert not kept or targets[r, t] == tokens[r, t + 1]
    plain_targets, plain_weights = map(np.asarray, next_token_targets(tokens))
    assert plain_weights.sum() == rows * (length - 1) and (plain_targets[:, :-1] == tokens[:, 1:]).all()


def test_next_token_targets_refuses_segment_ids_of_another_shape_or_dtype():
    tokens = jnp.zeros((2, 8), jnp.int32)
    for bad in (jnp.ones((2, 7), jnp.int32), jnp.ones((2, 8, 1), jnp.int32), jnp.ones((2, 8))):
        with pytest.raises(
            ValueError, match=r"next_token_targets: segment_ids must be integers of the tokens"
        ):
            next_token_targets(tokens, bad)


def _weighted_ce(out, y):
    """A padding-weighted loss as ``(sum, weight)``: check_sharded divides the whole batch's."""
    targets, weights = y
    ce = optax.softmax_cross_entropy_with_integer_labels(out, targets)
    return (ce * weights).sum(), weights.sum()


def _ratio_ce(out, y):  # (the same loss as a device computes it alone: its own tokens' mean)
    total, weight = _weighted_ce(out, y)
    return total / weight


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_check_sharded_proves_a_padding_weighted_packed_model_and_names_a_per_device_mean(api):
    """Issue 99 point 4: a packed model with a padding-weighted loss, given as ``(sum, weight)``,
    equal to unsharded over data x context; the same loss as a per-device ratio is refused at
    its division naming that form, and (negative control) let through it fails on the loss,
    naming the reduction the check used."""
    model = LinenLM() if api == "linen" else NNXLM
    batch = (BATCH[0], next_token_targets(BATCH[0]["tokens"], BATCH[0]["segments"]))
    mesh = MESHES["data2-context4"]
    check_sharded(model, batch, _weighted_ce, mesh, steps=1, optimizers={})
    with pytest.raises(
        RuleError, match=r"(?s)_ratio_ce.*div reads the partial sums.*return the loss as \(sum, weight\)"
    ) as refused:
        check_sharded(model, batch, _ratio_ce, mesh, steps=1, optimizers={})
    named_fix(refused, "return the loss as (sum, weight)")  # (_weighted_ce, proved above)
    with switched_off(), pytest.raises(AssertionError, match=r"^loss \(the devices' losses averaged"):
        check_sharded(model, batch, _ratio_ce, mesh, steps=1, optimizers={})


class _TwoInputs(nn.Module):
    """A model of two inputs, as people write one: ``model(tokens, positions)``."""

    @nn.compact
    def __call__(self, tokens, positions, *, scale=None):
        scale = 1.0 if scale is None else scale[..., None]  # (a keyword input, a leaf per token)
        x = nn.Embed(32, 16)(tokens) + scale * jnp.sin(positions[..., None] / 3.0)
        return nn.Dense(32)(jnp.tanh(nn.Dense(16)(x)))


class _NNXTwoInputs(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.up, self.out = (
            nnx.Embed(32, 16, rngs=rngs),
            nnx.Linear(16, 16, rngs=rngs),
            nnx.Linear(16, 32, rngs=rngs),
        )

    def __call__(self, tokens, positions, *, scale=None):
        scale = 1.0 if scale is None else scale[..., None]
        x = self.embed(tokens) + scale * jnp.sin(positions[..., None] / 3.0)
        return self.out(jnp.tanh(self.up(x)))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_check_sharded_proves_a_model_of_two_inputs_and_names_the_form_it_takes(api):
    """Issue 99 point 4: ``model(tokens, positions, scale=...)`` given its inputs one by one
    (``Inputs``), equal to unsharded; given them as one tuple, the model's own ``TypeError`` is
    named with that fix, which then runs."""
    model = _TwoInputs() if api == "linen" else _NNXTwoInputs
    tokens, positions = BATCH[0]["tokens"], BATCH[0]["positions"].astype(jnp.float32)
    targets = next_token_targets(tokens, BATCH[0]["segments"])
    with pytest.raises(
        TypeError, match=r"(?i)missing 1 .*the check calls model\(inputs\).*fsdp_tp.testing.Inputs\(tokens"
    ):
        check_sharded(
            model,
            ((tokens, positions), targets),
            _weighted_ce,
            {"data": 2, "tensor": 4},
            steps=1,
            optimizers={},
        )
    inputs = Inputs(tokens, positions, scale=jnp.full(tokens.shape, 0.5))
    check_sharded(model, (inputs, targets), _weighted_ce, {"data": 2, "context": 4}, steps=1, optimizers={})


def test_a_per_token_leaf_laid_out_otherwise_than_the_tokens_is_named_and_the_fix_runs():
    """Issue 99 point 6: positions whose spec leaves the sequence whole (broadcasting errors deep
    in the model), targets cut by a shift (the layout's divisibility error, whose advice trained
    wrong), refused in one line naming the leaf's path and the fix, which then runs."""
    call, params = _model("linen")
    mesh = fsdp_tp.make_mesh(MESHES["data2-context4"])

    def step_fn(state, data):
        batch, (targets, weights) = data
        loss = lambda p: global_mean_loss((_ce(call(p, batch), targets) * weights).sum(), weights.sum(), AXES)
        value, grads = jax.value_and_grad(loss)(state.params)
        return sync_gradients(grads, AXES), jax.lax.pmean(value, AXES)

    init_fn = lambda rng: fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), rng=rng)
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    token, rows = P("data", "context"), P("data")
    tokens, segments = BATCH[0]["tokens"], BATCH[0]["segments"]
    shifted = next_token_targets(tokens, segments)
    run = lambda batch_specs, data: fsdp_tp.shard_step(step_fn, mesh, specs, batch_specs, donate_state=False)(
        state, data
    )
    whole_positions = {"tokens": token, "positions": rows, "segments": token}
    with pytest.raises(
        ValueError,
        match=r"batch leaf \[0\]\['positions'\] \(2, 16\) holds .* "
        r"Give it the tokens' spec, P\('data', 'context'\)",
    ):
        run((whole_positions, (token, token)), (BATCH[0], shifted))
    cut = (tokens[:, 1:], jnp.ones((2, 15)))
    with pytest.raises(
        ValueError,
        match=r"batch leaf \[1\]\[0\] \(2, 15\) is split over 'context' with 15 tokens .*next_token_targets",
    ):
        run(({k: token for k in BATCH[0]}, (token, token)), (BATCH[0], cut))
    with jax.enable_x64(True):
        _, loss = run(({k: token for k in BATCH[0]}, (token, token)), (BATCH[0], shifted))
    assert np.isfinite(float(loss))


def test_attend_names_heads_that_do_not_divide_and_segment_ids_that_do_not_fit():
    """Issue 99 point 6: an einsum's label error (4 query heads over 3 kv heads) and segment ids
    of another shape or a float dtype, each one line naming the argument and the fix, which runs."""
    q, kv = jnp.ones((2, 8, 4, 4)), jnp.ones((2, 8, 2, 4))
    with pytest.raises(
        ValueError, match=r"^attend: .* kv heads that divide the 4 query heads .*; 3 does not divide"
    ):
        attend(q, jnp.ones((2, 8, 3, 4)), jnp.ones((2, 8, 3, 4)))
    segments = jnp.ones((2, 8), jnp.int32)
    for bad in (segments[:, :-1], segments[..., None], segments.astype(jnp.float32)):
        with pytest.raises(
            ValueError, match=r"^attend: segment_ids .*; pass one integer document id per token, \(2, 8\)"
        ):
            attend(q, kv, kv, segment_ids=bad)
    assert attend(q, kv, kv, segment_ids=segments).shape == q.shape

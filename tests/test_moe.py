"""Mixture of experts (issue 59): routing as the unsharded model routes, and the MoE language
model laid out over the batch axes and FSDP equal to its unsharded twin, Linen and NNX."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp.models.moe as moe
from fsdp_tp.models.moe import LinenMoE, MoELM, NNXMoELM
from fsdp_tp.routing import capacity, combine, dispatch, route
from fsdp_tp.testing import check_sharded


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


@settings(max_examples=60, deadline=None)
@given(routings())
def test_routing_is_token_choice_top_k_with_capacity(case):
    """Route, dispatch and combine against the routing written out: the same experts (ties to
    the lower index), the same kept choices, each kept token in its slot, and each token's output
    its kept choices' expert outputs times their weights."""
    logits, k, factor = case
    tokens, experts = logits.shape
    slots = capacity(tokens, k, experts, factor)
    r = route(jnp.asarray(logits), k, slots)
    chosen, kept, position = reference_routing(logits, k, slots)
    np.testing.assert_array_equal(r.chosen, chosen)
    np.testing.assert_array_equal(r.kept, kept)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(tokens, 3)), jnp.float32)
    buffers = np.asarray(dispatch(x, r))
    for t, j in zip(*np.nonzero(kept), strict=True):
        np.testing.assert_array_equal(buffers[chosen[t, j], position[t, j]], x[t])
    assert np.count_nonzero(np.abs(buffers).sum(-1)) == kept.sum()  # nothing else in the buffers
    scale = jnp.arange(1.0, experts + 1)[:, None, None]  # expert e multiplies by e + 1
    want = (np.asarray(r.weights) * kept * np.asarray(scale).ravel()[chosen]).sum(-1)[:, None] * np.asarray(x)
    np.testing.assert_allclose(combine(dispatch(x, r) * scale, r), want, rtol=1e-6, atol=1e-6)


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


def _model(api: str, **sizes):
    sizes, wide = {**SIZES, **sizes}, jnp.float64  # (check_sharded computes in float64)
    return MoELM(sizes, wide) if api == "linen" else (lambda rngs: NNXMoELM(rngs, wide, **sizes))


@pytest.mark.parametrize(
    "api, sizes",
    [
        pytest.param("linen", dict(shared_hidden=8), id="linen-dropless-shared"),
        pytest.param("linen", dict(capacity_factor=1.0, moe_every=2), id="linen-capacity-every-other"),
        pytest.param("nnx", dict(top_k=1, check_vma=False), id="nnx-dropless-top1-unchecked"),
        pytest.param("nnx", dict(capacity_factor=1.0, shared_hidden=8), id="nnx-capacity-shared"),
    ],
)
def test_the_moe_lm_over_data_and_fsdp_is_its_unsharded_twin(api, sizes):
    """Invariants 1-5 (init, outputs with the aux losses, loss, gradients, SGD and AdamW steps)
    for the MoE LM with its experts stored split over fsdp and gathered: dropless and at
    capacity 1.0 (tokens dropped), top-1 and top-2, with a shared expert, both check_vma."""
    check_vma = sizes.pop("check_vma", True)
    check_sharded(
        _model(api, **sizes), (TOKENS, TOKENS), lm_loss, MESH, STORAGE, steps=2, check_vma=check_vma
    )


def _per_shard_balance(fractions, probs, batch_axes=()):
    return probs.shape[-1] * jnp.sum(jax.lax.stop_gradient(fractions) * probs)


def test_negative_control_a_load_balancing_loss_not_the_global_batchs_is_caught(monkeypatch):
    """A mean of per-device losses (each device's f and P multiplied, then averaged): another loss."""
    monkeypatch.setattr(moe, "load_balancing_loss", _per_shard_balance)
    for check_vma in (True, False):
        with pytest.raises(AssertionError, match=r"output\[1\]: 1 of 1 elements"):
            check_sharded(
                _model("linen"),
                (TOKENS, TOKENS),
                lm_loss,
                MESH,
                STORAGE,
                steps=1,
                optimizers={},
                check_vma=check_vma,
            )


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

"""Issue 42 point 2: dropout under every strategy draws the unsharded model's mask, bit for
bit — Linen and NNX, model-held and call-time rngs, both check_vma modes.

Before, a tensor rank drew the same mask for its own slice of the hidden units as every other
rank (units j, j + H/4, ... always dropped together), and a key left unfolded repeated one mask
over the batch shards. The core (:mod:`fsdp_tp.dropout`) draws each device's block of the
global mask from threefry's counters; the models below put dropout in the column-parallel
region (split over tensor), after the row layer's sum (the same on every tensor rank), and
broadcast along the sequence."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.linen._dropout
import fsdp_tp.nnx
from fsdp_tp._check.driver import switched_off
from fsdp_tp.dropout import fold_over_block, keep_mask, wide_index
from fsdp_tp.errors import FoldedDropoutWarning, RuleError
from fsdp_tp.testing import check_sharded
from tests.equivalence import ATOL, RTOL

MESHES = {
    "data x tensor": {"data": 2, "tensor": 4},
    "data x fsdp x tensor": {"data": 2, "fsdp": 2, "tensor": 2},
}
KEY = jax.random.key(7)
# Where the roles look up what they tell dropout (a negative control patches them all).
ROLE_MODULES = (fsdp_tp.tp._matmul, fsdp_tp.tp._heads, fsdp_tp.tp._vocab)
X = jax.random.normal(jax.random.key(1), (8, 6, 8))
Y = jax.random.normal(jax.random.key(2), (8, 6, 8))


# --- the core: a device's block of the global mask -----------------------------------------


@given(
    sizes=st.sampled_from([{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 4}, {"fsdp": 8}]),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    keep=st.sampled_from([0.1, 0.5, 0.9]),
    check_vma=st.booleans(),
    seed=st.integers(0, 2**16),
    x64=st.booleans(),
)
def test_each_device_draws_its_block_of_the_unsharded_mask(sizes, shape, picks, keep, check_vma, seed, x64):
    """Any split of any shape's dims over the mesh axes (each axis on one dim at most, in any
    order): the blocks assembled are ``jax.random.bernoulli(key, keep, global_shape)``, with
    ``jax_enable_x64`` too, where bernoulli draws a float64 uniform from 64 random bits (the
    float32 draw there was another mask: found by fsdp_tp.testing on a float64 model)."""
    axes = list(sizes)
    split: list = [() for _ in shape]
    for axis, pick in zip(axes, picks, strict=False):
        if pick < len(shape):
            split[pick] = (*split[pick], axis)
    names = tuple(s[0] if len(s) == 1 else (s or None) for s in split)
    key = jax.random.key(seed)
    mesh = fsdp_tp.make_mesh(sizes)
    draw = jax.shard_map(
        lambda: keep_mask(key, keep, tuple(shape), names),
        mesh=mesh,
        in_specs=(),
        out_specs=P(*names),
        check_vma=check_vma,
    )
    with jax.enable_x64(x64):
        blocks = jax.jit(draw)()  # one program (eager, shard_map runs op by op: 8x slower here)
        np.testing.assert_array_equal(blocks, jax.random.bernoulli(key, keep, blocks.shape))


@given(sizes=st.lists(st.integers(1, 2**20), min_size=1, max_size=4), data=st.data())
def test_flat_indices_are_exact_past_two_to_the_32(sizes, data):
    """The 64-bit flat index in two 32-bit words, for arrays far beyond 2**32 elements (a
    (512, 2048, 16384) activation has 1.7e10): checked against Python's integers."""
    coords = [data.draw(st.integers(0, n - 1)) for n in sizes]
    high, low = wide_index([jnp.uint32(c) for c in coords], sizes)
    flat = sum(c * math.prod(sizes[i + 1 :]) for i, c in enumerate(coords))
    assert (int(high) << 32) | int(low) == flat


def test_negative_control_a_key_folded_over_the_batch_draws_no_block_of_the_mask():
    """What the docs said to do: fold the key over the batch axes and draw the local shape.
    The tensor ranks then agree on every entry of their different hidden units."""
    mesh = fsdp_tp.make_mesh(MESHES["data x tensor"])

    def folded(key):
        key = fsdp_tp.dropout.fold_rng_over_axis(key, "data")
        return jax.lax.pcast(jax.random.bernoulli(key, 0.5, (4, 16)), "tensor", to="varying")

    blocks = jax.shard_map(folded, mesh=mesh, in_specs=P(), out_specs=P("data", "tensor"))(KEY)
    assert not (blocks == jax.random.bernoulli(KEY, 0.5, blocks.shape)).all()
    quarters = np.split(np.asarray(blocks), 4, axis=1)
    assert all((q == quarters[0]).all() for q in quarters)  # units j, j + H/4, ... drop together


# --- the models: Linen and NNX, dropout in and out of a tensor-parallel region --------------


class LinenDropMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.5, deterministic=False, name="hidden_drop")(nn.gelu(nn.Dense(32, name="up")(x)))
        y = nn.Dropout(0.3, deterministic=False, name="out_drop")(nn.Dense(8, name="down")(h))
        return x + nn.Dropout(0.25, broadcast_dims=(1,), deterministic=False, name="seq_drop")(y)


class NNXDropMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)
        self.hidden_drop = nnx.Dropout(0.5, rngs=rngs)
        self.out_drop = nnx.Dropout(0.3, rngs=rngs)
        self.seq_drop = nnx.Dropout(0.25, broadcast_dims=(1,), rngs=rngs)

    def __call__(self, x, rngs=None):
        h = self.hidden_drop(nnx.gelu(self.up(x)), rngs=rngs)
        y = self.out_drop(self.down(h), rngs=rngs)
        return x + self.seq_drop(y, rngs=rngs)


STORAGE = [("up/kernel", P("fsdp")), ("down/kernel", P(None, "fsdp"))]


def _linen(sizes: dict):
    """``(init(rng) -> (params, rest), forward(params, rest, x, key) per device, and the
    unsharded forward(params, x, key))``."""
    tp = [("up$", fsdp_tp.tp.ColumnParallel()), ("down$", fsdp_tp.tp.RowParallel())]
    model = fsdp_tp.shard_by_rules(LinenDropMLP, STORAGE if "fsdp" in sizes else (), tp_rules=tp)()
    init = lambda rng: (model.init({"params": rng, "dropout": rng}, X[:2])["params"], {})
    forward = lambda params, rest, x, key: model.apply({"params": params}, x, rngs={"dropout": key})
    twin = lambda params, x, key: LinenDropMLP().apply({"params": params}, x, rngs={"dropout": key})
    return init, forward, twin


def _nnx(sizes: dict, call_time: bool):
    tp = [("up$", fsdp_tp.tp.ColumnParallel()), ("down$", fsdp_tp.tp.RowParallel())]
    sharded = fsdp_tp.nnx.shard_by_rules(NNXDropMLP, STORAGE if "fsdp" in sizes else (), tp_rules=tp)
    rngs = (lambda key: nnx.Rngs(dropout=key)) if call_time else (lambda key: None)

    def forward(params, model_state, x, key):
        return sharded.merge(params, model_state)(x, rngs=rngs(key))

    def twin(params, x, key):  # the twin's init, rng keys included, is the sharded init's
        model = NNXDropMLP(nnx.Rngs(jax.random.key(0)))
        nnx.update(model, nnx.State(params))
        return model(x, rngs=rngs(key))

    return sharded.init, forward, twin


def _outputs_and_grads(sizes: dict, api: str, check_vma: bool):
    """The sharded forward and synced gradients of the mean squared error, and the twin's."""
    mesh = fsdp_tp.make_mesh(sizes)
    batch = tuple(a for a in ("data", "fsdp") if a in sizes)
    init, forward, twin = _linen(sizes) if api == "linen" else _nnx(sizes, call_time=api == "nnx call-time")
    (params, rest), (specs, rest_specs) = fsdp_tp.init_sharded(init, mesh, P(), jax.random.key(0))

    def per_device(params, rest, x, y, key):
        loss = lambda p: jnp.mean((forward(p, rest, x, key) - y) ** 2)
        return forward(params, rest, x, key), fsdp_tp.sync_gradients(jax.grad(loss)(params), batch)

    sharded = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, rest_specs, P(batch), P(batch), P()),
            out_specs=(P(batch), specs),
            check_vma=check_vma,
        )
    )
    out, grads = sharded(params, rest, X, Y, KEY)
    whole = jax.tree.map(np.asarray, nn.unbox(params))
    twin_grads = jax.grad(lambda p: jnp.mean((twin(p, X, KEY) - Y) ** 2))(whole)
    return (out, nn.unbox(grads)), (twin(whole, X, KEY), twin_grads)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("api", ["linen", "nnx", "nnx call-time"])
def test_dropout_is_the_unsharded_models_under_fsdp_and_tp(api, mesh, check_vma):
    """The outputs drop exactly the unsharded model's entries, and the outputs and gradients
    equal its."""
    (out, grads), (twin_out, twin_grads) = _outputs_and_grads(MESHES[mesh], api, check_vma)
    np.testing.assert_array_equal(np.asarray(out) == np.asarray(X), np.asarray(twin_out) == np.asarray(X))
    np.testing.assert_allclose(out, twin_out, rtol=RTOL, atol=ATOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), grads, twin_grads)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_negative_control_flax_s_own_dropout_on_blocks_is_not_the_unsharded_models(api, monkeypatch):
    """With the exact draw patched out (flax's Dropout on each device's block, from the key as
    given), the plan check refuses the draw on a split dim (jax.random.bernoulli's body, read at
    its call), and with the check off too the same equality fails: the masks are not the
    unsharded model's."""
    from fsdp_tp.linen import _dropout as linen_dropout
    from fsdp_tp.nnx import _model as nnx_model

    untouched = lambda _, next_fun, args, kwargs, context: next_fun(*args, **kwargs)
    monkeypatch.setattr(linen_dropout, "_intercept", untouched)
    monkeypatch.setattr(nnx_model, "exact_dropouts", lambda *args: None)
    with pytest.raises(RuleError, match=r"hidden_drop .*random numbers the model draws along dim 2"):
        test_dropout_is_the_unsharded_models_under_fsdp_and_tp(api, "data x tensor", check_vma=False)
    with switched_off(), pytest.raises(AssertionError):
        test_dropout_is_the_unsharded_models_under_fsdp_and_tp(api, "data x tensor", check_vma=False)


# --- attention dropout: the unsharded model's mask, drawn inside flax's attention ----------

ATTENTION_KEY = jax.random.key(3)
FSDP_ATTENTION = [(r"(query|key|value)/kernel$", P("fsdp")), (r"out/kernel$", P(None, None, "fsdp"))]
ATTENTION_MESHES = [  # (mesh, storage rules, check_vma)
    ({"data": 2, "tensor": 4}, (), True),
    ({"data": 2, "fsdp": 2, "tensor": 2}, FSDP_ATTENTION, False),
]


def _attention_model(api: str, broadcast: bool, attention_fn=None):
    """Multi-head attention dropping 0.1 of its weights, flax's own module (Linen's with its
    ``make_rng``; NNX's with call-time ``rngs``)."""
    if api == "linen":
        fn = {"attention_fn": attention_fn} if attention_fn else {}

        class LinenDropping(nn.Module):
            @nn.compact
            def __call__(self, x):
                attend = nn.MultiHeadDotProductAttention(
                    4, dropout_rate=0.1, deterministic=False, broadcast_dropout=broadcast, name="attn", **fn
                )
                return attend(x)

        return LinenDropping()
    fn = {"attention_fn": attention_fn} if attention_fn else {}

    class NNXDropping(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(
                4, 8, 8, dropout_rate=0.1, broadcast_dropout=broadcast, deterministic=False,
                decode=False, keep_rngs=False, rngs=rngs, **fn,
            )  # fmt: skip

        def __call__(self, x, rngs=None):
            return self.attn(x, rngs=rngs)

    return lambda rngs: NNXDropping(rngs)


def _check_attention(api: str, mesh, rules, check_vma: bool, broadcast: bool, attention_fn=None) -> None:
    check_sharded(
        _attention_model(api, broadcast, attention_fn), (X, Y), lambda out, y: jnp.mean((out - y) ** 2), mesh,
        rules, tp_rules=[("attn$", fsdp_tp.tp.HeadParallel())], rngs={"dropout": ATTENTION_KEY}, steps=1,
        check_vma=check_vma,
    )  # fmt: skip


@pytest.mark.parametrize("broadcast", [False, True], ids=["per-head mask", "broadcast mask"])
@pytest.mark.parametrize("mesh, rules, check_vma", ATTENTION_MESHES, ids=["data x tensor", "dp x fsdp x tp"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_attention_dropout_is_the_unsharded_models(api, mesh, rules, check_vma, broadcast):
    """flax draws the attention's mask inside its own attention function; the library hands it a
    key whose draws are this device's block of the unsharded draw (the batch rows and, head
    parallel, the heads it holds; or the one broadcast mask), so outputs, gradients and steps
    are the unsharded model's with attention dropout on (fsdp_tp.testing.check_sharded)."""
    _check_attention(api, mesh, rules, check_vma, broadcast)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_negative_control_a_mask_folded_per_block_is_another_models(api, monkeypatch):
    """Each block drawing its own mask (the library's behaviour before: the same distribution),
    caught by the same check."""
    folded = lambda rng, _weights, like, _broadcast, axes, where: fold_over_block(rng, like, axes, where)
    monkeypatch.setattr(fsdp_tp.dropout, "attention_key", folded)
    monkeypatch.setattr(fsdp_tp.linen._dropout, "attention_key", folded)
    with pytest.raises(AssertionError, match=r"^output: "):
        _check_attention(api, *ATTENTION_MESHES[0], broadcast=False)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_an_attention_function_the_library_does_not_own_folds_and_says_so(api):
    """An ``attention_fn`` of the user's draws its mask itself: each block an independent one,
    said once (FoldedDropoutWarning), and the model runs."""
    flax_fn = nn.dot_product_attention if api == "linen" else nnx.dot_product_attention

    # (flax's Linen attention passes the keywords an attention function names)
    def own(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
            dropout_rate=0.0, deterministic=False, **rest):  # fmt: skip
        return flax_fn(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                       deterministic, **rest)  # fmt: skip

    with pytest.warns(
        FoldedDropoutWarning, match=r"attention_fn=.*own is not flax's dot_product_attention"
    ) as caught:
        with pytest.raises(AssertionError, match=r"^output: "):  # (not the unsharded mask)
            _check_attention(api, *ATTENTION_MESHES[0], broadcast=False, attention_fn=own)
    assert {w.filename for w in caught} == {__file__}  # shown at the user's line, not the library's


class SequenceParallelDrop(nn.Module):
    """Dropout on the residual stream between sequence-parallel blocks, where each tensor rank
    holds a slice of the sequence (``axis_name=None``: the unsharded twin)."""

    axis_name: str | None = "tensor"

    @nn.compact
    def __call__(self, x):
        y = fsdp_tp.MLPBlock(32, axis=self.axis_name, sequence_dim=None if self.axis_name is None else 1)(x)
        return x + nn.Dropout(0.5, deterministic=False)(y)


@pytest.mark.parametrize("check_vma", [True, False])
def test_dropout_on_sequence_slices_is_the_unsharded_models(check_vma):
    mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
    x = jax.random.normal(jax.random.key(3), (4, 8, 8))
    model = fsdp_tp.shard_by_rules(SequenceParallelDrop)()
    init = lambda r, x: model.init({"params": r, "dropout": r}, x)["params"]
    params, specs = fsdp_tp.init_sharded(init, mesh, (P(), P("data", "tensor")), jax.random.key(0), x)
    out = jax.jit(
        jax.shard_map(
            lambda p, x: model.apply({"params": p}, x, rngs={"dropout": KEY}),
            mesh=mesh,
            in_specs=(specs, P("data", "tensor")),
            out_specs=P("data", "tensor"),
            check_vma=check_vma,
        )
    )(params, x)
    twin = SequenceParallelDrop(axis_name=None).apply({"params": nn.unbox(params)}, x, rngs={"dropout": KEY})
    np.testing.assert_array_equal(np.asarray(out) == np.asarray(x), np.asarray(twin) == np.asarray(x))
    np.testing.assert_allclose(out, twin, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("check_vma", [True, False])
def test_negative_control_sequence_slices_not_marked(check_vma, monkeypatch):
    """With the layers not saying what they split, the residual stream varies over 'tensor'
    where no dim accounts for it: refused (the init traces the model with checking on, so the
    unchecked step's model is refused there too), where the mask would repeat over ranks."""
    for module in (fsdp_tp.tp.pieces, *ROLE_MODULES):
        monkeypatch.setattr(module, "split_after", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="no dim is known to be split over it"):
        test_dropout_on_sequence_slices_is_the_unsharded_models(check_vma)


class LinenAttentionThenDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, name="attn")(x)
        return nn.Dropout(0.5, deterministic=False)(y)


class NNXAttentionThenDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=4, in_features=8, qkv_features=16, decode=False, rngs=rngs
        )
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.drop(self.attn(x), rngs=rngs)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_dropout_after_sequence_parallel_attention_is_the_unsharded_models(api):
    """A head-parallel attention by tp rules with sequence_dim hands on its output's sequence
    slices (the output projection's reduce-scatter): dropout right after it draws each
    device's slice of the unsharded mask. (Before, the role said its output was whole, and the
    dropout was refused: no dim accounted for the output varying over 'tensor'.)"""
    mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
    x = jax.random.normal(jax.random.key(1), (4, 8, 8))  # 8 positions: 2 on each tensor rank
    if api == "linen":
        rules = [("attn$", fsdp_tp.tp.HeadParallel(sequence_dim=1))]
        model = fsdp_tp.shard_by_rules(LinenAttentionThenDropout, tp_rules=rules, batch_axes=("data",))()
        init = lambda rng: (model.init(rng, x[:2])["params"], {})
        forward = lambda params, rest, x: model.apply({"params": params}, x, rngs={"dropout": KEY})
        twin = LinenAttentionThenDropout()
        ref = twin.apply(twin.init(jax.random.key(0), x), x, rngs={"dropout": KEY})
    else:
        rules = [("attn$", fsdp_tp.tp.HeadParallel(sequence_dim=1))]
        sharded = fsdp_tp.nnx.shard_by_rules(NNXAttentionThenDropout, tp_rules=rules, batch_axes=("data",))
        init = sharded.init
        forward = lambda params, rest, x: sharded.merge(params, rest)(x, rngs=nnx.Rngs(dropout=KEY))
        ref = NNXAttentionThenDropout(nnx.Rngs(0))(x, rngs=nnx.Rngs(dropout=KEY))
    (params, rest), (specs, rest_specs) = fsdp_tp.init_sharded(init, mesh, P(), jax.random.key(0))
    slices = P("data", "tensor")  # (batch, sequence, features): the sequence split over tensor
    out = jax.jit(
        jax.shard_map(
            forward, mesh=mesh, in_specs=(specs, rest_specs, slices), out_specs=slices, check_vma=True
        )
    )(params, rest, x)
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(ref) == 0)
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("api", ["linen", "nnx call-time"])
def test_sgd_steps_with_dropout_are_the_unsharded_models(api):
    """Three SGD steps through shard_step, a new dropout key each step (the step's rng folded
    with the step number): the losses and parameters are the unsharded run's."""
    sizes = MESHES["data x fsdp x tensor"]
    mesh = fsdp_tp.make_mesh(sizes)
    init, forward, twin = _linen(sizes) if api == "linen" else _nnx(sizes, call_time=True)
    tx = optax.sgd(0.1)

    def init_fn(rng):
        params, rest = init(rng)
        return fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=tx, rng=rng, model_state=rest)

    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))

    def step_fn(state, batch):
        x, y = batch
        key = jax.random.fold_in(state.rng, state.step)
        loss = lambda p: jnp.mean((forward(p, state.model_state, x, key) - y) ** 2)
        value, grads = jax.value_and_grad(loss)(state.params)
        synced = fsdp_tp.sync_gradients(grads, ("data", "fsdp")), jax.lax.pmean(value, ("data", "fsdp"))
        # NNX: the model's own rng counts are state; call-time rngs leave them as they were
        return (*synced, state.model_state) if jax.tree.leaves(state.model_state) else synced

    batch = P(("data", "fsdp"))
    step = fsdp_tp.shard_step(step_fn, mesh, specs, (batch, batch))
    whole = jax.tree.map(np.asarray, nn.unbox(state.params))
    losses, twin_losses = [], []
    for i in range(3):
        state, loss = step(state, (X, Y))
        key = jax.random.fold_in(jax.random.key(0), i)
        value, grads = jax.value_and_grad(lambda p, key=key: jnp.mean((twin(p, X, key) - Y) ** 2))(whole)
        whole = jax.tree.map(lambda p, g: p - 0.1 * g, whole, grads)
        losses.append(float(loss))
        twin_losses.append(float(value))
    np.testing.assert_allclose(losses, twin_losses, rtol=RTOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), nn.unbox(state.params), whole
    )


# --- dropout inside attention written as einsums: the unsharded mask, or refused -------------


def _einsum_attention(drop: str, heads: int = 8):
    """q column-parallel (8 heads on tensor 4: 2 a device), the weights and their output
    computed by the model's own einsums, then the row-parallel output; dropout on the
    attention weights or on their output (q's shape, which the roles know)."""

    def attend(q, dropout):
        weights = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, q), axis=-1)
        weights = dropout(weights) if drop == "weights" else weights
        out = jnp.einsum("BNTS,BSNH->BTNH", weights, q)
        return dropout(out) if drop == "output" else out

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            q = nn.Einsum((8, heads, 4), "BTD,DNH->BTNH", use_bias=False, name="q")(x)
            out = attend(q, nn.Dropout(0.5, deterministic=False, name="drop"))
            return nn.Einsum((heads, 4, 8), "BTNH,NHD->BTD", use_bias=False, name="out")(out)

    class NNX(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.Einsum("BTD,DNH->BTNH", (8, heads, 4), rngs=rngs)
            self.out = nnx.Einsum("BTNH,NHD->BTD", (heads, 4, 8), rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, rngs=None):
            return self.out(attend(self.q(x), lambda a: self.drop(a, rngs=rngs)))

    return Linen, NNX


EINSUM_TP = [("q$", fsdp_tp.tp.ColumnParallel()), ("out$", fsdp_tp.tp.RowParallel())]


def _einsum_attention_outputs(api: str, drop: str, check_vma: bool):
    linen, nnx_model = _einsum_attention(drop)
    mesh = fsdp_tp.make_mesh(MESHES["data x tensor"])
    if api == "linen":
        model = fsdp_tp.shard_by_rules(linen, (), batch_axes=("data",), tp_rules=EINSUM_TP)()
        init = lambda rng: (model.init({"params": rng, "dropout": rng}, X[:2])["params"], {})
        forward = lambda p, rest, x: model.apply({"params": p}, x, rngs={"dropout": KEY})
        twin = lambda p: linen().apply({"params": p}, X, rngs={"dropout": KEY})
    else:
        sharded = fsdp_tp.nnx.shard_by_rules(nnx_model, (), batch_axes=("data",), tp_rules=EINSUM_TP)
        init, rngs = sharded.init, lambda: nnx.Rngs(dropout=KEY)
        forward = lambda p, rest, x: sharded.merge(p, rest)(x, rngs=rngs())

        def twin(p):
            model = nnx_model(nnx.Rngs(jax.random.key(0)))
            nnx.update(model, nnx.State(p))
            return model(X, rngs=rngs())

    (params, rest), (specs, rest_specs) = fsdp_tp.init_sharded(init, mesh, P(), jax.random.key(0))
    out = jax.jit(
        jax.shard_map(
            forward,
            mesh=mesh,
            in_specs=(specs, rest_specs, P("data")),
            out_specs=P("data"),
            check_vma=check_vma,
        )
    )(params, rest, X)
    return out, twin(jax.tree.map(np.asarray, nn.unbox(params)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_dropout_in_einsum_attention_is_the_unsharded_models_or_refused(api, check_vma):
    """On the attention's output (q's shape: the split the q projection's role recorded) the
    unsharded model's mask; on the weights the model's einsums computed, whose split dims no
    role knows, refused in both check_vma modes, naming the dropout and the shapes (at Linen's
    init, whose plan check runs the model on init's rows; at NNX's step, on the step's)."""
    out, twin = _einsum_attention_outputs(api, "output", check_vma)
    np.testing.assert_allclose(out, twin, rtol=RTOL, atol=ATOL)
    rows = 2 if api == "linen" else 4
    with pytest.raises(
        ValueError, match=rf"at drop.*: dropout on an activation of local shape \({rows}, 2, 6, 6\) "
    ):
        _einsum_attention_outputs(api, "weights", check_vma)


def test_negative_control_a_split_not_tied_to_its_shape_draws_a_wrong_mask_silently(monkeypatch):
    """With the roles' splits applied to every shape (as before), dropout on the weights runs
    and marks their query dim as split: not the unsharded model's numbers, and no error."""
    split_after = fsdp_tp.dropout.split_after
    for module in ROLE_MODULES:
        monkeypatch.setattr(module, "split_after", lambda dims, *_, **__: split_after(dims))
    out, twin = _einsum_attention_outputs("linen", "weights", check_vma=False)
    assert not np.allclose(out, twin, rtol=RTOL, atol=ATOL)


def test_the_region_places_each_shape_by_its_own_split_and_refuses_the_rest():
    """The core's record: q's and kv's splits stand side by side, each for its own shape; a
    block no split describes (kv heads kept whole on more devices than heads) is refused, as
    is a shape no role recorded; the row's sum clears the region."""
    from fsdp_tp.dropout import activation_split, split_after, splitting, unplaceable_after

    with splitting():
        split_after({-2: "tensor"}, (2, 6, 2, 4), add=True)  # q: (B, T, N/t, H)
        split_after({-3: "tensor"}, (2, 2, 6, 4, 4), add=True)  # kv: (C, B, S, K/t, H)
        unplaceable_after((2, 2, 6, 1, 4))  # kv kept whole, one head a device
        assert activation_split(jnp.zeros((2, 6, 2, 4)), (), "q") == (None, None, "tensor", None)
        assert activation_split(jnp.zeros((2, 2, 6, 4, 4)), (), "kv") == (None, None, "tensor", None, None)
        with pytest.raises(ValueError, match=r"kv: .* a block no split describes \(kv heads kept whole"):
            activation_split(jnp.zeros((2, 2, 6, 1, 4)), (), "kv")
        with pytest.raises(ValueError, match=r"w: .* local shapes \(2, 6, 2, 4\), \(2, 2, 6, 4, 4\), "):
            activation_split(jnp.zeros((2, 2, 6, 6)), (), "w")
        split_after({}, (2, 6, 16))  # the row layer's sum (a ring's says its output's shape)
        assert activation_split(jnp.zeros((2, 2, 6, 6)), (), "w") == (None, None, None, None)

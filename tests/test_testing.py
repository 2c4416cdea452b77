"""Issue 57 point 2: ``fsdp_tp.testing``, the suite's proof in a user's hands.

A user's own attention (the one tests/test_plan_check.py refuses as first written, here as
fixed), proved equal to the unsharded model in a few lines on both APIs, dropout on; over every
mesh the devices form, by the hypothesis strategy. The harness's negative controls (a missing
sync, a per-device optimizer, a wrong rule) each fail naming the leaf; bad input is one line
with the fix. The suite's own equivalence tests run the same harness (tests/equivalence.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._check.driver import switched_off
from fsdp_tp.errors import MeshShapeError
from fsdp_tp.testing import (
    Comparison,
    NNXSharded,
    NNXTwin,
    Reference,
    _harness,
    _programs,
    check_equal,
    check_sharded,
    meshes,
)
from fsdp_tp.tp import ColumnParallel, RowParallel
from tests.equivalence import Case, step_program

D, HEADS = 16, 4
RULES = [(r"^(q|k|v)$", ColumnParallel()), (r"^out$", RowParallel())]
KEY = jax.random.key(7)
DROP = {"dropout": KEY}
MESH = {"data": 2, "tensor": 4}
X = jax.random.normal(jax.random.key(1), (8, 6, D))
BATCH = (X, jnp.zeros((8, 6, D)))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def heads(x, by_count: bool):
    b, s, _ = x.shape
    return x.reshape(b, s, HEADS, -1) if by_count else x.reshape(b, s, -1, D // HEADS)


def attend(q, k, v, drop):
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return drop(out.reshape(*out.shape[:2], -1))


class Attention(nn.Module):
    by_count: bool = False  # True: the reshape people write first, which splits heads wrongly

    @nn.compact
    def __call__(self, x):
        q, k, v = (heads(nn.Dense(D, name=n)(x), self.by_count) for n in ("q", "k", "v"))
        return nn.Dense(D, name="out")(attend(q, k, v, nn.Dropout(0.25, deterministic=False)))


class NNXAttention(nnx.Module):
    def __init__(self, rngs, by_count: bool = False):
        self.by_count = by_count
        self.q, self.k, self.v, self.out = (nnx.Linear(D, D, rngs=rngs) for _ in range(4))
        self.drop = nnx.Dropout(0.25)

    def __call__(self, x, rngs=None):
        q, k, v = (heads(m(x), self.by_count) for m in (self.q, self.k, self.v))
        return self.out(attend(q, k, v, lambda a: self.drop(a, rngs=rngs)))


def _model(api: str, by_count: bool = False):
    return Attention(by_count) if api == "linen" else (lambda rngs: NNXAttention(rngs, by_count))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_users_attention_is_proved_equal_with_dropout_on(api):
    check_sharded(_model(api), BATCH, mse, MESH, tp_rules=RULES, rngs=DROP)


def test_negative_control_a_wrong_rule_fails_naming_the_output():
    """Unchecked, the reshape by head count trains another model: the harness says where."""
    with switched_off(), pytest.raises(AssertionError, match=r"^output: \d+ of \d+ elements out of"):
        check_sharded(_model("linen", by_count=True), BATCH, mse, MESH, tp_rules=RULES, rngs=DROP)


def _nnx_pair(mesh, check_vma: bool = True, init=None) -> Comparison:
    """``init``: the kernels' initializer (default nnx.Linear's)."""
    linear = lambda n, m, rngs: nnx.Linear(n, m, **({"kernel_init": init} if init else {}), rngs=rngs)
    make = lambda rngs: nnx.Sequential(linear(D, 32, rngs), linear(32, D, rngs))
    rules = [(r"kernel$", jax.sharding.PartitionSpec("fsdp"))]
    sharded = NNXSharded(make, rules, batch_axes=("data", "fsdp"))
    loss = lambda model, params, x, y: mse(model.apply({"params": params}, x), y)
    return Comparison(sharded, NNXTwin(make), mesh, ("data", "fsdp"), loss, check_vma=check_vma)


def test_negative_control_a_missing_sync_fails_naming_a_gradient():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    with pytest.raises(AssertionError, match=r"^grads\['layers'\]\[0\]\['bias'\]: \d+ of 32 elements"):
        check_equal(_nnx_pair(mesh), [BATCH], KEY, sync=lambda grads, axes: grads)


@pytest.mark.parametrize(
    ("first", "failure"),
    [(False, r"^clipped params after 2 steps\['layers'\]"), (True, r"^clipped update at step 1\['layers'\]")],
    ids=["applied", "alongside"],
)
def test_negative_control_a_per_device_optimizer_fails_naming_a_parameter(monkeypatch, first, failure):
    """Global-norm clipping computed per device on its shards (tests/equivalence.py's naive step):
    caught in the parameters where its update is the one applied, and in its own update where
    an element-wise SGD (the same on shards) is applied and it runs alongside."""
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    pair = _nnx_pair(mesh, check_vma=False)  # (a per-device update: what check_vma=False lets through)
    case = Case(pair.model, pair.twin, mesh, pair.batch_axes, False, D, D, loss=pair.loss)
    naive = lambda c, specs, *_, reads=None, **__: step_program(case, specs, naive=True, reads=reads)
    monkeypatch.setattr(_harness, "sharded_step", naive)
    clipped = {"clipped": lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))}
    optimizers = {"sgd": lambda: optax.sgd(0.1)} | clipped if first else clipped
    with pytest.raises(AssertionError, match=failure):
        check_equal(pair, [BATCH, BATCH], KEY, optimizers=optimizers)


EVERY_MESH = Reference()  # (one unsharded run for all the meshes below)


@settings(max_examples=4, deadline=None, database=None, derandomize=True)
@given(mesh=meshes(("data", "tensor")).filter(lambda mesh: HEADS % mesh.shape["tensor"] == 0))
def test_every_mesh_the_devices_form(mesh):
    """The three lines a user writes: a strategy of meshes (here those whose tensor axis
    divides the heads: on tensor 8 the check refuses the model, each device half a head), and
    the check, against one unsharded run computed once (a Reference)."""
    check_sharded(_model("linen"), BATCH, mse, mesh, tp_rules=RULES, steps=1, rngs=DROP, reference=EVERY_MESH)
    assert EVERY_MESH.computed == 1


def test_a_reference_s_run_still_fails_a_wrong_model_and_a_key_it_misses_is_refused():
    """A run read from a Reference is compared as a computed one is: a missing sync on another
    mesh still fails naming the gradient. A key that misses what the twin depends on (here one
    key for two models) is refused at the twin's init, the first leaf that differs named."""
    twins = Reference()
    meshes = [fsdp_tp.make_mesh({"data": 2, "fsdp": 4}), fsdp_tp.make_mesh({"data": 4, "fsdp": 2})]
    check_equal(_nnx_pair(meshes[0]), [BATCH], KEY, reference=twins, key="mlp")
    wrong = lambda grads, axes: grads
    with pytest.raises(AssertionError, match=r"^grads\['layers'\]\[0\]\['bias'\]: \d+ of 32 elements"):
        check_equal(_nnx_pair(meshes[1]), [BATCH], KEY, sync=wrong, reference=twins, key="mlp")
    assert (twins.computed, twins.read) == (1, 1)
    other = _nnx_pair(meshes[1], init=nnx.initializers.ones)
    with pytest.raises(AssertionError, match=r"started from other parameters \(the twin's init\['layers'\]"):
        check_equal(other, [BATCH], KEY, reference=twins, key="mlp")
    with pytest.raises(TypeError, match="reference= needs key="):
        check_equal(other, [BATCH], KEY, reference=twins)


def _unseeded(rngs):
    return nnx.Linear(D, D, rngs=nnx.Rngs(int(np.random.randint(1 << 30))))


@pytest.mark.parametrize(
    "model, batch, loss, mesh, error, match",
    [
        (Attention(), (X[:3], BATCH[1][:3]), mse, {"data": 2, "tensor": 4}, ValueError,
         r"inputs have 3 rows .* batch axes \('data',\) .* a multiple of 2 rows"),
        (Attention(), BATCH, lambda out, y: (out - y) ** 2, {"data": 2, "tensor": 4}, ValueError,
         r"returns shape \(8, 6, 16\); .* a scalar \(reduce it"),
        (_unseeded, BATCH, mse, {"data": 8}, ValueError,
         r"built different parameters twice: it draws from an rng"),
        (Attention(), BATCH, mse, {"data": 16}, MeshShapeError, r"16 devices"),
        (NNXAttention(nnx.Rngs(0)), BATCH, mse, {"data": 8}, TypeError,
         r"pass lambda rngs: Model\(\.\.\., rngs=rngs\)"),
    ],
    ids=["batch-not-split", "loss-not-scalar", "unseeded-constructor", "mesh-too-large", "built-nnx-model"],
)  # fmt: skip
def test_bad_input_is_one_line_with_the_fix(model, batch, loss, mesh, error, match):
    linen = isinstance(model, nn.Module)
    with pytest.raises(error, match=match):
        check_sharded(model, batch, loss, mesh, tp_rules=RULES if linen else (), rngs=DROP if linen else None)


class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2 * D, name="head")(x)


class NNXHead(nnx.Module):
    def __init__(self, rngs):
        self.head = nnx.Linear(D, 2 * D, rngs=rngs)

    def __call__(self, x):
        return self.head(x)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_an_output_left_split_is_refused_naming_gather_output(api):
    """A last ColumnParallel leaves the output split over ``tensor`` (logits for a
    vocabulary-parallel loss), which the twin's loss cannot read: one line naming both shapes
    and the fix; with the fix the model is proved equal."""
    model = Head() if api == "linen" else NNXHead
    batch = (X, jnp.zeros((8, 6, 2 * D)))
    said = r"output has shape \(4, 6, 8\) on each device, where .* is \(4, 6, 32\).*gather_output=True\."
    with pytest.raises(ValueError, match=said):
        check_sharded(model, batch, mse, MESH, tp_rules=[("^head$", ColumnParallel())], steps=1)
    check_sharded(model, batch, mse, MESH, tp_rules=[("^head$", ColumnParallel(gather_output=True))], steps=1)


def _dots(loss) -> int:
    """The matmuls in the program that reads a Dense's loss, outputs and gradients."""
    model, x = nn.Dense(D), X[:, 0]
    params = model.init(KEY, x)["params"]
    read = lambda p: _programs.loss_and_outputs(model, loss, p, x, x)
    eqns = jax.make_jaxpr(read)(params).jaxpr.eqns
    return sum(eqn.primitive.name == "dot_general" for eqn in eqns)


def test_the_outputs_are_read_off_the_losss_own_forward():
    """A step program computes the forward once: the outputs the check compares are the loss's
    own ``apply`` on the batch (one matmul forward, one for the kernel's gradient). Negative
    control: a loss that applies the model to something else (here ``2 * x``) leaves the
    outputs to a forward of their own, on the batch itself, one matmul more."""
    own = lambda model, p, x, y: mse(model.apply({"params": p}, x), y)
    other = lambda model, p, x, y: mse(model.apply({"params": p}, 2 * x), y)
    assert (_dots(own), _dots(other)) == (2, 3)
    model, x = nn.Dense(D), X[:, 0]
    params = model.init(KEY, x)["params"]
    (_, out), _ = _programs.loss_and_outputs(model, other, params, x, x)
    np.testing.assert_array_equal(out, model.apply({"params": params}, x))


def test_both_inits_in_one_program_are_each_ones_own_bits():
    """check_equal compiles the sharded init and the twin's in one program (XLA computes what
    they share once): each side's values are bit for bit those of its own program
    (``init_sharded``, ``jax.jit(twin.init)``), and the twin's arrays are on one device with no
    mesh, as its own program gives them (a mesh in them compiled the twin's step again at its
    second step)."""
    pair = _nnx_pair(fsdp_tp.make_mesh({"data": 2, "fsdp": 4}))
    x = BATCH[0][:, 0]
    sharded, twin = _programs.inits(pair, KEY, x)
    init_fn = lambda r, x: pair.model.init(r, x)["params"]
    alone, _ = fsdp_tp.init_sharded(init_fn, pair.mesh, (P(), P(pair.batch_axes)), KEY, x)
    _assert_same(sharded, alone)
    _assert_same(twin, jax.jit(pair.twin.init)(KEY, x)["params"])
    assert {type(leaf.sharding) for leaf in jax.tree.leaves(twin)} == {jax.sharding.SingleDeviceSharding}


def _assert_same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""Issue 13 point 3: collections other than params (BatchNorm's ``batch_stats``) are part of
the train state: sharded init, the step (``mutable=``), checkpoints restored on another mesh;
``batch_mean`` averages such state over the batch axes in both ``check_vma`` modes.

The model is ``tests.plain_models.PlainResNet`` (flax/examples/imagenet style: ``nn.Conv``,
``nn.BatchNorm(axis_name=...)``), FSDP by rules from outside, against its unsharded twin
(``axis_name=None``: statistics over the whole global batch).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._check.driver import switched_off
from fsdp_tp.checkpoint import Checkpoints
from fsdp_tp.errors import RuleError
from fsdp_tp.gradients import batch_mean
from tests.equivalence import ADAM_EPS, assert_trees_close
from tests.plain_models import PlainResNet
from tests.refusals import named_fix

BATCH, SIDE, STEPS = 16, 6, 3


def _rules(axis: str):
    return [
        ("Conv_.*/kernel$", P(None, None, None, axis)),
        ("BatchNorm_.*/(scale|bias)$", P(axis)),
        ("Dense_.*/kernel$", P(axis)),
    ]


def _batches(seed: int = 1):
    for key in jax.random.split(jax.random.key(seed), STEPS):
        kx, ky = jax.random.split(key)
        yield jax.random.normal(kx, (BATCH, SIDE, SIDE, 3)), jax.random.randint(ky, (BATCH,), 0, 8)


def _loss(model, params, model_state, images, labels):
    logits, updated = model.apply({"params": params, **model_state}, images, mutable=list(model_state))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updated


def _twin_run(tx):
    model = PlainResNet(axis_name=None)
    images, _ = next(_batches())
    state = jax.jit(fsdp_tp.state_init_fn(model, tx))(jax.random.key(0), images)

    @jax.jit
    def step(state, images, labels):
        (loss, updated), grads = jax.value_and_grad(
            lambda p: _loss(model, p, state.model_state, images, labels), has_aux=True
        )(state.params)
        return state.apply_gradients(grads=grads, model_state=updated), loss

    losses = []
    for images, labels in _batches():
        state, loss = step(state, images, labels)
        losses.append(loss)
    return state, losses


def _sharded(mesh_axes: dict, batch_axes: tuple, check_vma: bool, tx, fsdp_axis: str, per_device_stats=False):
    """``per_device_stats``: BatchNorm without an axis_name, its state averaged by batch_mean."""
    mesh = fsdp_tp.make_mesh(mesh_axes)
    axis_name = None if per_device_stats else (batch_axes if len(batch_axes) > 1 else batch_axes[0])
    model = fsdp_tp.shard_by_rules(PlainResNet, _rules(fsdp_axis), batch_axes=batch_axes)(axis_name=axis_name)
    images, _ = next(_batches())
    state, specs = fsdp_tp.init_sharded(
        fsdp_tp.state_init_fn(model, tx),
        mesh,
        (P(), P(batch_axes)),
        jax.random.key(0),
        images,
        check_vma=check_vma,
    )

    def step_fn(state, batch):
        images, labels = batch
        (loss, updated), grads = jax.value_and_grad(
            lambda p: _loss(model, p, state.model_state, images, labels), has_aux=True
        )(state.params)
        updated = batch_mean(updated, batch_axes) if per_device_stats else updated
        return fsdp_tp.sync_gradients(grads, batch_axes), jax.lax.pmean(loss, batch_axes), updated

    step = fsdp_tp.shard_step(step_fn, mesh, specs, (P(batch_axes), P(batch_axes)), check_vma=check_vma)
    return mesh, state, specs, step


def _sharded_run(mesh_axes, batch_axes, check_vma, tx, fsdp_axis="fsdp"):
    _, state, specs, step = _sharded(mesh_axes, batch_axes, check_vma, tx, fsdp_axis)
    losses = []
    for batch in _batches():
        state, loss = step(state, batch)
        losses.append(loss)
    return state, specs, losses


@pytest.mark.parametrize(
    "mesh_axes, batch_axes, check_vma, fsdp_axis",
    [
        ({"data": 2, "fsdp": 4}, ("data", "fsdp"), True, "fsdp"),
        ({"data": 2, "fsdp": 4}, ("data", "fsdp"), False, "fsdp"),
        # flax/examples/imagenet hard-codes BatchNorm(axis_name="batch"): name the mesh's one
        # batch axis "batch", and FSDP splits over it too.
        ({"batch": 8}, ("batch",), True, "batch"),
    ],
)
def test_batchnorm_model_trains_like_the_unsharded_run(mesh_axes, batch_axes, check_vma, fsdp_axis):
    """Init, the loss of every step, params, batch_stats and optimizer state after 3 AdamW steps
    equal the unsharded model's, whose BatchNorm sees the whole global batch."""
    tx = optax.adamw(1e-2, eps=ADAM_EPS)
    state, specs, losses = _sharded_run(mesh_axes, batch_axes, check_vma, tx, fsdp_axis)
    twin, twin_losses = _twin_run(tx)
    assert_trees_close(jnp.stack(losses), jnp.stack(twin_losses), "losses")
    assert_trees_close(nn.unbox(state.params), twin.params, "params after 3 steps")
    assert_trees_close(state.model_state, twin.model_state, "batch_stats after 3 steps")
    assert_trees_close(nn.unbox(state.opt_state), twin.opt_state, "optimizer state")
    assert jax.tree.leaves(specs.model_state) == [P()] * len(jax.tree.leaves(twin.model_state))


def test_negative_control_per_device_statistics_differ_from_the_global_batch():
    """A BatchNorm that normalises by its own shard's statistics (no axis_name), its running
    averages then averaged by batch_mean, is not the unsharded model: the whole step's check
    refuses it before the first step, at the BatchNorm's line (its variance reads each device's
    share of the batch's mean, issue 99); the check off, the harness sees it."""
    tx = optax.sgd(0.1)
    _, state, _, step = _sharded(
        {"data": 2, "fsdp": 4}, ("data", "fsdp"), True, tx, "fsdp", per_device_stats=True
    )
    with pytest.raises(
        RuleError, match=r"plain_models.py:\d+ \(PlainResNet.__call__\).*reads the partial sums"
    ) as refused:
        step(state, next(_batches()))
    with switched_off():
        _, loss = step(state, next(_batches()))
    _, twin_losses = _twin_run(tx)
    assert not np.allclose(loss, twin_losses[0], rtol=1e-5, atol=1e-6)
    # The fix it names, the model's BatchNorm(axis_name=batch_axes): the unsharded model's steps
    # (test_batchnorm_model_trains_like_the_unsharded_run, over these axes)
    named_fix(refused, "BatchNorm(axis_name=('data', 'fsdp'))")
    _, state, _, step = _sharded({"data": 2, "fsdp": 4}, ("data", "fsdp"), True, tx, "fsdp")
    _, loss = step(state, next(_batches()))
    np.testing.assert_allclose(loss, twin_losses[0], rtol=1e-5, atol=1e-6)


def _per_data_shard():
    """A value that varies over "data" and is invariant over "fsdp": its data index + 1."""
    return jax.lax.axis_index("data").astype(jnp.float32) + 1.0


@pytest.mark.parametrize("check_vma", [True, False])
def test_batch_mean_averages_varying_leaves_and_keeps_invariant_ones(check_vma):
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})

    def per_device(x):
        # "local" differs per device, "per_data" per data shard only, "shared" nowhere.
        leaves = {"local": x.sum(), "per_data": _per_data_shard(), "shared": jnp.float32(2.5)}
        return batch_mean(leaves, ("data", "fsdp"))

    x = jnp.arange(16.0)
    out = jax.shard_map(
        per_device, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P(), check_vma=check_vma
    )(x)
    assert float(out["local"]) == float(x.reshape(8, 2).sum(axis=1).mean())
    assert float(out["per_data"]) == 1.5  # 1 and 2, each on 4 devices
    assert float(out["shared"]) == 2.5


def test_negative_control_a_plain_pmean_of_an_invariant_leaf_is_refused():
    """The issue's failure, which batch_mean avoids: under check_vma=True a pmean over the
    batch axes of a value already invariant on one of them is refused."""
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    stats = jax.shard_map(
        lambda x: jax.lax.pmean(_per_data_shard(), ("data", "fsdp")),
        mesh=mesh,
        in_specs=P(("data", "fsdp")),
        out_specs=P(),
    )
    with pytest.raises(Exception, match="varying"):
        stats(jnp.arange(16.0))


def test_step_without_model_state_for_a_state_that_holds_it_is_named():
    tx = optax.sgd(0.1)
    mesh, state, specs, _ = _sharded({"data": 2, "fsdp": 4}, ("data", "fsdp"), True, tx, "fsdp")
    step = fsdp_tp.shard_step(
        lambda s, b: (jax.tree.map(jnp.zeros_like, s.params), jnp.float32(0)),
        mesh,
        specs,
        (P(("data", "fsdp")), P(("data", "fsdp"))),
    )
    with pytest.raises(TypeError, match=r"\(grads, metrics, model_state\).*\['batch_stats'\].*batch_mean"):
        step(state, next(_batches()))


def test_model_state_is_checkpointed_and_restored_on_another_mesh(tmp_path):
    tx = optax.adamw(1e-2, eps=ADAM_EPS)
    state, _, _ = _sharded_run({"data": 2, "fsdp": 4}, ("data", "fsdp"), True, tx)
    with Checkpoints(tmp_path / "ckpt") as checkpoints:
        checkpoints.save(STEPS, state)
        checkpoints.wait()
        _, other, _, _ = _sharded({"data": 4, "fsdp": 2}, ("data", "fsdp"), True, tx, "fsdp")
        restored, _ = checkpoints.restore(other)
    assert_trees_close(restored.model_state, state.model_state, "batch_stats", exact=True)
    assert_trees_close(nn.unbox(restored.params), nn.unbox(state.params), "params", exact=True)
    assert restored.params["Conv_0"]["kernel"].value.sharding.spec == P(None, None, None, "fsdp")

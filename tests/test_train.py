"""Gradient accumulation and per-shard rngs (acceptance 6 of the foundation issue)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from tests.conftest import BATCH_AXES
from tests.equivalence import ATOL, RTOL, assert_trees_close
from tests.models import MLP


@pytest.mark.parametrize("check_vma", [True, False])
def test_accumulated_gradient_equals_full_batch_gradient(check_vma):
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    model = MLP((16, 8), True, fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=0))
    reference = MLP((16, 8), True)
    x = jax.random.normal(jax.random.key(1), (64, 12))
    y = jax.random.normal(jax.random.key(2), (64, 8))

    def loss_fn(model):
        return lambda p, batch, rng: (jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2), {})

    params, specs = fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"],
        mesh,
        (P(), P(BATCH_AXES)),
        jax.random.key(0),
        x,
        check_vma=check_vma,
    )

    def grads(params, x, y, microbatches):
        (loss, _), g = fsdp_tp.accumulate_gradients(loss_fn(model), params, (x, y), microbatches)
        return jax.lax.pmean(loss, BATCH_AXES), fsdp_tp.sync_gradients(g, BATCH_AXES)

    run = {
        m: jax.jit(
            jax.shard_map(
                lambda p, x, y, m=m: grads(p, x, y, m),
                mesh=mesh,
                in_specs=(specs, P(BATCH_AXES), P(BATCH_AXES)),
                out_specs=(P(), specs),
                check_vma=check_vma,
            )
        )
        for m in (1, 4)
    }
    loss4, grads4 = run[4](params, x, y)
    loss1, grads1 = run[1](params, x, y)
    assert_trees_close(nn.unbox(grads4), nn.unbox(grads1), "accumulated vs full batch")
    np.testing.assert_allclose(loss4, loss1, rtol=RTOL, atol=ATOL)
    ref_params = reference.init(jax.random.key(0), x)["params"]
    (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn(reference), has_aux=True)(ref_params, (x, y), None)
    assert_trees_close(nn.unbox(grads4), ref_grads, "accumulated vs unsharded")
    np.testing.assert_allclose(loss4, ref_loss, rtol=RTOL, atol=ATOL)


def test_microbatch_rngs_differ_and_aux_is_averaged():
    def loss_fn(w, batch, rng):
        noise = jax.random.uniform(rng, ())
        return (w * batch).mean(), {"noise": noise, "size": jnp.float32(batch.shape[0])}

    (_, aux), _ = fsdp_tp.accumulate_gradients(
        loss_fn, jnp.float32(1.0), jnp.arange(8.0), 4, rng=jax.random.key(0)
    )
    noises = [jax.random.uniform(jax.random.fold_in(jax.random.key(0), i), ()) for i in range(4)]
    assert float(aux["size"]) == 2.0
    np.testing.assert_allclose(aux["noise"], np.mean(noises), rtol=1e-6)
    assert len(set(np.asarray(noises).tolist())) == 4


@pytest.mark.parametrize("check_vma", [True, False])
def test_dropout_masks_differ_over_batch_axes_and_match_over_tensor(check_vma):
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

    def masks(rng):
        rng = fsdp_tp.dropout.fold_rng_over_axis(rng, BATCH_AXES)
        kept = nn.Dropout(0.5).apply({}, jnp.ones((64,)), deterministic=False, rngs={"dropout": rng})
        if check_vma:  # the mask varies over the batch axes only; say it varies over tensor to stack it
            kept = jax.lax.pcast(kept, "tensor", to="varying")
        return kept[None]

    out = jax.shard_map(
        masks, mesh=mesh, in_specs=P(), out_specs=P(("data", "fsdp", "tensor")), check_vma=check_vma
    )(jax.random.key(0))
    out = np.asarray(out).reshape(2, 2, 2, 64)  # data, fsdp, tensor, mask
    np.testing.assert_array_equal(out[:, :, 0], out[:, :, 1])  # same over tensor
    batch_shards = out[:, :, 0].reshape(4, 64)
    assert len({row.tobytes() for row in batch_shards}) == 4  # different over data x fsdp


@pytest.mark.parametrize("donate", [True, "negative_control_not_donated"])
def test_a_donated_state_passed_again_is_refused_in_one_line(donate):
    """Issue 34 point 4: ``step(s, b); step(s, b)`` segfaulted the interpreter (jaxlib 0.10.2)."""
    mesh = fsdp_tp.make_mesh({"data": 8})

    def init_fn(rng):
        params = {"w": jnp.zeros((8,))}
        return fsdp_tp.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(1.0), rng=rng)

    def step_fn(state, x):
        grads = jax.grad(lambda p: ((p["w"] - x) ** 2).mean())(state.params)
        return fsdp_tp.sync_gradients(grads, "data"), ()

    state, specs = fsdp_tp.init_sharded(init_fn, mesh, P(), jax.random.key(0))
    step = fsdp_tp.shard_step(step_fn, mesh, specs, P("data"), donate_state=donate is True)
    new_state, _ = step(state, jnp.ones((8, 8)))
    if donate is True:
        with pytest.raises(ValueError, match=r"^shard_step: the state passed was donated .* pass the state"):
            step(state, jnp.ones((8, 8)))
    else:  # not donated: the old state is still there and steps again
        step(state, jnp.ones((8, 8)))
    step(new_state, jnp.ones((8, 8)))  # the state the call returned is what to pass

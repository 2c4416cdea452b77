"""Train a small MLP with FSDP on 8 simulated CPU devices, next to its unsharded twin.

    python examples/fsdp_mlp.py

Each step prints the sharded loss and the unsharded loss of the same model on
the same global batch; they agree to float rounding, while each device holds
1/8 of every large parameter and of its AdamW state.
"""

from __future__ import annotations

import fsdp_tp

fsdp_tp.simulate_cpu_devices(8)  # before any JAX computation

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

BATCH_AXES = ("data", "fsdp")


class MLP(nn.Module):
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(self.dense(512)(x))
        x = nn.gelu(self.dense(512)(x))
        return self.dense(10)(x)


def make_data(key, n=4096):
    """A learnable task: labels from a fixed random linear map of the inputs."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, 64))
    labels = jnp.argmax(x @ jax.random.normal(kw, (64, 10)), axis=-1)
    return x, labels


def loss_fn(model, params, x, labels):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(steps: int = 30, batch_size: int = 256) -> None:
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    sharded = MLP(dense=fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=2**12))
    reference = MLP()
    tx = optax.adamw(3e-3)
    x_all, y_all = make_data(jax.random.key(0))
    rng = jax.random.key(1)

    def init_fn(rng, x):
        params = sharded.init(rng, x)["params"]
        return fsdp_tp.TrainState.create(apply_fn=sharded.apply, params=params, tx=tx, rng=rng)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(sharded, p, *batch))(state.params)
        return fsdp_tp.sync_gradients(grads, BATCH_AXES), jax.lax.pmean(loss, BATCH_AXES)

    batch_spec = P(BATCH_AXES)
    state, specs = fsdp_tp.init_sharded(init_fn, mesh, (P(), batch_spec), rng, x_all[:batch_size])
    step = fsdp_tp.shard_step(train_step, mesh, specs, (batch_spec, batch_spec))

    ref_params = reference.init(rng, x_all[:batch_size])["params"]
    ref_opt = tx.init(ref_params)

    @jax.jit
    def ref_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(reference, p, x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    per_device = max(fsdp_tp.analysis.state_bytes_per_device((state.params, state.opt_state)).values())
    full = sum(a.nbytes for a in jax.tree.leaves((ref_params, ref_opt)))
    print(
        f"mesh {dict(mesh.shape)}: params + AdamW state {per_device:,} bytes per device (unsharded: {full:,})"
    )
    print(f"{'step':>4}  {'sharded loss':>12}  {'unsharded loss':>14}")
    for i in range(steps):
        lo = (i * batch_size) % len(x_all)
        x, y = x_all[lo : lo + batch_size], y_all[lo : lo + batch_size]
        state, loss = step(state, (x, y))
        ref_params, ref_opt, ref_loss = ref_step(ref_params, ref_opt, x, y)
        if i % 5 == 0 or i == steps - 1:
            print(f"{i:>4}  {float(loss):>12.6f}  {float(ref_loss):>14.6f}")


if __name__ == "__main__":
    main()

"""An MLP whose kernels FSDP splits and whose biases it leaves whole, its state's bytes and
its train step's collectives: what the memory, communication and precision tests read."""

from __future__ import annotations

import flax.linen as nn
import jax
import optax
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives
from fsdp_tp.sharded_init import abstract_init
from tests.conftest import BATCH_AXES
from tests.models import MLP

__all__ = [
    "BIAS_BYTES",
    "FEATURES",
    "IN_DIM",
    "KERNEL_BYTES",
    "MIN_SIZE",
    "init_fsdp_mlp",
    "step_collectives",
]

# in 32 -> 64 -> 64 -> 16: every kernel (>= 1024 elements) is sharded, every bias (<= 64) is not.
FEATURES, IN_DIM, MIN_SIZE = (64, 64, 16), 32, 100
KERNEL_BYTES = 4 * (32 * 64 + 64 * 64 + 64 * 16)
BIAS_BYTES = 4 * (64 + 64 + 16)


def init_fsdp_mlp(mesh, tx, check_vma=True, mixed_precision=None, init=fsdp_tp.init_sharded):
    """The MLP, its train state and specs (``init``: ``abstract_init`` for the state's shapes
    alone, all a lowered step needs), and its batch."""
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", MIN_SIZE, mixed_precision=mixed_precision)
    model = MLP(FEATURES, True, dense)

    def init_fn(rng, x):
        params = model.init(rng, x)["params"]
        return fsdp_tp.TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=rng)

    x = jax.numpy.ones((16, IN_DIM))
    state, specs = init(init_fn, mesh, (P(), P(BATCH_AXES)), jax.random.key(0), x, check_vma=check_vma)
    return model, state, specs, x


def step_collectives(shape, check_vma: bool, mixed_precision=None, lowered: bool = False):
    """The collectives of the FSDP step, compiled or (``lowered``) as the program asks for them:
    XLA's CPU backend upcasts bf16 collectives to f32 when it compiles (GPU and TPU run them in
    bf16), so only the lowered program shows a mixed-precision policy's bytes."""
    mesh = fsdp_tp.make_mesh({"data": shape[0], "fsdp": shape[1]})
    model, state, specs, x = init_fsdp_mlp(mesh, optax.sgd(0.1), check_vma, mixed_precision, abstract_init)

    def train_step(state, batch):
        grads = jax.grad(lambda p: (model.apply({"params": p}, batch) ** 2).mean())(state.params)
        return fsdp_tp.sync_gradients(grads, BATCH_AXES), ()

    step = fsdp_tp.shard_step(train_step, mesh, specs, P(BATCH_AXES), check_vma=check_vma)
    program = step.lower(state, x)
    return parse_collectives(program.as_text(dialect="hlo") if lowered else program.compile().as_text())

"""Issue 46 point 5: the mistakes an NNX user makes when moving over end in one error that names
the NNX-native fix, not a traceback from inside flax or jax (each was one: an AttributeError,
a dtype TypeError, a KeyError 'BatchStat', "rule 'u' is not a pair", a LoRA layer accepted by
a column rule that failed at the first step)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx
from fsdp_tp.errors import RuleError

RULES = [("kernel", P("fsdp"))]


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.down(nnx.relu(self.up(x))))


class LoRANet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.LoRALinear(8, 16, lora_rank=2, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


MESH = {"data": 2, "fsdp": 4}


def _state():
    sharded = fsdp_tp.nnx.shard_by_rules(Net, RULES)
    state, specs = fsdp_tp.init_sharded(
        sharded.state_init_fn(optax.sgd(0.1)), fsdp_tp.make_mesh(MESH), P(), jax.random.key(0)
    )
    return sharded, state, specs


def _merged_without_model_state():
    sharded, state, specs = _state()
    forward = lambda p: sharded.merge(p)(jnp.ones((2, 8)))
    jax.jit(jax.shard_map(forward, mesh=fsdp_tp.make_mesh(MESH), in_specs=(specs.params,), out_specs=P()))(
        state.params
    )


def _merged_outside_the_step():
    sharded, state, _ = _state()
    sharded.merge(state.params, state.model_state)


def _lora_column():
    fsdp_tp.nnx.shard_by_rules(
        LoRANet, tp_rules=[("up$", fsdp_tp.tp.ColumnParallel()), ("down$", fsdp_tp.tp.RowParallel())]
    )


MISTAKES = {
    "an nnx.Optimizer as tx": (
        lambda: fsdp_tp.nnx.shard_by_rules(Net, RULES).state_init_fn(
            nnx.Optimizer(Net(nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
        ),
        TypeError,
        r"got an nnx\.Optimizer; pass the optax transformation it wraps \(optimizer\.tx",
    ),
    "a built model": (
        lambda: fsdp_tp.nnx.shard_by_rules(Net(nnx.Rngs(0)), RULES),
        TypeError,
        r"got a built Net; pass its constructor, e\.g\. lambda rngs: Net\(\.\.\., rngs=rngs\)",
    ),
    "a Linen class": (
        lambda: fsdp_tp.nnx.shard_by_rules(nn.Dense, RULES),
        TypeError,
        r"got the Linen module Dense; .* use fsdp_tp\.shard_by_rules\(Dense, rules\)",
    ),
    "a constructor that returns no model": (
        lambda: fsdp_tp.nnx.shard_by_rules(lambda rngs: 3, RULES),
        TypeError,
        r"make_model\(nnx\.Rngs\(\.\.\.\)\) returned a int, not an nnx\.Module",
    ),
    "merge without the model's state": (
        _merged_without_model_state,
        ValueError,
        r"the model holds BatchStat Variables, and model_state has none; pass the state's",
    ),
    "merge outside the step": (
        _merged_outside_the_step,
        ValueError,
        r"merge: called outside jax\.shard_map; .* nnx\.update\(model",
    ),
    "tp_rules as a string": (
        lambda: fsdp_tp.nnx.shard_by_rules(Net, tp_rules="up$"),
        RuleError,
        r"tp_rules='up\$' is a string; give a list of \(pattern, role\) pairs, e\.g\. tp_rules=\[\('up\$'",
    ),
    "tp_rules as one pair": (
        lambda: fsdp_tp.nnx.shard_by_rules(Net, tp_rules=("up$", fsdp_tp.tp.ColumnParallel())),
        RuleError,
        r"is one pair; give a list of \(pattern, role\) pairs, e\.g\. tp_rules=\[\('up\$', ColumnParallel",
    ),
    "a LoRA layer under a column rule": (
        _lora_column,
        RuleError,
        r"matches up, a LoRALinear that also computes with lora/lora_a, lora/lora_b, which ColumnParallel",
    ),
    "a Linen tx that is no transformation": (
        lambda: fsdp_tp.state_init_fn(nn.Dense(3), "adamw"),
        TypeError,
        r"state_init_fn: tx must be an optax transformation .* got str",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_migration_mistake_is_named_with_the_nnx_native_fix(mistake):
    call, error, words = MISTAKES[mistake]
    with pytest.raises(error, match=words):
        call()


def test_negative_control_the_right_calls_run():
    """What each message tells the user to write instead does run."""
    sharded, state, specs = _state()
    mesh = fsdp_tp.make_mesh(MESH)
    forward = lambda p, r: sharded.merge(p, r)(jnp.ones((8, 8)))
    out = jax.shard_map(
        forward, mesh=mesh, in_specs=(specs.params, specs.model_state), out_specs=P(("data", "fsdp"))
    )(state.params, state.model_state)
    assert out.shape == (64, 8)
    fsdp_tp.nnx.shard_by_rules(LoRANet, RULES)  # the LoRA layer left to storage rules

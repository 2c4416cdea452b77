"""docs/design.md invariants 7 (minimal communication) and 8 (exact memory) for FSDP."""

from __future__ import annotations

import flax.linen as nn
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import (
    array_bytes,
    collective_summary,
    ideal_bytes_per_device,
    parse_collectives,
    state_bytes_per_device,
)
from fsdp_tp.bench.lm_step import lowered_lm_step
from fsdp_tp.nnx import _read
from fsdp_tp.testing import NNXSharded as Sharded
from tests.conftest import BATCH_AXES, total
from tests.fsdp_mlp import BIAS_BYTES, FEATURES, IN_DIM, KERNEL_BYTES, init_fsdp_mlp, step_collectives
from tests.models import MLP, TiedLM
from tests.nnx_models import NNXTiedLM


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2)])
def test_params_and_adamw_state_bytes_are_exactly_the_ideal(shape):
    mesh = fsdp_tp.make_mesh({"data": shape[0], "fsdp": shape[1]})
    _, state, _, _ = init_fsdp_mlp(mesh, optax.adamw(1e-3))
    tree = (state.params, state.opt_state)
    per_device = state_bytes_per_device(tree)
    # params, mu and nu: kernels split over fsdp, biases whole; plus AdamW's int32 count.
    expected = 3 * (KERNEL_BYTES // shape[1] + BIAS_BYTES) + 4
    assert set(per_device.values()) == {expected}, per_device
    assert len(per_device) == 8
    assert ideal_bytes_per_device(tree) == expected


def test_negative_control_memory_check_sees_replication():
    """Unsharded params on the same mesh hold 8x the kernel bytes: the check must notice."""
    mesh = fsdp_tp.make_mesh({"data": 1, "fsdp": 8})
    _, state, _, _ = init_fsdp_mlp(mesh, optax.adamw(1e-3))
    replicated = jax.device_put(nn.unbox(state.params), jax.NamedSharding(mesh, P()))
    assert max(state_bytes_per_device(replicated).values()) == KERNEL_BYTES + BIAS_BYTES
    assert KERNEL_BYTES + BIAS_BYTES != KERNEL_BYTES // 8 + BIAS_BYTES


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
def test_fsdp_step_moves_exactly_the_minimum(shape, check_vma):
    n_data, n_fsdp = shape
    n = n_data * n_fsdp
    found = step_collectives(shape, check_vma)
    assert {c.kind for c in found} == {"all-gather", "reduce-scatter", "all-reduce"}
    # One all-gather per sharded param (forward only: no remat) and one reduce-scatter per grad.
    assert total(found, "all-gather", "operands") == total(found, "reduce-scatter", "operands") == 3
    assert total(found, "all-gather") == KERNEL_BYTES // n_fsdp
    assert total(found, "reduce-scatter") == KERNEL_BYTES
    # All-reduces: replicated (bias) grads over all devices, and the kernel
    # shards over `data` (a group of one on 1 x 8); never a full sharded gradient.
    assert all(
        c.operand_bytes <= max(BIAS_BYTES, KERNEL_BYTES // n_fsdp) for c in found if c.kind == "all-reduce"
    )
    assert total(found, "all-reduce", min_group=2) == BIAS_BYTES + (
        KERNEL_BYTES // n_fsdp if n_data > 1 else 0
    )
    wire = sum(entry["wire_bytes"] for entry in collective_summary(found).values())
    expected = (
        2 * (n_fsdp - 1) / n_fsdp * KERNEL_BYTES
        + 2 * (n_data - 1) / n_data * KERNEL_BYTES / n_fsdp
        + 2 * (n - 1) / n * BIAS_BYTES
    )
    assert wire == pytest.approx(expected, rel=1e-12)
    if n_data == 1:  # docs/design.md: W_min = 2(N-1)/N (S_p + R)
        assert wire == pytest.approx(2 * (n - 1) / n * (KERNEL_BYTES + BIAS_BYTES), rel=1e-12)


def test_negative_control_full_gradient_all_reduce_is_caught():
    """Plain data parallelism (pmean of whole gradients) must fail the same byte check."""
    mesh = fsdp_tp.make_mesh({"data": 1, "fsdp": 8})
    model = MLP(FEATURES, True)
    x = jax.numpy.ones((16, IN_DIM))

    def step(params, x):
        grads = jax.grad(lambda p: (model.apply({"params": p}, x) ** 2).mean())(params)
        return jax.lax.pmean(grads, BATCH_AXES)

    params = model.init(jax.random.key(0), x)["params"]
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(BATCH_AXES)), out_specs=P(), check_vma=False))
    found = parse_collectives(f.lower(params, x).compile().as_text())
    all_reduced = sum(c.operand_bytes * c.executions for c in found if c.kind == "all-reduce")
    assert all_reduced == KERNEL_BYTES + BIAS_BYTES != BIAS_BYTES


TIED_RULES = [("embedding$", P("fsdp")), ("up/kernel$", P("fsdp")), ("down/kernel$", P(None, None, "fsdp"))]


def _tied_step_collectives(api: str):
    mesh, tokens = fsdp_tp.make_mesh({"fsdp": 8}), jax.numpy.zeros((8, 8), jax.numpy.int32)
    if api == "nnx":
        model = Sharded(NNXTiedLM, TIED_RULES, batch_axes=("fsdp",))
    else:
        model = fsdp_tp.shard_by_rules(TiedLM, TIED_RULES, batch_axes=("fsdp",))()
    lowered, state, _ = lowered_lm_step(model, mesh, ("fsdp",), tokens)
    split = [leaf for leaf in jax.tree.leaves(state.params) if "fsdp" in leaf.sharding.spec]
    return parse_collectives(lowered.compile().as_text()), split


def _scattered(found) -> tuple[int, int]:
    """Reduce-scatter operands and the bytes they reduce (each operand a whole gradient)."""
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    return sum(c.operands * c.executions for c in scatters), sum(
        c.operand_bytes * c.executions for c in scatters
    )


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_parameter_read_twice_is_reduce_scattered_once(api):
    """A tied embedding (read by the lookup and by the logits) is gathered once per step and its
    gradient reduce-scattered once: one reduce-scatter per FSDP-split parameter, each moving
    that parameter's gradient (W_min), on both front ends."""
    found, split = _tied_step_collectives(api)
    assert _scattered(found) == (len(split), sum(array_bytes(leaf) for leaf in split))
    gathers = [c for c in found if c.kind == "all-gather"]
    assert sum(c.operand_bytes * c.group_size * c.executions for c in gathers) == sum(
        array_bytes(leaf) for leaf in split
    )


def test_negative_control_a_gather_per_read_reduce_scatters_the_tied_embedding_twice(monkeypatch):
    """NNX before its read was cached: each read gathered, so the tied embedding's gradient was
    reduce-scattered twice (once per read), which the test above must catch."""
    monkeypatch.setattr(
        _read, "read_once", lambda variable, block: variable.get_metadata(_read._PLAN).read(block)
    )
    found, split = _tied_step_collectives("nnx")
    embedding = array_bytes(next(leaf for leaf in split if leaf.ndim == 2))
    assert _scattered(found) == (len(split) + 1, sum(array_bytes(leaf) for leaf in split) + embedding)

"""Vocab-parallel embedding and cross-entropy against nn.Embed and optax."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives
from tests.conftest import BATCH_AXES, mesh_of
from tests.equivalence import ATOL, RTOL, assert_trees_close


@given(
    tensor=st.sampled_from([1, 2, 4, 8]),
    vocab_mult=st.integers(1, 4),
    tokens=st.integers(1, 6),
    check_vma=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_and_its_gradient_equal_optax(tensor, vocab_mult, tokens, check_vma, seed):
    mesh = mesh_of(1, 1, tensor)
    vocab = 8 * vocab_mult
    kl, kt = jax.random.split(jax.random.key(seed))
    logits = 3 * jax.random.normal(kl, (2, tokens, vocab))
    labels = jax.random.randint(kt, (2, tokens), 0, vocab)
    weights = jnp.arange(2 * tokens, dtype=jnp.float32).reshape(2, tokens)  # a non-uniform cotangent

    def loss(logits, labels):
        return (fsdp_tp.vocab_parallel_cross_entropy(logits, labels, "tensor") * weights).sum()

    f = jax.shard_map(
        jax.value_and_grad(loss),
        mesh=mesh,
        in_specs=(P(None, None, "tensor"), P()),
        out_specs=(P(), P(None, None, "tensor")),
        check_vma=check_vma,
    )
    value, grad = jax.jit(f)(logits, labels)  # one program (op by op compiles every op)
    ref = lambda lg: (optax.softmax_cross_entropy_with_integer_labels(lg, labels) * weights).sum()
    ref_value, ref_grad = jax.jit(jax.value_and_grad(ref))(logits)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)


def _whole_logits_loss(tensor: int, check_vma: bool):
    """The cross-entropy and its gradient of logits whole on every device of ``tensor``."""
    weights = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    loss = lambda lg, lb: (fsdp_tp.vocab_parallel_cross_entropy(lg, lb, "tensor") * weights).sum()
    f = jax.shard_map(jax.value_and_grad(loss), mesh=mesh_of(1, 1, tensor), in_specs=(P(), P()),
                      out_specs=(P(), P()), check_vma=check_vma)  # fmt: skip
    ref = lambda lg, lb: (optax.softmax_cross_entropy_with_integer_labels(lg, lb) * weights).sum()
    return jax.jit(f), jax.jit(jax.value_and_grad(ref))


def test_whole_logits_are_one_devices_slice_on_one_device_and_refused_on_more():
    """A whole head's logits (a layout without tensor parallelism) on a tensor axis of one device
    are that device's slice: the loss and gradient are optax's, under JAX's checking too (whose
    custom rule once failed on the type). On 4 devices they would count the vocabulary 4 times:
    refused with the shape, axis and fix where checking can tell."""
    logits = 3 * jax.random.normal(jax.random.key(1), (2, 3, 16))
    labels = jnp.array([[1, 15, 3], [0, 7, 8]])
    for check_vma in (True, False):
        sharded, ref = _whole_logits_loss(1, check_vma)
        assert_trees_close(sharded(logits, labels), ref(logits, labels), f"check_vma={check_vma}")
    sharded, ref = _whole_logits_loss(4, True)
    said = r"logits of shape \(2, 3, 16\) are the same on every device of mesh axis 'tensor' \(size 4\).*Pass"
    with pytest.raises(fsdp_tp.errors.SpecError, match=said):
        sharded(logits, labels)
    # Negative control: unchecked, the same logits give another loss (log 4 too much a token).
    sharded, _ = _whole_logits_loss(4, False)
    value, want = sharded(logits, labels)[0], ref(logits, labels)[0]
    np.testing.assert_allclose(value - want, np.log(4) * 15, rtol=1e-5)


def test_cross_entropy_moves_per_token_scalars_only():
    mesh = mesh_of(1, 1, 8)
    logits, labels = jnp.ones((4, 16, 1024)), jnp.zeros((4, 16), jnp.int32)
    loss = lambda lg, lb: fsdp_tp.vocab_parallel_cross_entropy(lg, lb).sum()
    f = jax.jit(
        jax.shard_map(
            jax.value_and_grad(loss),
            mesh=mesh,
            in_specs=(P(None, None, "tensor"), P()),
            out_specs=(P(), P(None, None, "tensor")),
        )
    )
    found = parse_collectives(f.lower(logits, labels).compile().as_text())
    # max, sum of exps and target logit: one f32 per token each (XLA may fuse them into a
    # tuple all-reduce); the 4 * 16 * 1024 logits never move.
    assert {c.kind for c in found} == {"all-reduce"}
    assert sum(c.operands for c in found) == 3
    assert sum(c.operand_bytes for c in found) == 3 * 4 * 16 * 4


class TinyLM(nn.Module):
    """Embedding -> dense -> vocab logits, vocab-parallel when axis_name is set."""

    vocab: int
    width: int
    axis_name: str | None = "tensor"

    @nn.compact
    def __call__(self, ids):
        if self.axis_name is None:
            h = nn.Embed(self.vocab, self.width, name="embed")(ids)
            return nn.Dense(self.vocab, name="head")(nn.tanh(h))
        h = fsdp_tp.VocabParallelEmbed(self.vocab, self.width, axis=self.axis_name, name="embed")(ids)
        return fsdp_tp.ColumnParallelDense(self.vocab, axis=self.axis_name, name="head")(nn.tanh(h))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mesh", [(1, 1, 4), (2, 2, 2), (1, 1, 8)])
def test_tiny_vocab_parallel_lm_equals_unsharded(mesh, check_vma):
    mesh = mesh_of(*mesh)
    model, reference = TinyLM(32, 12), TinyLM(32, 12, axis_name=None)
    ids = jax.random.randint(jax.random.key(3), (8, 6), 0, 32)
    labels = jnp.roll(ids, -1, axis=1)
    params, specs = fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"],
        mesh,
        (P(), P(BATCH_AXES)),
        jax.random.key(0),
        ids,
        check_vma=check_vma,
    )
    ref_params = jax.jit(reference.init)(jax.random.key(0), ids)["params"]  # compiled, like the sharded init
    assert_trees_close(nn.unbox(params), ref_params, "init", exact=True)

    def loss_and_grads(params, ids, labels):
        def loss(p):
            return fsdp_tp.vocab_parallel_cross_entropy(model.apply({"params": p}, ids), labels).mean()

        value, grads = jax.value_and_grad(loss)(params)
        return jax.lax.pmean(value, BATCH_AXES), fsdp_tp.sync_gradients(grads, BATCH_AXES)

    f = jax.jit(
        jax.shard_map(
            loss_and_grads,
            mesh=mesh,
            in_specs=(specs, P(BATCH_AXES), P(BATCH_AXES)),
            out_specs=(P(), specs),
            check_vma=check_vma,
        )
    )
    value, grads = f(params, ids, labels)

    def ref_loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(
            reference.apply({"params": p}, ids), labels
        ).mean()

    ref_value, ref_grads = jax.value_and_grad(ref_loss)(ref_params)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL, atol=ATOL)
    assert_trees_close(nn.unbox(grads), ref_grads, "grads")


def test_an_indivisible_sequence_is_named_with_the_embedding():
    """The role checks the sequence it reduce-scatters, for the Linen layer (which computes
    through it) as for any embedding a rule gives it: the error names the table."""
    embed = fsdp_tp.VocabParallelEmbed(16, 4, sequence_dim=1)
    lookup = jax.shard_map(
        lambda ids: embed.init(jax.random.key(0), ids),
        mesh=mesh_of(1, 1, 4),
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(
        fsdp_tp.errors.IndivisibleShapeError,
        match=r"VocabParallelEmbed/embedding: the sequence \(dim 1, split in sequence-parallel mode\) "
        r"\(size 6\) is not divisible by mesh axis 'tensor' \(size 4\)",
    ):
        jax.eval_shape(lookup, jnp.zeros((2, 6), jnp.int32))
    jax.eval_shape(lookup, jnp.zeros((2, 8), jnp.int32))  # a sequence of 8: split 4 ways

"""Tensor-parallel layers and blocks against their unsharded twins (issue 3)."""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives, state_bytes_per_device
from fsdp_tp.errors import IndivisibleShapeError
from fsdp_tp.sharded_init import abstract_init
from tests.conftest import BATCH_AXES, mesh_of
from tests.equivalence import Case, check_equivalence
from tests.models import DenseThen, SequenceParallelAround

MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 4, 2)]
RING_MODES = [None, "unidirectional", "bidirectional"]  # plain collectives, then the two async modes
replicated_ok = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")


class ColumnThenGather(nn.Module):
    """A column-parallel layer whose output is gathered, then an ordinary loss-side layer."""

    features: int
    axis_name: str | None = "tensor"

    @nn.compact
    def __call__(self, x):
        if self.axis_name is None:
            return nn.Dense(self.features, name="col")(x)
        return fsdp_tp.ColumnParallelDense(
            self.features, axis=self.axis_name, gather_output=True, name="col"
        )(x)


@replicated_ok
@given(
    mesh=st.sampled_from(MESHES),
    check_vma=st.booleans(),
    fsdp=st.booleans(),
    use_bias=st.booleans(),
    hidden_mult=st.integers(1, 3),
    in_dim=st.sampled_from([4, 6, 8]),
    ring=st.sampled_from(RING_MODES),
    seed=st.integers(0, 2**16),
)
def test_mlp_block_equals_unsharded(mesh, check_vma, fsdp, use_bias, hidden_mult, in_dim, ring, seed):
    hidden = 8 * hidden_mult  # divisible by every tensor size drawn
    block = fsdp_tp.MLPBlock
    if fsdp:
        block = fsdp_tp.shard_module_params(fsdp_tp.MLPBlock, "fsdp", min_weight_size=0)
    model = block(hidden, out_features=4, use_bias=use_bias, collective_matmul=ring)
    reference = fsdp_tp.MLPBlock(hidden, out_features=4, use_bias=use_bias, axis=None)
    check_equivalence(
        Case(model, reference, mesh_of(*mesh), BATCH_AXES, check_vma, in_dim=in_dim, out_dim=4, seed=seed)
    )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mesh", [(1, 1, 8), (2, 1, 4)])
def test_gathered_column_output_equals_dense(mesh, check_vma):
    case = Case(
        ColumnThenGather(16),
        ColumnThenGather(16, axis_name=None),
        mesh_of(*mesh),
        BATCH_AXES,
        check_vma,
        in_dim=6,
        out_dim=16,
    )
    check_equivalence(case)


@pytest.mark.parametrize("check_vma", [True, False])
def test_negative_control_plain_psum_in_unchecked_mode_is_caught(check_vma, monkeypatch):
    """A row layer that psums with JAX's own transpose: right when checked, T times too large when not."""
    from fsdp_tp.tp import pieces as tp  # Megatron's g lives once: every row layer and role uses it

    monkeypatch.setattr(tp, "reduce_from_axis", lambda x, axis_name: jax.lax.psum(x, axis_name))
    case = Case(
        fsdp_tp.MLPBlock(16, 4),
        fsdp_tp.MLPBlock(16, 4, axis=None),
        mesh_of(1, 1, 4),
        BATCH_AXES,
        check_vma,
        in_dim=6,
        out_dim=4,
    )
    if check_vma:
        check_equivalence(case)
    else:
        with pytest.raises(AssertionError, match="grads"):
            check_equivalence(case)


def test_unsharded_dense_params_load_into_parallel_layers():
    mesh = mesh_of(1, 1, 4)
    x = jax.random.normal(jax.random.key(1), (8, 6))
    plain = fsdp_tp.MLPBlock(16, 4, axis=None)
    params = plain.init(jax.random.key(7), x)["params"]
    _, specs = abstract_init(
        lambda r, x: fsdp_tp.MLPBlock(16, 4).init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), x
    )
    run = jax.shard_map(
        lambda p, x: fsdp_tp.MLPBlock(16, 4).apply({"params": p}, x),
        mesh=mesh,
        in_specs=(specs, P()),
        out_specs=P(),
    )
    boxed = jax.tree.map(
        lambda v, s: nn.Partitioned(v, tuple(s)) if any(s) else v,
        params,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    got = run(boxed, x)
    assert jnp.allclose(got, plain.apply({"params": params}, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_mlp_block_moves_the_megatron_minimum(check_vma):
    """Forward + backward (input gradient included): one all-reduce each way, of activation size."""
    mesh = mesh_of(1, 1, 8)
    block = fsdp_tp.MLPBlock(64, out_features=32)
    x = jnp.ones((16, 32))
    params, specs = abstract_init(
        lambda r, x: block.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), x, check_vma=check_vma
    )

    def fwd_bwd(params, x):
        return jax.grad(lambda p, x: (block.apply({"params": p}, x) ** 2).sum(), argnums=(0, 1))(params, x)

    f = jax.jit(
        jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()), check_vma=check_vma)
    )
    found = [c for c in parse_collectives(f.lower(params, x).compile().as_text()) if c.group_size > 1]
    assert [c.kind for c in found] == ["all-reduce", "all-reduce"]
    assert [c.operand_bytes for c in found] == [16 * 32 * 4, 16 * 32 * 4]  # (batch, out) fwd, (batch, in) bwd


def test_tp_and_fsdp_state_bytes_are_exactly_the_ideal():
    mesh = mesh_of(2, 2, 2)
    block = fsdp_tp.shard_module_params(fsdp_tp.MLPBlock, "fsdp", min_weight_size=0)(32, out_features=16)
    tx = optax.adamw(1e-3)

    def init_fn(rng, x):
        return fsdp_tp.TrainState.create(
            apply_fn=block.apply, params=block.init(rng, x)["params"], tx=tx, rng=rng
        )

    state, specs = fsdp_tp.init_sharded(
        init_fn, mesh, (P(), P(BATCH_AXES)), jax.random.key(0), jnp.ones((8, 16))
    )
    assert specs.params["wi"]["kernel"] == P("fsdp", "tensor") and specs.params["wo"]["kernel"] == P(
        "tensor", "fsdp"
    )
    assert specs.params["wi"]["bias"] == P(("tensor", "fsdp")) and specs.params["wo"]["bias"] == P("fsdp")
    # wi: kernel 16x32 /4, bias 32 /4 (its one dim: tensor's blocks, each over fsdp);
    # wo: kernel 32x16 /4, bias 16 /2 (over fsdp).
    per_param = 4 * (16 * 32 // 4 + 32 // 4 + 32 * 16 // 4 + 16 // 2)
    assert set(state_bytes_per_device((state.params, state.opt_state)).values()) == {3 * per_param + 4}


def test_features_not_divisible_by_the_axis():
    mesh = mesh_of(1, 1, 4)
    init = jax.shard_map(
        lambda x: fsdp_tp.MLPBlock(10).init(jax.random.key(0), x),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(IndivisibleShapeError, match=r"wi/kernel: dim 1 \(size 10\) .* 'tensor' \(size 4\)"):
        jax.eval_shape(init, jnp.ones((2, 8)))


@st.composite
def attention_cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    tensor = mesh[2]
    heads = tensor * draw(st.integers(1, 2))
    # kv heads: a divisor of heads that divides or is divided by the axis size (smaller than it included)
    kv = draw(
        st.sampled_from(
            [g for g in range(1, heads + 1) if heads % g == 0 and (g % tensor == 0 or tensor % g == 0)]
        )
    )
    use_bias = draw(st.booleans())
    ring = draw(st.sampled_from(RING_MODES))
    kw = dict(num_heads=heads, head_dim=4, num_kv_heads=kv, use_bias=use_bias)
    cls = fsdp_tp.AttentionBlock
    if draw(st.booleans()):
        cls = fsdp_tp.shard_module_params(fsdp_tp.AttentionBlock, "fsdp", min_weight_size=0)
    model = cls(**kw, collective_matmul=ring)
    return Case(
        model,
        fsdp_tp.AttentionBlock(**kw, axis=None),
        mesh_of(*mesh),
        BATCH_AXES,
        draw(st.booleans()),
        in_dim=8,
        out_dim=8,
        seq_len=5 if ring is None else 2 * tensor,  # the ring splits the sequence over the axis
        batch_size=8,
        seed=draw(st.integers(0, 2**16)),
    )


@replicated_ok
@given(attention_cases())
def test_attention_block_equals_unsharded(case):
    check_equivalence(case)


@replicated_ok
@pytest.mark.parametrize("check_vma", [True, False])
def test_gqa_with_fewer_kv_heads_than_devices(check_vma):
    kw = dict(num_heads=8, head_dim=4, num_kv_heads=2, use_bias=True)
    check_equivalence(
        Case(
            fsdp_tp.AttentionBlock(**kw),
            fsdp_tp.AttentionBlock(**kw, axis=None),
            mesh_of(1, 1, 8),
            BATCH_AXES,
            check_vma,
            in_dim=8,
            out_dim=8,
            seq_len=5,
            batch_size=8,
        )
    )


@pytest.mark.parametrize(
    "heads, kv, tensor, match",
    [
        (
            6,
            None,
            4,
            r"AttentionBlock: num_heads \(size 6\) is not divisible by mesh axis 'tensor' \(size 4\)",
        ),
        # fewer kv heads than devices are kept whole, each read by a group: 3 and 2 do not divide
        (
            6,
            3,
            2,
            r"AttentionBlock: num_kv_heads \(size 3\) .* a 'tensor' size that divides 3 or that 3 divides",
        ),
        (6, 4, 4, r"AttentionBlock: num_heads \(size 6\) is not divisible by num_kv_heads \(size 4\)"),
    ],
)
def test_heads_the_axis_cannot_split_are_named(heads, kv, tensor, match):
    init = jax.shard_map(
        lambda x: fsdp_tp.AttentionBlock(heads, 4, num_kv_heads=kv).init(jax.random.key(0), x),
        mesh=mesh_of(1, 1, tensor),
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(IndivisibleShapeError, match=match):
        jax.eval_shape(init, jnp.ones((2, 3, 8)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(("heads", "kv"), [(8, 8), (8, 2)])
def test_attention_input_gradient_reaches_upstream_params(heads, kv, check_vma):
    kw = dict(num_heads=heads, head_dim=4, num_kv_heads=kv, use_bias=True)
    model = DenseThen(fsdp_tp.AttentionBlock(**kw), 8)
    reference = DenseThen(fsdp_tp.AttentionBlock(**kw, axis=None), 8)
    check_equivalence(
        Case(
            model,
            reference,
            mesh_of(1, 2, 4),
            BATCH_AXES,
            check_vma,
            in_dim=6,
            out_dim=8,
            seq_len=5,
            batch_size=8,
        )
    )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(("heads", "kv"), [(8, 8), (8, 2)])
def test_attention_block_moves_the_megatron_minimum(heads, kv, check_vma):
    mesh = mesh_of(1, 1, 8)
    block = fsdp_tp.AttentionBlock(num_heads=heads, head_dim=4, num_kv_heads=kv)
    x = jnp.ones((2, 5, 16))
    params, specs = abstract_init(
        lambda r, x: block.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), x, check_vma=check_vma
    )

    def fwd_bwd(params, x):
        return jax.grad(lambda p, x: (block.apply({"params": p}, x) ** 2).sum(), argnums=(0, 1))(params, x)

    out_specs = (specs, P())
    f = jax.jit(
        jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs, check_vma=check_vma)
    )
    found = [c for c in parse_collectives(f.lower(params, x).compile().as_text()) if c.group_size > 1]
    activation = 2 * 5 * 16 * 4
    if kv == heads:
        assert [(c.kind, c.operand_bytes) for c in found] == [("all-reduce", activation)] * 2
    else:  # plus the gradients of the whole k/v kernels, summed over the axis (XLA may fuse them)
        assert {c.kind for c in found} == {"all-reduce"} and sum(c.operands for c in found) == 4
        assert sum(c.operand_bytes for c in found) == 2 * activation + 2 * 16 * 8 * 4


@replicated_ok
@given(
    mesh=st.sampled_from([m for m in MESHES if m[2] > 1]),
    check_vma=st.booleans(),
    fsdp=st.booleans(),
    kind=st.sampled_from(["mlp", "attention", "gqa"]),
    ring=st.sampled_from(RING_MODES),
    seed=st.integers(0, 2**16),
)
def test_sequence_parallel_blocks_equal_unsharded(mesh, check_vma, fsdp, kind, ring, seed):
    tensor = mesh[2]
    if kind == "mlp":
        cls, kw = fsdp_tp.MLPBlock, dict(hidden_features=16, out_features=8)
    else:
        kv = 2 * tensor if kind == "attention" else max(1, tensor // 2)
        cls, kw = (
            fsdp_tp.AttentionBlock,
            dict(num_heads=2 * tensor, head_dim=4, num_kv_heads=kv, use_bias=True),
        )
    block_cls = fsdp_tp.shard_module_params(cls, "fsdp", min_weight_size=0) if fsdp else cls
    model = SequenceParallelAround(block_cls(**kw, sequence_dim=1, collective_matmul=ring), 8)
    reference = SequenceParallelAround(cls(**kw, axis=None), 8, axis=None)
    check_equivalence(
        Case(
            model,
            reference,
            mesh_of(*mesh),
            BATCH_AXES,
            check_vma,
            in_dim=6,
            out_dim=8,
            seq_len=2 * tensor,
            batch_size=8,
            seed=seed,
        )
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_sequence_parallel_mlp_block_moves_gather_and_reduce_scatter(check_vma):
    """SP MLP block forward + backward: all-gather + reduce-scatter each way, nothing else."""
    mesh = mesh_of(1, 1, 8)
    block = fsdp_tp.MLPBlock(64, out_features=32, sequence_dim=1)
    x = jnp.ones((2, 16, 32))  # global; each device holds 2 of the 16 positions
    params, specs = abstract_init(
        lambda r, x: block.init(r, x)["params"],
        mesh,
        (P(), P(None, "tensor")),
        jax.random.key(0),
        x,
        check_vma=check_vma,
    )

    def fwd_bwd(params, x):
        return jax.grad(lambda p, x: (block.apply({"params": p}, x) ** 2).sum(), argnums=(0, 1))(params, x)

    f = jax.jit(
        jax.shard_map(
            fwd_bwd,
            mesh=mesh,
            in_specs=(specs, P(None, "tensor")),
            out_specs=(specs, P(None, "tensor")),
            check_vma=check_vma,
        )
    )
    found = [c for c in parse_collectives(f.lower(params, x).compile().as_text()) if c.group_size > 1]
    shard = 2 * 2 * 32 * 4  # (batch, local seq, features) f32
    kinds = sorted((c.kind, c.operand_bytes) for c in found)
    # plus the row bias's gradient (32 f32), applied on sequence shards and summed over the axis
    assert (
        kinds == [("all-gather", shard)] * 2 + [("all-reduce", 32 * 4)] + [("reduce-scatter", 8 * shard)] * 2
    )


def test_sequence_length_not_divisible_in_sequence_parallel_mode():
    mesh = mesh_of(1, 1, 4)
    model = fsdp_tp.models.Transformer(
        vocab_size=16,
        d_model=8,
        num_layers=1,
        num_heads=4,
        head_dim=2,
        num_kv_heads=4,
        mlp_hidden=8,
        layout=fsdp_tp.models.Layout("tensor", sequence_parallel=True),
    )
    init = jax.shard_map(
        lambda ids: model.init(jax.random.key(0), ids),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(
        IndivisibleShapeError,
        match=r"embed/embedding: the sequence \(dim 1, .*\) \(size 6\) .* 'tensor' \(size 4\)",
    ):
        jax.eval_shape(init, jnp.zeros((2, 6), jnp.int32))
    with pytest.raises(IndivisibleShapeError, match=r"scatter_to_axis: the sequence \(dim 1, .*\) \(size 6"):
        jax.shard_map(
            lambda x: fsdp_tp.collectives.scatter_to_axis(x, 1, "tensor"),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(None, "tensor"),
        )(jnp.zeros((2, 6)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("ring", ["unidirectional", "bidirectional"])
def test_collective_matmul_moves_only_ring_steps(ring, check_vma):
    """Async SP MLP block, forward + backward on 8 devices: the all-gathers and reduce-scatters
    are gone, replaced by ppermute ring steps carrying the same bytes in chunks."""
    mesh = mesh_of(1, 1, 8)
    block = fsdp_tp.MLPBlock(64, out_features=32, sequence_dim=1, collective_matmul=ring)
    x = jnp.ones((2, 16, 32))
    spec = P(None, "tensor")
    params, specs = abstract_init(
        lambda r, x: block.init(r, x)["params"], mesh, (P(), spec), jax.random.key(0), x, check_vma=check_vma
    )

    def fwd_bwd(params, x):
        return jax.grad(lambda p, x: (block.apply({"params": p}, x) ** 2).sum(), argnums=(0, 1))(params, x)

    f = jax.jit(
        jax.shard_map(
            fwd_bwd, mesh=mesh, in_specs=(specs, spec), out_specs=(specs, spec), check_vma=check_vma
        )
    )
    found = [c for c in parse_collectives(f.lower(params, x).compile().as_text()) if c.group_size > 1]
    shard = 2 * 2 * 32 * 4  # (batch, local seq, features) f32
    counts = collections.Counter((c.kind, c.operand_bytes) for c in found)
    bias_grad = {("all-reduce", 32 * 4): 1}  # the row bias, applied on sequence shards
    if ring == "unidirectional":  # 4 rings (gather, reduce-scatter, and their transposes) x 7 steps
        assert counts == {("collective-permute", shard): 28, **bias_grad}
    else:  # gathers: 4 steps one way + 3 the other; reduce-scatters: 7 steps of half the features each way
        assert counts == {
            ("collective-permute", shard): 14,
            ("collective-permute", shard // 2): 28,
            **bias_grad,
        }


@pytest.mark.parametrize("ring", ["unidirectional", "bidirectional"])
def test_negative_control_ring_turning_the_wrong_way_is_caught(ring, monkeypatch):
    """A ring whose steps go the other way round places every chunk wrongly: caught.

    (Causal attention, not an MLP: the MLP works token by token, so a gather and a
    reduce-scatter that both permute the sequence the same way would cancel.)"""
    from fsdp_tp import collective_matmul

    right = collective_matmul._shift
    monkeypatch.setattr(collective_matmul, "_shift", lambda x, axis, step: right(x, axis, -step))
    kw = dict(num_heads=4, head_dim=4)
    case = Case(
        SequenceParallelAround(fsdp_tp.AttentionBlock(**kw, sequence_dim=1, collective_matmul=ring), 8),
        SequenceParallelAround(fsdp_tp.AttentionBlock(**kw, axis=None), 8, axis=None),
        mesh_of(1, 1, 4),
        BATCH_AXES,
        True,
        in_dim=6,
        out_dim=8,
        seq_len=8,
        batch_size=8,
    )
    with pytest.raises(AssertionError, match="output"):
        check_equivalence(case)


def test_collective_matmul_mode_and_divisibility_errors():
    mesh = mesh_of(1, 1, 4)

    def init(block, shape):
        f = jax.shard_map(
            lambda x: block.init(jax.random.key(0), x),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
        return jax.eval_shape(f, jnp.ones(shape))

    with pytest.raises(ValueError, match="collective_matmul='ring' is not a mode; pass None"):
        init(fsdp_tp.MLPBlock(16, collective_matmul="ring"), (8, 6))
    with pytest.raises(
        IndivisibleShapeError,
        match=r"wo: dim 0 of the input \(collective_matmul='unidirectional' chunks it\) \(size 6\) "
        r"of shape \(6, 4\) is not divisible by mesh axis 'tensor' \(size 4\)",
    ):
        init(fsdp_tp.MLPBlock(16, collective_matmul="unidirectional"), (6, 6))

"""Issue 42 point 3: a layout that agrees with a tp split is accepted, and every refusal's
suggested layout is accepted in turn.

A model annotated for Megatron (kernels ``("embed", "mlp")`` with ``mlp -> tensor``) could not
be combined with tp rules: the error suggested a spec that a second error refused, and said
"the storage rule" where the spec came from the model's annotation."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx
from fsdp_tp.errors import RuleError
from fsdp_tp.tp import ColumnParallel, HeadParallel, RowParallel
from fsdp_tp.tp._storage import require_no_tp_axis, with_split
from tests.refusals import stored_as_named

AXES = ("data", "fsdp", "tensor")


@st.composite
def specs(draw, ndim: int):
    """A valid spec of ``ndim`` entries: each mesh axis on one dim at most, in any order."""
    entries: list[tuple] = [() for _ in range(ndim)]
    for axis in AXES:
        if (dim := draw(st.integers(-1, ndim - 1))) >= 0:
            entries[dim] = (*entries[dim], axis)
    return P(*(e[0] if len(e) == 1 else (e or None) for e in entries))


@given(data=st.data(), ndim=st.integers(1, 4))
def test_every_refusal_suggests_a_layout_that_is_accepted(data, ndim):
    """Any storage spec against any role split: accepted (the split added, or kept where the
    spec agrees), or refused with ``err.fix``, which is named in the message and accepted."""
    spec = data.draw(specs(ndim))
    dim = data.draw(st.integers(-ndim, -1))
    split = (dim, "tensor", "layer$")
    try:
        out = with_split("layer/kernel", spec, ndim, split, "storage rule 'kernel$'")
    except RuleError as err:
        assert str(err.fix) in str(err) and "storage rule 'kernel$' gives" in str(err)
        out = with_split("layer/kernel", err.fix, ndim, split)
    assert out[dim % ndim] == "tensor" or (
        isinstance(out[dim % ndim], tuple) and out[dim % ndim][0] == "tensor"
    )
    assert sum("tensor" in (e if isinstance(e, tuple) else (e,)) for e in out) == 1


@given(data=st.data(), ndim=st.integers(1, 4))
def test_a_parameter_no_role_splits_is_told_a_layout_without_the_tp_axis(data, ndim):
    spec = data.draw(specs(ndim))
    try:
        require_no_tp_axis("norm/scale", spec, frozenset({"tensor"}), "the default spec")
    except RuleError as err:
        assert str(err.fix) in str(err)
        require_no_tp_axis("norm/scale", err.fix, frozenset({"tensor"}), "the default spec")


def test_negative_control_the_old_suggestion_is_refused_in_turn():
    """0.2.0's suggestion for the issue's key kernel, P(None, None, 'tensor'), is refused (the
    axis would split two dims): the property above would have caught it."""
    with pytest.raises(RuleError, match=r"splits dim 2 over 'tensor'"):
        with_split("attention/key/kernel", P(None, None, "tensor"), 3, (-2, "tensor", "attention$"))


LOGICAL = [("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv", None)]


def _annotated(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class AnnotatedBlock(nn.Module):
    """Annotated for Megatron, as MaxText-style models are: hidden units and heads on ``tensor``."""

    @nn.compact
    def __call__(self, x):
        attention = nn.MultiHeadDotProductAttention(
            num_heads=4,
            qkv_features=16,
            kernel_init=_annotated(("embed", "heads", "kv")),
            out_kernel_init=_annotated(("heads", "kv", "embed")),
            name="attention",
        )
        x = x + attention(x)
        h = nn.gelu(nn.Dense(32, kernel_init=_annotated(("embed", "mlp")), name="up")(x))
        return x + nn.Dense(8, kernel_init=_annotated(("mlp", "embed")), name="down")(h)


def test_a_model_annotated_for_megatron_takes_tp_rules_and_equals_the_unsharded_one():
    tp = [("attention$", HeadParallel()), ("up$", ColumnParallel()), ("down$", RowParallel())]
    model = fsdp_tp.shard_by_rules(AnnotatedBlock, logical_axis_rules=LOGICAL, tp_rules=tp)()
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    x = jax.random.normal(jax.random.key(1), (8, 4, 8))
    params, specs = fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), x[:2]
    )
    assert specs["up"]["kernel"] == P("fsdp", "tensor") and specs["down"]["kernel"] == P("tensor", "fsdp")
    assert specs["attention"]["key"]["kernel"] == P("fsdp", "tensor", None)
    assert specs["attention"]["out"]["kernel"] == P("tensor", None, "fsdp")
    out = jax.jit(
        jax.shard_map(
            lambda p, x: model.apply({"params": p}, x),
            mesh=mesh,
            in_specs=(specs, P(("data", "fsdp"))),
            out_specs=P(("data", "fsdp")),
        )
    )(params, x)
    plain = AnnotatedBlock().apply({"params": nn.unbox(params)}, x)
    np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6)


def test_an_annotation_that_disagrees_is_named_as_the_annotation_with_a_layout_that_works():
    tp = [("attention$", HeadParallel()), ("up$", RowParallel()), ("down$", ColumnParallel())]  # mlp reversed
    model = fsdp_tp.shard_by_rules(AnnotatedBlock, logical_axis_rules=LOGICAL, tp_rules=tp)()
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(
        RuleError,
        match=r"down/kernel: the model's own sharding annotation gives P\('tensor', 'fsdp'\): it splits "
        r"dim 0 over 'tensor', but tp rule 'down\$' splits dim 1 over it; .* Store it as P\('fsdp', None\)",
    ) as refused:
        fsdp_tp.init_sharded(
            lambda r, x: model.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), jnp.ones((2, 4, 8))
        )

    # The fix, as a user applies it: a storage rule with the spec the refusal gives for the
    # parameter it names (then up's, reversed too). The layouts then agree; what is left is
    # the plan this test reversed on purpose, refused as such.
    def build(stored):
        model = fsdp_tp.shard_by_rules(AnnotatedBlock, stored, logical_axis_rules=LOGICAL, tp_rules=tp)()
        init = lambda r, x: model.init(r, x)["params"]
        fsdp_tp.init_sharded(init, mesh, (P(), P()), jax.random.key(0), jnp.ones((2, 4, 8)))

    stored, left = stored_as_named(refused, build)
    assert [pattern for pattern, _ in stored] == [r"^up/kernel$", r"^down/kernel$"], stored
    assert "up (RowParallel) takes the split features" in str(left), left


class NNXAnnotatedMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(8, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(32, 8, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


def test_an_nnx_model_annotated_for_megatron_takes_tp_rules():
    tp = [("up$", fsdp_tp.tp.ColumnParallel()), ("down$", fsdp_tp.tp.RowParallel())]
    with nnx.use_eager_sharding(False):
        sharded = fsdp_tp.nnx.shard_by_rules(NNXAnnotatedMLP, tp_rules=tp, logical_axis_rules=LOGICAL)
    assert sharded.specs[("up", "kernel")] == P("fsdp", "tensor")
    assert sharded.specs[("down", "kernel")] == P("tensor", "fsdp")

"""``tensor_parallel``: any module's parameters split by rules, against the unsplit module (issue 3)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.errors import IndivisibleShapeError, RuleError
from tests.equivalence import Case, check_equivalence
from tests.test_tensor_parallel import BATCH_AXES, MESHES, mesh_of

COLUMN = [("kernel", -1), ("bias", 0)]
pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")


class Split(nn.Module):
    """One module kind, split by ``tensor_parallel`` with the collectives around it,
    or (``tp=False``) the same flax modules unsplit: the twin."""

    kind: str
    tp: bool = True
    fsdp: bool = False

    def wrap(self, cls, rules, split_input=False):
        if not self.tp:
            return cls
        split = fsdp_tp.tensor_parallel(cls, "tensor", rules, split_input=split_input)
        return fsdp_tp.shard_module_params(split, "fsdp", min_weight_size=0) if self.fsdp else split

    def enter(self, x):  # a replicated input: its gradient is summed over the axis (f)
        return fsdp_tp.collectives.copy_to_axis(x, "tensor") if self.tp else x

    def leave(self, y, dim=-1):  # a split output, gathered
        return fsdp_tp.collectives.gather_from_axis(y, y.ndim + dim, "tensor") if self.tp else y

    @nn.compact
    def __call__(self, x):
        if self.kind == "dense":
            return self.leave(self.wrap(nn.Dense, COLUMN)(16)(self.enter(x)))
        if self.kind == "mlp":  # column, then row (its bias-free partial sums reduced: g)
            h = nn.gelu(self.wrap(nn.Dense, COLUMN)(16)(self.enter(x)))
            y = self.wrap(nn.Dense, [("kernel", 0)], split_input=True)(4, use_bias=False)(h)
            return fsdp_tp.collectives.reduce_from_axis(y, "tensor") if self.tp else y
        if self.kind == "conv":
            return self.leave(self.wrap(nn.Conv, COLUMN)(8, kernel_size=(3,))(self.enter(x)))
        if self.kind == "dense_general":  # kernel (in, 8, 2): split the 8 "heads"
            y = self.wrap(nn.DenseGeneral, [("kernel", 1)])(features=(8, 2), use_bias=False)(self.enter(x))
            return self.leave(y, dim=-2).reshape(*y.shape[:-2], 16)
        if self.kind == "embed":
            return self.leave(self.wrap(nn.Embed, [("embedding", 1)])(16, 8)(x))
        raise ValueError(self.kind)


def squared(model, params, x, y):
    return jnp.mean(model.apply({"params": params}, x) ** 2)


def case_for(kind, mesh, check_vma, fsdp, seed=0):
    shapes = {
        "dense": dict(in_dim=6, out_dim=16),
        "mlp": dict(in_dim=6, out_dim=4),
        "conv": dict(in_dim=4, out_dim=8, seq_len=6),
        "dense_general": dict(in_dim=6, out_dim=16),
        "embed": dict(in_dim=0, out_dim=0, seq_len=4, vocab=16, loss=squared, reference_loss=squared),
    }[kind]
    return Case(
        Split(kind, fsdp=fsdp),
        Split(kind, tp=False),
        mesh_of(*mesh),
        BATCH_AXES,
        check_vma,
        seed=seed,
        **shapes,
    )


@given(
    kind=st.sampled_from(["dense", "mlp", "conv", "dense_general", "embed"]),
    mesh=st.sampled_from(MESHES),
    check_vma=st.booleans(),
    fsdp=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_modules_split_by_rules_equal_unsharded(kind, mesh, check_vma, fsdp, seed):
    check_equivalence(case_for(kind, mesh, check_vma, fsdp, seed))


@pytest.mark.parametrize("check_vma", [True, False])
def test_row_split_conv_and_dense_general_and_fsdp_on_the_other_dim(check_vma):
    """Row split, Conv, DenseGeneral with FSDP on top: kernels split over tensor and over fsdp."""
    for kind in ["mlp", "conv", "dense_general"]:
        check_equivalence(case_for(kind, (1, 2, 4), check_vma, fsdp=True))


def specs_of_split(module, x, mesh=None):
    mesh = mesh or mesh_of(1, 2, 4)
    _, specs = fsdp_tp.init_sharded(
        lambda r, x: module.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), x
    )
    return specs


def test_composed_with_fsdp_the_kernel_is_split_on_two_dims():
    Column = fsdp_tp.shard_module_params(fsdp_tp.tensor_parallel(nn.Dense, "tensor", COLUMN), "fsdp", 0)
    specs = specs_of_split(Column(16), jnp.ones((2, 8)))
    assert specs == {"kernel": P("fsdp", "tensor"), "bias": P("tensor")}


def test_rule_errors_name_the_rule_the_parameter_and_the_fix():
    x = jnp.ones((2, 8))
    with pytest.raises(
        RuleError, match=r"rule 'bais' matches no parameter of Dense \(its parameters: bias, kernel\)"
    ):
        specs_of_split(fsdp_tp.tensor_parallel(nn.Dense, "tensor", [("kernel", 1), ("bais", 0)])(16), x)
    with pytest.raises(
        RuleError, match=r"names dim 2 of parameter kernel, which has shape \(8, 16\) \(2 dims\)"
    ):
        specs_of_split(fsdp_tp.tensor_parallel(nn.Dense, "tensor", [("kernel", 2)])(16), x)
    with pytest.raises(RuleError, match=r"on dims \(0, 1\) over the one mesh axis 'tensor'"):
        specs_of_split(fsdp_tp.tensor_parallel(nn.Dense, "tensor", [("kernel", (0, 1))])(16), x)
    twice = fsdp_tp.tensor_parallel(
        fsdp_tp.tensor_parallel(nn.Dense, "tensor", [("kernel", 1)]), "tensor", [("kernel", 0)]
    )
    with pytest.raises(RuleError, match=r"parameter kernel is already split over 'tensor'"):
        specs_of_split(twice(16), x)
    with pytest.raises(RuleError, match=r"rule pattern 'ker\(nel' is not a regular expression"):
        fsdp_tp.tensor_parallel(nn.Dense, "tensor", [("ker(nel", 1)])
    with pytest.raises(RuleError, match=r"no rules"):
        fsdp_tp.tensor_parallel(nn.Dense, "tensor", [])
    with pytest.raises(TypeError, match=r"tensor_parallel: got a Dense instance .* pass the class"):
        fsdp_tp.tensor_parallel(nn.Dense(4), "tensor", COLUMN)
    with pytest.raises(
        IndivisibleShapeError, match=r"kernel: dim 1 \(size 6\) of shape \(8, 6\) .* 'tensor' \(size 4\)"
    ):
        specs_of_split(fsdp_tp.tensor_parallel(nn.Dense, "tensor", COLUMN)(6), x)


def test_a_module_that_sizes_a_split_parameter_from_its_attributes_gets_a_clear_error():
    split = fsdp_tp.tensor_parallel(nn.DenseGeneral, "tensor", [("kernel", 1), ("bias", 0)])
    with pytest.raises(RuleError, match=r"failed computing on its local parameter slices .* use_bias=False"):
        specs_of_split(split(features=(8, 2)), jnp.ones((2, 8)))

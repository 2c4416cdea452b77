"""Issue 3, acceptance 2: a decoder-only transformer, FSDP x TP x SP on 2x2x2, equals its unsharded twin."""

from __future__ import annotations

import flax.linen as nn
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.models import Layout, Transformer
from tests.conftest import BATCH_AXES
from tests.equivalence import Case, check_equivalence

CONFIG = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=4, head_dim=4, num_kv_heads=2, mlp_hidden=32)


def sharded_loss(model, params, ids, targets):
    return fsdp_tp.vocab_parallel_cross_entropy(model.apply({"params": params}, ids), targets).mean()


def reference_loss(model, params, ids, targets):
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": params}, ids), targets
    ).mean()


def transformer_case(model, check_vma: bool) -> Case:
    """``model`` on 2x2x2 against the plain flax twin (reference attention, full remat)."""
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    return Case(
        model,
        Transformer(**CONFIG),  # Layout(): plain flax
        mesh,
        BATCH_AXES,
        check_vma,
        in_dim=0,
        out_dim=0,
        seq_len=8,
        batch_size=8,
        vocab=32,
        loss=sharded_loss,
        reference_loss=reference_loss,
        output_spec=P(BATCH_AXES, None, "tensor"),
    )


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    ("sequence_parallel", "ring"), [(True, None), (False, None), (True, "bidirectional")]
)
def test_transformer_fsdp_tp_sp_equals_unsharded(sequence_parallel, ring, check_vma):
    layout = Layout("tensor", "fsdp", sequence_parallel, collective_matmul=ring, min_weight_size=0)
    check_equivalence(transformer_case(Transformer(**CONFIG, layout=layout), check_vma))


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
def test_transformer_tree_is_the_unsharded_tree():
    """Unsharded params load into the sharded model: same paths, global shapes and dtypes."""
    ids = jax.numpy.zeros((8, 8), jax.numpy.int32)
    ref = jax.eval_shape(Transformer(**CONFIG).init, jax.random.key(0), ids)["params"]
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = Transformer(**CONFIG, layout=Layout("tensor", "fsdp", sequence_parallel=True, min_weight_size=0))
    params, _ = fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"], mesh, (P(), P(BATCH_AXES)), jax.random.key(0), ids
    )
    layout = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    assert layout(nn.unbox(params)) == layout(ref)

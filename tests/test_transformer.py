"""Issue 3, acceptance 2: a decoder-only transformer, FSDP x TP x SP on 2x2x2, equals its unsharded twin."""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.models import Layout, Transformer
from tests.conftest import BATCH_AXES
from tests.equivalence import check_equivalence
from tests.transformer_case import CONFIG, transformer_case


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

"""The library's GPT (``fsdp_tp.models.Transformer``) at the suite's small sizes on 2 x 2 x 2,
against its plain-flax twin: the case the transformer and fast-path tests check."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.models import Transformer
from tests.conftest import BATCH_AXES
from tests.equivalence import Case, next_token_loss

__all__ = ["CONFIG", "sharded_loss", "transformer_case"]


CONFIG = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=4, head_dim=4, num_kv_heads=2, mlp_hidden=32)


def sharded_loss(model, params, ids, targets):
    return fsdp_tp.vocab_parallel_cross_entropy(model.apply({"params": params}, ids), targets).mean()


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
        reference_loss=next_token_loss,
        output_spec=P(BATCH_AXES, None, "tensor"),
    )

"""Issue 33: Flax NNX models get the library's promise, on the same core as Linen."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from fsdp_tp.nnx._read import ReadPlan
from tests.equivalence import Case, check_equivalence
from tests.nnx_models import MLPStack, Sharded, Twin
from tests.test_tensor_parallel import mesh_of


def _make(scan: bool):
    return lambda rngs: MLPStack(4, 8, 4, 2, scan=scan, rngs=rngs)


def _rules(scan: bool):
    return [("blocks/.*kernel$", P(None, "fsdp") if scan else P("fsdp")), ("kernel$", P("fsdp"))]


@pytest.mark.parametrize("scan, check_vma", [(False, True), (True, False), (False, False), (True, True)])
def test_fsdp_by_rules_equals_unsharded(scan, check_vma):
    make = _make(scan)
    case = Case(Sharded(make, _rules(scan)), Twin(make), mesh_of(2, 4, 1), ("data", "fsdp"), check_vma, 4, 4)
    check_equivalence(case)


def test_negative_control_a_gather_that_slices_the_gradient(monkeypatch):
    """A read whose backward keeps this device's slice over the batch axes (a gather without
    FSDP's mean reduce-scatter): each device's gradient is its own batch shard's, not the mean."""
    original = ReadPlan.gather
    monkeypatch.setattr(
        ReadPlan,
        "gather",
        lambda self, block: original(dataclasses.replace(self, batch_axes=frozenset()), block),
    )
    make = _make(False)
    case = Case(Sharded(make, _rules(False)), Twin(make), mesh_of(2, 4, 1), ("data", "fsdp"), False, 4, 4)
    with pytest.raises(AssertionError, match="grads"):
        check_equivalence(case)

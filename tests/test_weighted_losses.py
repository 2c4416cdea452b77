"""Losses that are not a per-device mean (issue 13 point 4): normalised by a global count of
unevenly spread tokens, or summed. Invariants 1-6 against the unsharded global loss."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._check.driver import switched_off
from fsdp_tp.errors import RuleError
from fsdp_tp.gradients import batch_total, global_mean_loss, global_sum_loss
from tests.conftest import BATCH_AXES, MESHES, mesh_of
from tests.equivalence import Case, check_equivalence
from tests.models import MLP
from tests.refusals import named_fix


def _masked(model, params, x, y, density: float):
    """Per-token squared errors summed over the tokens the mask keeps, and their count. The
    mask comes from the targets, so each device keeps its own, uneven, number of tokens."""
    err = ((model.apply({"params": params}, x) - y) ** 2).mean(-1)
    mask = (jax.nn.sigmoid(y[..., 0]) < density).astype(err.dtype)
    return (err * mask).sum(), mask.sum()


def _losses(kind: str, density: float):
    """(per-device loss, the unsharded global loss) for ``kind``; ``naive`` is the negative
    control: each device's own token mean, as a per-device mean loss would be written."""

    def reference(model, params, x, y):
        total, count = _masked(model, params, x, y, density)
        return total if kind == "sum" else total / count

    def sharded(model, params, x, y):
        total, count = _masked(model, params, x, y, density)
        if kind == "sum":
            return global_sum_loss(total, BATCH_AXES)
        if kind == "naive":
            return total / count
        return global_mean_loss(total, count, BATCH_AXES)

    return sharded, reference


def _case(kind: str, density: float, mesh, check_vma: bool, features=(16,), seed: int = 0) -> Case:
    """An FSDP MLP on token sequences, trained with ``kind``'s loss, against the unsharded one."""
    sharded, reference = _losses(kind, density)
    return Case(
        model=MLP(features, True, fsdp_tp.shard_module_params(nn.Dense, "fsdp", 0)),
        reference=MLP(features),
        mesh=mesh_of(*mesh),
        batch_axes=BATCH_AXES,
        check_vma=check_vma,
        in_dim=8,
        out_dim=features[-1],
        seq_len=4,
        seed=seed,
        loss=sharded,
        reference_loss=reference,
    )


@st.composite
def weighted_cases(draw, kind: str):
    mesh = draw(st.sampled_from([m for m in MESHES if m[0] * m[1] > 1]))
    features = tuple(draw(st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=3)))
    density = draw(st.sampled_from([0.3, 0.6, 0.9]))
    return _case(kind, density, mesh, draw(st.booleans()), features, draw(st.integers(0, 2**16)))


@settings(max_examples=max(2, settings().max_examples // 2))
@given(weighted_cases("mean"))
def test_a_loss_over_a_global_token_count_equals_the_unsharded_one(case):
    check_equivalence(case)


@settings(max_examples=max(2, settings().max_examples // 2))
@given(weighted_cases("sum"))
def test_a_summed_loss_equals_the_unsharded_one(case):
    check_equivalence(case)


@pytest.mark.parametrize("check_vma", [True, False])
def test_negative_control_per_device_token_means_differ(check_vma):
    """Each device's own token mean weights its tokens by 1 / its count: wrong when uneven,
    over the rows' axes alone. Refused before the first step at its division, naming the
    global mean (issue 99); the check off, the harness sees another loss."""
    case = _case("naive", 0.3, (2, 4), check_vma)
    with pytest.raises(
        RuleError, match=r"(?s)test_weighted_losses.py:\d+ .*div reads the partial sums.*global_mean_loss"
    ) as refused:
        check_equivalence(case, steps=1)
    with switched_off(), pytest.raises(AssertionError, match=r"loss|grads"):
        check_equivalence(case, steps=1)
    named_fix(refused, "fsdp_tp.gradients.global_mean_loss(local_sum, local_count")  # (the "mean" loss's)
    check_equivalence(dataclasses.replace(case, loss=_losses("mean", 0.3)[0]), steps=1)


@pytest.mark.parametrize("check_vma", [True, False])
def test_batch_total_sums_varying_and_multiplies_invariant_counts(check_vma):
    """A count varying over both batch axes, over fsdp only, or the same everywhere: the sum
    of every device's value, where a psum over an invariant axis would be refused."""

    def totals(counts):
        on_fsdp = jax.lax.axis_index("fsdp").astype(jnp.float32)
        return tuple(batch_total(c, BATCH_AXES) for c in (counts[0], on_fsdp, jnp.float32(5.0)))

    f = jax.shard_map(
        totals, mesh=mesh_of(2, 4), in_specs=P(BATCH_AXES), out_specs=(P(), P(), P()), check_vma=check_vma
    )
    every, per_fsdp, invariant = jax.jit(f)(jnp.arange(8.0))
    assert (float(every), float(per_fsdp), float(invariant)) == (28.0, 2 * (0 + 1 + 2 + 3), 40.0)

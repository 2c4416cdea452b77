"""Issue 82: the proof takes the models people bring, as they wrote them.

Each test is one point of the issue, with its negative control: the NNX tutorial's call-time
dropout rngs under ``"auto"`` and ``find_tp_rules(size=)`` (point 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fsdp_tp
from fsdp_tp.errors import RuleError
from fsdp_tp.testing import check_sharded
from fsdp_tp.tp import ColumnParallel, RowParallel

D = 8
MESH = {"data": 2, "tensor": 4}
X = jax.random.normal(jax.random.key(1), (8, D))
BATCH = (X, jnp.zeros((8, D)))
KEY = jax.random.key(3)
RULES = [("up$", ColumnParallel()), ("down$", RowParallel())]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


class CallTimeDrop(nnx.Module):
    """The tutorial's idiom: ``nnx.Dropout(rate)`` holding no rngs, given them at the call."""

    def __init__(self, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return x + self.down(self.drop(nnx.gelu(self.up(x)), rngs=rngs))


def test_call_time_dropout_rngs_auto_plans_and_proves_equal():
    """Point 1: "auto" fits its plan with the call's rngs unknown (a stand-in stream for the
    trace), and the plan is Megatron's, proved equal with dropout on."""
    check_sharded(CallTimeDrop, BATCH, mse, MESH, tp_rules="auto", rngs={"dropout": KEY}, steps=1)
    model = nnx.eval_shape(lambda: CallTimeDrop(nnx.Rngs(0)))
    for call in ({}, {"rngs": nnx.Rngs(dropout=1)}):  # with and without the call's own rngs
        plan = fsdp_tp.nnx.find_tp_rules(model, X, size=4, **call)
        assert [(p, type(r).__name__) for p, r in plan.rules] == [
            ("^up$", "ColumnParallel"),
            ("^down$", "RowParallel"),
        ]


def test_negative_control_a_real_misfit_beside_dropout_is_still_refused():
    """The stand-in stream names no plan right: a norm over the split features between the
    pair is refused at its line with the rngs stood in for, as without dropout."""

    class NormInside(CallTimeDrop):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.norm = nnx.LayerNorm(4 * D, rngs=rngs)

        def __call__(self, x, rngs=None):
            return x + self.down(self.drop(self.norm(self.up(x)), rngs=rngs))

    with pytest.raises(RuleError, match=r"LayerNorm|norm"):
        check_sharded(NormInside, BATCH, mse, MESH, tp_rules=RULES, rngs={"dropout": KEY}, steps=1)

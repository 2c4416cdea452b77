"""Every optax transform gives the unsharded update (issue 14).

The optimizer runs on global arrays, so a transform that reduces over a leaf (LAMB, LARS),
across leaves (global-norm clipping) or over rows and columns (factored Adafactor) sees the
same numbers as unsharded. Each transform x strategy x check_vma mode is compared with the
unsharded twin after 3 steps; the same comparison catches the naive per-device update.
"""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives
from fsdp_tp.errors import OptimizerOnShardsError
from fsdp_tp.sharded_init import abstract_init
from tests.conftest import BATCH_AXES, mesh_of
from tests.equivalence import ADAM_EPS, Case, batches, optimizer_mismatches, step_program
from tests.models import MLP, DenseThen, SequenceParallelAround

LR = 1e-2


def _no_bias(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "bias" not in jax.tree_util.keystr(path), params)


# Small thresholds so that clipping clips and Adafactor factors the small test kernels.
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(LR, eps=ADAM_EPS, weight_decay=1e-2),
    "adafactor": lambda: optax.adafactor(LR, min_dim_size_to_factor=4),
    "lamb": lambda: optax.lamb(LR, eps=ADAM_EPS),
    "lars": lambda: optax.lars(LR),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(LR, momentum=0.9),
    "clip_then_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(LR, eps=ADAM_EPS)),
    "multi_steps": lambda: optax.MultiSteps(optax.adamw(LR, eps=ADAM_EPS), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=LR, eps=ADAM_EPS),
    "masked": lambda: optax.masked(optax.adamw(LR, eps=ADAM_EPS), _no_bias),
}


def _strategy(name: str, check_vma: bool) -> Case:
    fsdp_dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=0)
    if name == "dp":
        model = reference = MLP((16, 16, 16, 4))
        return Case(model, reference, mesh_of(8, 1, 1), BATCH_AXES, check_vma, in_dim=8, out_dim=4)
    if name == "fsdp":
        model, reference = MLP((16, 16, 16, 4), dense=fsdp_dense), MLP((16, 16, 16, 4))
        return Case(model, reference, mesh_of(2, 4, 1), BATCH_AXES, check_vma, in_dim=8, out_dim=4)
    if name == "tp":
        model = DenseThen(fsdp_tp.MLPBlock(16, out_features=8), 8)
        reference = DenseThen(fsdp_tp.MLPBlock(16, out_features=8, axis=None), 8)
        return Case(model, reference, mesh_of(2, 1, 4), BATCH_AXES, check_vma, in_dim=8, out_dim=8)
    # FSDP x TP x SP: an FSDP-sharded MLP block in sequence-parallel mode, on 2 x 2 x 2.
    block = fsdp_tp.shard_module_params(fsdp_tp.MLPBlock, "fsdp", min_weight_size=0)
    model = SequenceParallelAround(block(16, out_features=8, sequence_dim=1), 8)
    reference = SequenceParallelAround(fsdp_tp.MLPBlock(16, out_features=8, axis=None), 8, axis=None)
    return Case(
        model,
        reference,
        mesh_of(2, 2, 2),
        BATCH_AXES,
        check_vma,
        in_dim=8,
        out_dim=8,
        seq_len=4,
        batch_size=8,
    )


STRATEGIES = ["dp", "fsdp", "tp", "fsdp_tp_sp"]


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_optimizer_equals_unsharded(strategy):
    """Params and optimizer state after 3 steps, for each transform in OPTIMIZERS, in both
    check_vma modes (one test per strategy: the two modes share the unsharded runs)."""
    references: dict = {}
    mismatches = {
        (check_vma, name): message
        for check_vma in (True, False)
        for name, message in optimizer_mismatches(
            _strategy(strategy, check_vma), OPTIMIZERS, references=references
        ).items()
    }
    assert mismatches == {}


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
@pytest.mark.parametrize("strategy", ["fsdp", "tp", "fsdp_tp_sp"])
def test_negative_control_update_on_shards_is_caught(strategy):
    """The same transforms run per device on their shards (a hand-written step, with
    check_vma=False, where jax cannot object): every one that reduces is caught, and the
    element-wise ones pass (so the check is not blind)."""
    reducing = ["clip_then_adamw", "lamb", "lars"]
    naive = {name: OPTIMIZERS[name] for name in [*reducing, "adamw", "sgd_momentum"]}
    assert sorted(optimizer_mismatches(_strategy(strategy, False), naive, naive=True)) == sorted(reducing)


def _fsdp_state(check_vma: bool):
    case = _strategy("fsdp", check_vma)
    x = jnp.ones((16, 8))

    init_fn = fsdp_tp.state_init_fn(case.model, optax.sgd(LR))
    state, specs = fsdp_tp.init_sharded(init_fn, case.mesh, (P(), P(BATCH_AXES)), jax.random.key(0), x)
    return case, state, specs, x


def _grads(case, state, x):
    grads = jax.grad(lambda p: (case.model.apply({"params": p}, x) ** 2).mean())(state.params)
    return fsdp_tp.sync_gradients(grads, BATCH_AXES)


@pytest.mark.parametrize("check_vma", [True, False])
def test_apply_gradients_inside_the_step_is_refused(check_vma):
    case, state, specs, x = _fsdp_state(check_vma)

    def old_style(state, x):  # the update on shards, as steps were written before
        return state.apply_gradients(grads=_grads(case, state, x)), ()

    step = fsdp_tp.shard_step(old_style, case.mesh, specs, P(BATCH_AXES), check_vma=check_vma)
    with pytest.raises(OptimizerOnShardsError, match=r"shard_step's step_fn.*Return \(grads, metrics\)"):
        step(state, x)


def test_apply_gradients_on_split_params_under_shard_map_is_refused():
    case, state, specs, x = _fsdp_state(True)

    def by_hand(state, x):
        return state.apply_gradients(grads=_grads(case, state, x))

    f = jax.shard_map(by_hand, mesh=case.mesh, in_specs=(specs, P(BATCH_AXES)), out_specs=specs)
    with pytest.raises(OptimizerOnShardsError, match="vary over mesh axes \\['fsdp'\\]"):
        jax.jit(f)(state, x)


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_optimizer_state_of_lists_per_parameter_equals_unsharded(strategy):
    """optax.sm3 keeps a list of accumulators per parameter (one per dim), so its state holds
    boxes around lists: init_sharded crashed in the spec derivation (issue 34 point 3). Each
    accumulator is now split like its parameter where it fits, else whole; params and state
    after 3 steps equal the unsharded run's, both check_vma modes.

    On fsdp x tp x sp the eps is ADAM_EPS's, for ADAM_EPS's reason. optax.sm3 fixes it at
    1e-8, and its first update g / sqrt(g**2 + eps) then has slope 9.4e3 at wi/kernel[1, 1],
    whose gradient is -2.0176e-05 sharded and -2.0178e-05 unsharded (1.3e-9 apart, f32
    rounding of another summation order; the largest gradient difference is 1.5e-8 against a
    median |g| of 1.1e-2). So the update moves by 1.2e-5, and sm3's momentum (x 0.1) by
    1.25e-6, over atol 1e-6: measured, and the gradients themselves are equal to tolerance."""
    sm3 = lambda: optax.sm3(LR)
    if strategy == "fsdp_tp_sp":
        sm3 = lambda: optax.chain(optax.scale_by_sm3(eps=ADAM_EPS), optax.scale(-LR))
    for check_vma in (True, False):
        assert optimizer_mismatches(_strategy(strategy, check_vma), {"sm3": sm3}) == {}


def test_a_step_that_returns_a_state_is_told_to_return_grads():
    case, state, specs, x = _fsdp_state(True)

    def returns_state(state, x):
        return state.replace(step=state.step + 1), ()

    step = fsdp_tp.shard_step(returns_state, case.mesh, specs, P(BATCH_AXES))
    with pytest.raises(TypeError, match=r"got a TrainState \(at the top: expected .*not a new state") as err:
        step(state, x)
    # Issue 32: one readable line, never the parameters' whole PyTreeDef (thousands of characters).
    assert "\n" not in str(err.value) and len(str(err.value)) < 400 and "PyTreeDef" not in str(err.value)


def test_a_step_whose_grads_lack_a_parameter_is_told_which():
    case, state, specs, x = _fsdp_state(True)
    first = next(iter(state.params))

    def drops_one(state, x):
        grads = _grads(case, state, x)
        return {k: v for k, v in grads.items() if k != first}, ()

    step = fsdp_tp.shard_step(drops_one, case.mesh, specs, P(BATCH_AXES))
    with pytest.raises(TypeError, match=rf"at the top: expected a dict with keys \[.*'{first}'") as err:
        step(state, x)
    assert "\n" not in str(err.value) and len(str(err.value)) < 500


def _step_collectives(strategy: str, optimizer: str, check_vma: bool, naive: bool = False):
    """Every collective the compiled train step runs, as (kind, operand types sorted, group
    size), and the number of distinct parameter specs."""
    case = _strategy(strategy, check_vma)
    tx, batch = OPTIMIZERS[optimizer](), next(batches(case, 1))

    state, specs = abstract_init(  # (the state's shapes: all the compiled step needs)
        fsdp_tp.state_init_fn(case.model, tx),
        case.mesh,
        (P(), P(case.batch_axes)),
        jax.random.key(0),
        batch[0],
        check_vma=check_vma,
    )
    hlo = step_program(case, specs, naive).lower(state, batch).compile().as_text()
    ops = collections.Counter(
        (c.kind, tuple(sorted(t.split("{")[0] for t in c.operand_types)), c.group_size)
        for c in parse_collectives(hlo)
        for _ in range(c.executions)
    )
    return ops, len(set(jax.tree.leaves(specs.params, is_leaf=lambda x: isinstance(x, P))))


def _arrays(ops: collections.Counter) -> collections.Counter:
    """The non-scalar operands each kind of collective moves (scalars dropped)."""
    moved = collections.Counter()
    for (kind, types, _), n in ops.items():
        for t in types:
            moved[(kind, t)] += n * (t != "f32[]")
    return +moved


@pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "fsdp_tp_sp"])
def test_optimizer_communication_is_what_the_transform_needs(strategy, check_vma):
    """Element-wise AdamW on global arrays: the step's collectives are exactly those of an
    update run per device (nothing added). Clipping by the global norm moves no array more:
    it adds only all-reduces of scalars (the leaves' partial sums of squares): none on DP
    (every device holds every gradient), exactly one on FSDP. With TP and SP, XLA's CPU
    pipeline reduces each group of alike-sharded leaves on its own: at most one per
    distinct parameter spec (measured: 4 with check_vma=False, 5 with True)."""
    adamw, distinct_specs = _step_collectives(strategy, "adamw", check_vma)
    assert adamw == _step_collectives(strategy, "adamw", check_vma, naive=True)[0]
    clipped = _step_collectives(strategy, "clip_then_adamw", check_vma)[0]
    assert _arrays(clipped) == _arrays(adamw)
    added = clipped - adamw  # whole ops (a scalar merged into an existing all-reduce is not one)
    scalar_only = {op: n for op, n in added.items() if op[0] == "all-reduce" and set(op[1]) == {"f32[]"}}
    assert sum(scalar_only.values()) == sum(added.values()) - sum((adamw - clipped).values())
    expected = {"dp": 0, "fsdp": 1}.get(strategy)
    if expected is not None:
        assert sum(scalar_only.values()) == expected, added
    else:
        assert 1 <= sum(scalar_only.values()) <= distinct_specs, (added, distinct_specs)

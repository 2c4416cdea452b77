"""The reference check every strategy must pass: a sharded run equals the unsharded one.

``check_equivalence`` runs one model sharded under ``jax.shard_map`` and its
unsharded twin on the same global batches and asserts docs/design.md invariants 1-5:
same tree, same init (bit for bit), same outputs and loss, same synced
gradients, same parameters after k steps of SGD and of AdamW.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.partitioning import specs_of
from fsdp_tp.rules import named_shardings

RTOL, ATOL = 1e-5, 1e-6  # f32; never loosen to get a pass (docs/design.md, STYLE.md habit 9)
# Adam's update lr * g / (|g| + eps) turns on the sign of g when |g| ~ eps: a gradient
# that cancels to ~1e-7 (seen: 9.1e-8 against a median of 2.7e-2) then moves by a
# different lr-sized step in two runs whose g differ by rounding (~1e-9). eps = 1e-3
# keeps the update a well-conditioned function of g, still Adam-like for typical g.
ADAM_EPS = 1e-3


def mse(model: nn.Module, params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)


@dataclasses.dataclass(frozen=True)
class Case:
    model: nn.Module  # the sharded model, applied per device
    reference: nn.Module  # its unsharded twin
    mesh: Mesh
    batch_axes: tuple[str, ...]
    check_vma: bool
    in_dim: int
    out_dim: int
    batch_size: int = 16
    seed: int = 0
    seq_len: int | None = None  # inputs (batch, seq, dim) when set, else (batch, dim)
    vocab: int | None = None  # inputs are token ids (batch, seq_len) and targets the next ids
    loss: Callable = mse  # loss(model, params, x, y) of the sharded model, per device
    reference_loss: Callable = mse
    # What the twin computes on, given its params: the params themselves, or e.g. them
    # rounded as a mixed-precision run reads them (MixedPrecision.round).
    twin_reads: Callable = lambda params: params
    output_spec: P | None = None  # layout of the sharded output; default: split like the batch


def batches(case: Case, count: int):
    keys = jax.random.split(jax.random.key(case.seed + 1), count)
    for key in keys:
        kx, ky = jax.random.split(key)
        if case.vocab is not None:  # token ids and their next-token targets
            ids = jax.random.randint(kx, (case.batch_size, case.seq_len + 1), 0, case.vocab)
            yield ids[:, :-1], ids[:, 1:]
            continue
        lead = (case.batch_size,) if case.seq_len is None else (case.batch_size, case.seq_len)
        yield (jax.random.normal(kx, (*lead, case.in_dim)), jax.random.normal(ky, (*lead, case.out_dim)))


def assert_trees_close(actual, expected, what: str, exact: bool = False) -> None:
    a_paths = jax.tree_util.tree_flatten_with_path(actual)[0]
    e_leaves = jax.tree.leaves(expected)
    a_keys = [jax.tree_util.keystr(p) for p, _ in a_paths]
    e_keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    assert a_keys == e_keys, f"{what}: paths differ: {sorted(set(a_keys) ^ set(e_keys))}"
    for (path, a), e in zip(a_paths, e_leaves, strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert a.shape == e.shape and a.dtype == e.dtype, (
            f"{where}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        )
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=where)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL, err_msg=where)


def _reference_steps(case: Case, tx, params, data):
    """The unsharded twin's (params, optimizer state) after a step per batch."""

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: case.reference_loss(case.reference, case.twin_reads(p), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for x, y in data:
        params, opt_state = step(params, opt_state, x, y)
    return params, opt_state


def step_program(
    case: Case, specs, naive: bool = False, donate: bool = True, sync: Callable = fsdp_tp.sync_gradients
):
    """The jitted train step of ``case`` (a ``TrainState`` laid out by ``specs``), with the
    mean loss as metric. ``naive=True`` is the negative control: the optax update runs per
    device on its shards, inside ``shard_map``, as a hand-written step would."""
    batch_spec = P(case.batch_axes)

    def step_fn(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: case.loss(case.model, p, x, y))(state.params)
        return sync(grads, case.batch_axes), jax.lax.pmean(loss, case.batch_axes)

    def naive_step_fn(state, batch):
        grads, loss = step_fn(state, batch)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

    if not naive:
        return fsdp_tp.shard_step(
            step_fn, case.mesh, specs, (batch_spec, batch_spec), check_vma=case.check_vma, donate_state=donate
        )
    per_device = jax.shard_map(
        naive_step_fn,
        mesh=case.mesh,
        in_specs=(specs, (batch_spec, batch_spec)),
        out_specs=(specs, P()),
        check_vma=case.check_vma,
    )
    return jax.jit(per_device)


def _run_sharded(case: Case, state, specs, sync: Callable, data, naive: bool = False, donate: bool = True):
    """``state`` after a step per batch (see :func:`step_program`)."""
    step = step_program(case, specs, naive, donate, sync)
    for x, y in data:
        state, _ = step(state, (x, y))
    return state


def train_state(case: Case, tx, params, rng):
    """A train state for ``tx`` on the sharded ``params`` and its specs: ``TrainState.create``
    under ``jax.jit`` on global arrays, into the specs' shardings, as ``init_sharded`` builds
    an optimizer state. Compiling it into the shardings lets the step compile once (an eager
    state's Python step counter and uncommitted arrays would compile it a second time)."""
    create = lambda p: fsdp_tp.TrainState.create(apply_fn=case.model.apply, params=p, tx=tx, rng=rng)
    specs = specs_of(jax.eval_shape(create, params), case.mesh)
    return jax.jit(create, out_shardings=named_shardings(specs, case.mesh))(params), specs


def optimizer_mismatches(
    case: Case, optimizers: dict[str, Callable], steps: int = 3, naive: bool = False, references=None
) -> dict[str, str]:
    """Invariant 5 for many optax transforms on one case: the name and the assertion message
    of each transform whose params or optimizer state after ``steps`` sharded steps differ
    from the unsharded run's (empty: all equal).

    The parameters are initialized sharded once; each transform's train state is built from
    them on global arrays (``TrainState.create`` under ``jax.jit``, outside ``shard_map``,
    specs from ``specs_of(state, mesh)``). ``references`` (a dict) keeps the unsharded runs by name,
    to share them between cases that differ only in how they shard.
    """
    data = list(batches(case, steps))
    rng = jax.random.key(case.seed)
    params, _ = fsdp_tp.init_sharded(
        lambda r, x: case.model.init(r, x)["params"],
        case.mesh,
        (P(), P(case.batch_axes)),
        rng,
        data[0][0],
        check_vma=case.check_vma,
    )
    references = {} if references is None else references
    # The twin's init, compiled once and only if some unsharded run is not yet kept.
    reference_params = functools.cache(lambda: jax.jit(case.reference.init)(rng, data[0][0])["params"])
    mismatches = {}
    for name, make in optimizers.items():
        tx = make()
        state, specs = train_state(case, tx, params, rng)
        state = _run_sharded(case, state, specs, fsdp_tp.sync_gradients, data, naive, donate=False)
        if name not in references:
            references[name] = _reference_steps(case, tx, reference_params(), data)
        try:
            assert_trees_close(
                nn.unbox(state.params), references[name][0], f"{name}: params after {steps} steps"
            )
            assert_trees_close(nn.unbox(state.opt_state), references[name][1], f"{name}: optimizer state")
        except AssertionError as err:
            mismatches[name] = str(err)
    return mismatches


def check_equivalence(case: Case, sync: Callable = fsdp_tp.sync_gradients, steps: int = 3) -> None:
    data = list(batches(case, steps))
    x, y = data[0]
    rng = jax.random.key(case.seed)
    ref_params = jax.jit(case.reference.init)(rng, x)["params"]
    batch_spec = P(case.batch_axes)

    # Invariants 1-2: tree, shapes, dtypes and init values, bit for bit.
    def init_fn(rng, x):
        return case.model.init(rng, x)["params"]

    boxed, specs = fsdp_tp.init_sharded(
        init_fn, case.mesh, (P(), batch_spec), rng, x, check_vma=case.check_vma
    )
    assert_trees_close(nn.unbox(boxed), ref_params, "init", exact=True)

    # Invariants 3-4: outputs, loss and synced gradients.
    def forward_backward(params, x, y):
        out = case.model.apply({"params": params}, x)
        loss, grads = jax.value_and_grad(lambda p: case.loss(case.model, p, x, y))(params)
        return out, jax.lax.pmean(loss, case.batch_axes), sync(grads, case.batch_axes)

    sharded_fb = jax.jit(
        jax.shard_map(
            forward_backward,
            mesh=case.mesh,
            in_specs=(specs, batch_spec, batch_spec),
            out_specs=(case.output_spec or batch_spec, P(), specs),
            check_vma=case.check_vma,
        )
    )
    out, loss, grads = sharded_fb(boxed, x, y)

    @jax.jit  # the twin's output, loss and gradients: one program, like the sharded side
    def twin_forward_backward(params, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: case.reference_loss(case.reference, case.twin_reads(p), x, y)
        )(params)
        return case.reference.apply({"params": case.twin_reads(params)}, x), loss, grads

    ref_out, ref_loss, ref_grads = twin_forward_backward(ref_params, x, y)
    assert_trees_close(out, ref_out, "output")
    assert_trees_close(loss, ref_loss, "loss")
    assert_trees_close(nn.unbox(grads), ref_grads, "grads")

    # Invariant 5: parameters after k steps of SGD and of AdamW, each from a train state built
    # on the sharded init above (the state's own init path is tested in test_state_specs).
    for name, tx in (("sgd", optax.sgd(0.1)), ("adamw", optax.adamw(1e-2, eps=ADAM_EPS, weight_decay=1e-2))):
        state, state_specs = train_state(case, tx, boxed, rng)
        assert_trees_close(
            nn.unbox(_run_sharded(case, state, state_specs, sync, data).params),
            _reference_steps(case, tx, ref_params, data)[0],
            f"{name} params after {steps} steps",
        )

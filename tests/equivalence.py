"""The reference check every strategy must pass: a sharded run equals the unsharded one.

``check_equivalence`` runs one model sharded under ``jax.shard_map`` and its unsharded twin on
the same random global batches through the library's own proof,
:func:`fsdp_tp.testing.check_equal` (docs/design.md invariants 1-5: same tree, same init bit
for bit, same outputs and loss, same synced gradients, same parameters after k steps of SGD and
of AdamW): the suite and a user prove the same thing with one harness. What is the suite's
alone lives here: a :class:`Case` (the model, its twin and how to draw batches for it), the
naive per-device optimizer step (a negative control) and the sweep over many optimizers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.testing import (
    ATOL,
    OPTIMIZERS,
    RTOL,
    Comparison,
    NNXSharded,
    NNXTwin,
    Reference,
    assert_trees_close,
    check_equal,
)
from fsdp_tp.testing._harness import alongside, sharded_step, train_state, twin_run

__all__ = [
    "ADAM_EPS",
    "ATOL",
    "RTOL",
    "Case",
    "assert_trees_close",
    "batches",
    "check_equivalence",
    "mse",
    "next_token_loss",
    "optimizer_mismatches",
    "step_program",
    "train_state",
]

ADAM_EPS = 1e-3  # (fsdp_tp.testing.OPTIMIZERS' AdamW: why, there)


def mse(model: nn.Module, params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)


def next_token_loss(model: nn.Module, params, tokens, targets):
    """Mean cross-entropy of a language model's (whole) logits against ``targets``."""
    logits = model.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


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

    @property
    def comparison(self) -> Comparison:
        return Comparison(
            self.model,
            self.reference,
            self.mesh,
            self.batch_axes,
            self.loss,
            self.reference_loss,
            self.twin_reads,
            self.output_spec,
            self.check_vma,
        )


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


def check_equivalence(
    case: Case, sync: Callable = fsdp_tp.sync_gradients, steps: int = 3, reference: Reference | None = None
) -> None:
    """``reference``: the twin's run shared with every check of the same twin, loss and reads."""
    key = (case.reference, case.reference_loss, case.twin_reads)
    data, rng = list(batches(case, steps)), jax.random.key(case.seed)
    check_equal(case.comparison, data, rng, OPTIMIZERS, sync, reference=reference, key=key)


def step_program(
    case: Case,
    specs,
    naive: bool = False,
    donate: bool = True,
    sync: Callable = fsdp_tp.sync_gradients,
    reads=None,
):
    """The jitted train step of ``case`` (a ``TrainState`` laid out by ``specs``), with the
    mean loss as metric (with ``reads``, the output's specs: ``(outputs, loss, gradients)``, as
    :func:`fsdp_tp.testing._harness.sharded_step` gives them). ``naive=True`` is the negative
    control: the optax update runs per device on its shards, inside ``shard_map``, as a
    hand-written step would."""
    if not naive:
        return sharded_step(case.comparison, specs, sync, donate, reads)
    batch_spec = P(case.batch_axes)

    def naive_step_fn(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: case.loss(case.model, p, x, y))(state.params)
        grads, loss = sync(grads, case.batch_axes), jax.lax.pmean(loss, case.batch_axes)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = loss if reads is None else (case.model.apply({"params": state.params}, x), loss, grads)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    per_device = jax.shard_map(
        naive_step_fn,
        mesh=case.mesh,
        in_specs=(specs, (batch_spec, batch_spec)),
        out_specs=(specs, P() if reads is None else (reads, P(), specs.params)),
        check_vma=case.check_vma,
    )
    return jax.jit(per_device)


def optimizer_mismatches(
    case: Case, optimizers: dict[str, Callable], steps: int = 3, naive: bool = False, references=None
) -> dict[str, str]:
    """Invariant 5 for many optax transforms on one case: the name and the assertion message
    of each transform whose update at some step, or whose state after ``steps`` sharded steps,
    differs from the unsharded run's (empty: all equal).

    All the transforms run in one step program a side (:func:`fsdp_tp.testing._harness.alongside`),
    each updating from the same gradients at the same parameters, which an element-wise SGD
    (its own parameters compared too) moves: a transform that computes wrongly on shards is
    named alone, not every one after it. The parameters are initialized sharded once; the train
    state is built from them on global arrays (``TrainState.create`` under ``jax.jit``, outside
    ``shard_map``, specs from ``specs_of(state, mesh)``). ``references`` (a dict) keeps the
    unsharded run, to share it between cases that differ only in how they shard.
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
    tx = alongside({_APPLIED: optax.sgd(0.1)} | {name: make() for name, make in optimizers.items()})
    references = {} if references is None else references
    key = tuple(optimizers)
    if key not in references:
        twin_params = jax.jit(case.reference.init)(rng, data[0][0])["params"]
        references[key] = twin_run(case.comparison, tx, twin_params, data)
    want, twin_states, _ = references[key]
    state, specs = train_state(case.comparison, tx, params, rng)
    step = step_program(case, specs, naive, donate=False)
    mismatches = {}
    for j, ((x, y), twin_state) in enumerate(zip(data, twin_states, strict=True)):
        state, _ = step(state, (x, y))
        for name, update in state.opt_state.updates.items():
            if name not in mismatches:
                wanted = twin_state.updates[name]
                mismatches |= _mismatch(name, update, wanted, f"{name}: update at step {j + 1}")
    for name in optimizers:
        if name not in mismatches:
            got, wanted = state.opt_state.states[name], twin_states[-1].states[name]
            mismatches |= _mismatch(name, got, wanted, f"{name}: optimizer state")
    assert_trees_close(nn.unbox(state.params), want, f"{_APPLIED}: params after {steps} steps")
    return mismatches


_APPLIED = "sgd (the one applied)"


def _mismatch(name: str, got, wanted, what: str) -> dict[str, str]:
    try:
        assert_trees_close(nn.unbox(got), wanted, what)
    except AssertionError as err:
        return {name: str(err)}
    return {}


def check_split(api, cls, rules, x_shape, check_vma: bool):
    """``cls`` (a constructor taking ``rngs`` in NNX, a module class in Linen; for ``"layers"``, a
    Linen class of Megatron layers whose ``sharded=False`` twin has ``nn.Dense``) split by ``rules``
    on data 2 x tensor 4: its outputs and synced gradients are the unsharded model's. Returns
    the sharded model and its parameters' specs."""
    with jax.enable_x64(True):
        if api == "nnx":
            # ("auto" traces the call: its input, as a shape)
            inputs = dict(inputs=(jax.ShapeDtypeStruct(x_shape, jnp.float64),)) if rules == "auto" else {}
            model, twin = NNXSharded(cls, batch_axes=("data",), tp_rules=rules, **inputs), NNXTwin(cls)
        elif api == "layers":  # the Linen Megatron layers in the model's code; its twin has nn.Dense
            model, twin = cls(), cls(sharded=False)
        else:
            model, twin = fsdp_tp.shard_by_rules(cls, batch_axes=("data",), tp_rules=rules)(), cls()
        mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
        x = jax.random.normal(jax.random.key(1), x_shape, jnp.float64)
        params, specs = fsdp_tp.init_sharded(
            lambda r, x: model.init(r, x)["params"],
            mesh,
            (P(), P("data")),
            jax.random.key(0),
            x,
            check_vma=check_vma,
        )

        def loss(model, params, x):
            out = model.apply({"params": params}, x)
            return jnp.mean(out * jnp.cos(out)), out

        def per_device(params, x):
            (_, out), grads = jax.value_and_grad(functools.partial(loss, model), has_aux=True)(params, x)
            return out, fsdp_tp.sync_gradients(grads, ("data",))

        step = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, P("data")),
            out_specs=(P("data"), specs),
            check_vma=check_vma,
        )
        out, grads = jax.jit(step)(params, x)
        whole = nn.unbox(params)
        # (the twin as one program, as the sharded step runs: op by op it compiled each op)
        twin_step = jax.jit(jax.value_and_grad(functools.partial(loss, twin), has_aux=True))
        (_, want), want_grads = twin_step(whole, x)
        assert_trees_close(out, want, "output")
        assert_trees_close(nn.unbox(grads), want_grads, "grads")
    return model, specs

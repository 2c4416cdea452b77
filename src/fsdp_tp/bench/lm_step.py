"""One AdamW step of a sharded LM, lowered against its state's shapes and shardings: what the
benchmark's rows (:mod:`~fsdp_tp.bench.llama_rows`, :mod:`~fsdp_tp.bench.moe_rows`,
:mod:`~fsdp_tp.bench.precision_rows`) read their figures off, the state built only to time it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec as P

from ..gradients import sync_gradients
from ..sharded_init import abstract_init, init_sharded
from ..train import TrainState, shard_step

__all__ = ["LoweredStep", "lowered_lm_step"]


class LoweredStep(NamedTuple):
    """:func:`lowered_lm_step`'s step, lowered against the state's shapes and shardings
    (``state``, :func:`~fsdp_tp.sharded_init.abstract_init`'s: nothing built), and ``init()``,
    which builds the state it takes (for running it: reading it needs none)."""

    lowered: jax.stages.Lowered
    state: Any
    init: Callable[[], Any]


def lowered_lm_step(
    model, mesh, batch_axes: tuple, tokens, check_vma: bool = True, with_aux: bool = False
) -> LoweredStep:
    """One AdamW step of the sharded LM ``model`` (cross-entropy of its logits against
    ``tokens`` themselves, plus the ``aux`` term of a model returning ``(logits, aux)`` when
    ``with_aux``), lowered, and the state's shapes; the state is built only when asked for."""
    tx = optax.adamw(1e-3)

    def init_fn(rng, x):
        params = model.init(rng, x)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=rng)

    init_args = (init_fn, mesh, (P(), P(batch_axes)), jax.random.key(0), tokens)
    state, specs = abstract_init(*init_args, check_vma=check_vma)

    def step(state, batch):
        def loss(params):
            out = model.apply({"params": params}, batch)
            logits, aux = out if with_aux else (out, 0.0)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean() + aux

        value, grads = jax.value_and_grad(loss)(state.params)
        return sync_gradients(grads, batch_axes), {"loss": jax.lax.pmean(value, batch_axes)}

    step_fn = shard_step(step, mesh, specs, P(batch_axes), check_vma=check_vma)
    # jitted (donating the state) as shard_step's own: one program, typed as a jit
    lowered = jax.jit(step_fn, donate_argnums=0).lower(state, tokens)
    return LoweredStep(lowered, state, lambda: init_sharded(*init_args, check_vma=check_vma)[0])

"""``fsdp-tp train --check N``: the unsharded twin trained on one device on the sharded run's
batches, from the same init, reading the parameters rounded as FSDP gathers them; both loss
curves and the largest parameter difference, leaf by leaf by path."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax.core.meta import unbox

from ..train import state_init_fn
from .batches import split_windows
from .data import Tokens, windows_at
from .moe_lm import linen_path, moe_loss
from .trainer import Trainer

__all__ = ["compare_with_twin", "past_warmup_zero"]


def compare_with_twin(trainer: Trainer, tokens: Tokens, steps: int) -> tuple[float, float, list, list]:
    """Trains ``steps`` steps sharded and, on one device, the unsharded twin on the same batches.

    Returns the largest loss difference, the largest parameter difference, and both loss curves.
    """
    s, config = trainer.settings, trainer.settings.model
    policy = s.layout.mixed_precision
    # The twin computes on what the sharded model reads: its params rounded as FSDP gathers them,
    # in the shapes the sharded model stores (NNX's attention kernels (d, h, k) where Linen's
    # are (d, h * k): an 8-bit gather scales each row of the stored shape).
    stored = [a.shape for a in jax.tree.leaves(unbox(trainer.state.params))]  # (global shapes: no transfer)

    def twin_reads(params):
        if policy is None:
            return params
        leaves, tree = jax.tree.flatten(params)
        rounded = [
            policy.round(x.reshape(shape)).reshape(x.shape) for x, shape in zip(leaves, stored, strict=True)
        ]
        return jax.tree.unflatten(tree, rounded)

    state_fn = state_init_fn(trainer.twin, trainer.tx)
    state = jax.jit(state_fn)(jax.random.key(s.seed), np.zeros((s.batch, config.seq_len), np.int32))
    # Warmup's first step is at learning rate 0: it moves nothing, so a wrong gradient there
    # would pass. Both start one step into the schedule, the first update that moves them.
    state = state.replace(opt_state=past_warmup_zero(state.opt_state, s.warmup))
    trainer.state = trainer.state.replace(opt_state=past_warmup_zero(trainer.state.opt_state, s.warmup))

    @jax.jit
    def twin_step(state, windows):
        # (the sharded step's batch, whole: its segment ids (packed) or positions (the MoE LM
        # split) read as the sharded model reads them)
        batch = split_windows(s, windows)
        ids, targets, *read = batch if isinstance(batch, tuple) else (windows[:, :-1], windows[:, 1:])

        def loss_fn(params):
            out = trainer.twin.apply({"params": twin_reads(params)}, ids, *read[:1])
            if config.experts:  # (the MoE LM's logits and auxiliary losses)
                return moe_loss(out, targets)
            losses = optax.softmax_cross_entropy_with_integer_labels(out, targets)
            return losses.mean() if s.packed is None else (losses * read[1]).sum() / read[1].sum()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    twin_losses = []
    for step in range(steps):
        state, loss = twin_step(state, windows_at(tokens, step, s.batch, config.seq_len, s.seed))
        twin_losses.append(float(loss))
    losses = [loss for _, loss, _, _ in trainer.run(tokens, 0, steps)]
    loss_diff = max(abs(a - b) for a, b in zip(losses, twin_losses, strict=True))
    sharded, twin = _by_path(trainer.params()), _by_path(jax.tree.map(np.asarray, state.params))
    if sorted(sharded) != sorted(twin):
        raise ValueError(f"--check: the sharded model's parameters {sorted(sharded)} are not the twin's")
    param_diff = max(  # NNX's attention kernels: (d, h, k) as (d, h * k)
        float(np.max(np.abs(sharded[path].reshape(b.shape) - b))) for path, b in twin.items()
    )
    return loss_diff, param_diff, losses, twin_losses


def past_warmup_zero(opt_state, warmup: int):
    """``opt_state`` with each optax step count (a ``count`` field) at 1 where a ``warmup``
    starts the schedule at 0, each on its own sharding: the first update that moves.

    >>> import optax, jax.numpy as jnp
    >>> state = optax.adam(1e-3).init(jnp.zeros(2))
    >>> int(past_warmup_zero(state, warmup=20)[0].count), int(past_warmup_zero(state, warmup=0)[0].count)
    (1, 0)
    """
    if not warmup:
        return opt_state

    def counted(path, leaf):
        if getattr(path[-1], "name", None) != "count":
            return leaf
        return jax.device_put(
            np.ones(np.shape(leaf), np.asarray(leaf).dtype), getattr(leaf, "sharding", None)
        )

    return jax.tree_util.tree_map_with_path(counted, opt_state)


def _by_path(tree) -> dict[tuple, np.ndarray]:
    """The leaves of a parameter tree by path, NNX's ``blocks/i`` read as Linen's ``block_i``
    (a layer count past 9 orders the two trees' leaves differently)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = lambda path: tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return {linen_path(keys(path)): leaf for path, leaf in flat}

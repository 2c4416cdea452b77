"""The mixture of experts both front ends' blocks compute (:func:`mixture`: route a group's
tokens, run the experts on their buffers, combine, and the two auxiliary losses), the MoE
LM's default sizes and the weights of its losses. Model code, as a user's would be: the plan
check reads its operations as the model's own (:mod:`fsdp_tp._trace.sites`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..routing import capacity, combine, dispatch, load_balancing_loss, route, router_z_loss

__all__ = ["AUX_WEIGHTS", "MOE_SIZES", "mixture", "moe_fields", "weighted"]

MOE_SIZES: dict[str, Any] = dict(
    vocab=32, d=16, heads=4, kv_heads=2, head_dim=4, hidden=32, layers=2, experts=4, top_k=2,
    capacity_factor=None, group_rows=1, shared_hidden=0, moe_every=1,
)  # fmt: skip
# The losses' weights in the language model's aux term (Switch's and ST-MoE's).
AUX_WEIGHTS = (1e-2, 1e-3)


def mixture(
    x: jax.Array,
    router: Callable[[jax.Array], jax.Array],
    experts: Callable[[jax.Array], jax.Array],
    *,
    k: int,
    capacity_factor: float | None,
    group_rows: int,
    normalize: bool = True,
    batch_axes: tuple | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The MoE of ``x`` ``(batch, seq, d)``, either front end's: ``router`` maps tokens to
    logits, ``experts`` buffers ``(groups, E, capacity, d)`` to outputs of that shape. Returns
    the output and ``(load_balancing, z)``."""
    b, s, d = x.shape
    if group_rows < 1 or b % group_rows:
        raise ValueError(
            f"mixture of experts: group_rows={group_rows!r} rows a group, but this device's batch has "
            f"{b} rows (shape {x.shape}); a group must be whole on one device: pass a group_rows that "
            f"divides the rows each device holds (1: a group is one sequence)."
        )
    groups = x.reshape(b // group_rows, group_rows * s, d)
    logits = router(groups)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # (the softmax in f32 or wider)
    tokens, count = groups.shape[1], logits.shape[-1]
    slots = capacity(tokens, k, count, capacity_factor)
    routing = jax.vmap(lambda group: route(group, k, slots, normalize))(logits)
    y = jax.vmap(combine)(experts(jax.vmap(dispatch)(groups, routing)), routing).reshape(b, s, d)
    fractions = jax.nn.one_hot(routing.chosen, count, dtype=logits.dtype).mean((0, 1, 2))
    balance = load_balancing_loss(fractions, routing.probs.mean((0, 1)), batch_axes)
    return y.astype(x.dtype), (balance, router_z_loss(logits))  # (over groups and tokens alike)


def moe_fields(s: dict) -> dict:
    keys = ("experts", "top_k", "hidden", "capacity_factor", "group_rows", "shared_hidden")
    return {key: s[key] for key in keys}


def weighted(losses: tuple[jax.Array, jax.Array]) -> jax.Array:
    (balance, z), (balance_weight, z_weight) = losses, AUX_WEIGHTS
    wide = lambda loss: loss.astype(jnp.promote_types(loss.dtype, jnp.float32))  # (f32 or wider)
    return balance_weight * wide(balance) + z_weight * wide(z)

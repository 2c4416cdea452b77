"""Token-choice routing for a mixture of experts, framework-free: which experts each token
goes to, where in their buffers, with what weight, and the losses that balance them.

A *group* is a set of tokens routed together: each expert takes at most ``capacity`` of a
group's choices (:func:`capacity`), in priority order: every token's first choice, in token
order, before any token's second. A choice past its expert's capacity is dropped (the token
keeps its other choices and the residual). ``capacity=None`` is *dropless*: an expert's buffer
holds the whole group, so nothing is dropped. Routing depends only on the group's tokens, so a
sharded model whose devices hold whole groups routes exactly as the unsharded one. Under a
step's sequence split a device holds a share of each sequence: dropless routing is exact there
(each token's choices are its own), a capacity is refused (the slots would fill in another
order than the unsharded model's).

:func:`route` picks (``jax.lax.top_k``: ties go to the lower expert index), :func:`dispatch`
places each kept choice in its expert's buffer ``(experts, capacity, d)`` (one token a slot),
:func:`combine` reads the experts' outputs back, weighted. The gradients are the plain
gather's and scatter's: exact.

>>> import jax.numpy as jnp
>>> logits = jnp.array([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # 3 tokens, 3 experts
>>> r = route(logits, k=1, capacity=1)   # expert 0 takes one token: the second is dropped
>>> r.chosen.ravel().tolist(), r.kept.ravel().tolist()
([0, 0, 2], [True, False, True])
>>> x = jnp.arange(6.0).reshape(3, 2)
>>> dispatch(x, r)[:, 0].tolist()   # each expert's one slot: tokens 0, (empty), 2
[[0.0, 1.0], [0.0, 0.0], [4.0, 5.0]]
>>> out = combine(dispatch(x, r), r)   # identity experts: each token times its weight, 0 if dropped
>>> [[round(v, 3) for v in row] for row in out.tolist()]
[[0.0, 0.665], [0.0, 0.0], [2.304, 2.881]]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ._axes import bound_axis_names
from ._batch import resolve_batch_axes
from ._sequence_split import sequence_split
from .gradients import batch_mean

__all__ = [
    "Routing",
    "capacity",
    "combine",
    "dispatch",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]


def capacity(tokens: int, k: int, experts: int, factor: float | None) -> int | None:
    """The slots an expert has for a group of ``tokens``: ``ceil(factor * k * tokens /
    experts)``, at most ``tokens`` (a token picks an expert once); ``None`` (dropless) for
    ``factor=None``."""
    if factor is None:
        return None
    if not factor > 0:
        raise ValueError(
            f"capacity factor {factor!r}: each expert takes ceil(factor * k * tokens / experts) of a "
            f"group's tokens, so it must be > 0 (1.25 is usual); pass None for dropless routing."
        )
    return min(tokens, math.ceil(factor * k * tokens / experts))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """One group's routing: for each token and choice (``(tokens, k)``) the expert
    (``chosen``), its weight, whether it was kept, and the slot ``expert * capacity +
    position`` it takes (``experts * capacity`` where dropped); ``probs``: the router's
    probabilities ``(tokens, experts)``."""

    chosen: jax.Array
    weights: jax.Array
    kept: jax.Array
    slots: jax.Array
    probs: jax.Array
    capacity: int = dataclasses.field(metadata=dict(static=True))

    @property
    def experts(self) -> int:
        return self.probs.shape[-1]


def route(logits: jax.Array, k: int, capacity: int | None = None, normalize: bool = True) -> Routing:
    """Each token's ``k`` experts by the softmax of its ``logits`` (``(tokens, experts)``),
    their weights (renormalized to sum to 1 over the ``k`` when ``normalize``), and their
    places in the experts' buffers of ``capacity`` slots (``None``: as many as tokens)."""
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"top-k routing with k={k!r} over {experts} experts: k must be 1..{experts}.")
    if capacity is not None:
        _require_whole_sequence(capacity, tokens)
    slots_each = tokens if capacity is None else capacity
    probs = jax.nn.softmax(logits, axis=-1)
    weights, chosen = jax.lax.top_k(probs, k)  # ties: the lower index first
    if normalize and k > 1:
        weights = weights / weights.sum(-1, keepdims=True)
    # Priority: every token's first choice before any token's second (choice-major order).
    onehot = jax.nn.one_hot(chosen.T.reshape(-1), experts, dtype=jnp.int32)  # (k * tokens, experts)
    position = (jnp.cumsum(onehot, axis=0) - 1)[jnp.arange(k * tokens), chosen.T.reshape(-1)]
    position = position.reshape(k, tokens).T
    kept = position < slots_each
    slots = jnp.where(kept, chosen * slots_each + position, experts * slots_each)
    return Routing(chosen, weights, kept, slots, probs, slots_each)


def _require_whole_sequence(capacity: int, tokens: int) -> None:
    """A capacity within a step that splits the sequence (``context``): refused, with the fix."""
    if (split := sequence_split()) is None:
        return
    axis, size = split
    raise ValueError(
        f"fsdp_tp.routing.route: capacity={capacity} slots an expert, in a step that splits the "
        f"sequence over {axis!r} ({size} devices): a device routes its {tokens} tokens of a group "
        f"whose other tokens other devices hold, so its slots fill in another order than the unsharded "
        f"model's and other tokens are dropped. Route dropless under the split (capacity_factor=None: "
        f"every choice kept, each token's own), or give the {axis!r} devices to the batch axes."
    )


def dispatch(x: jax.Array, routing: Routing) -> jax.Array:
    """The experts' buffers ``(experts, capacity, d)``: each kept choice's token in its slot,
    zeros in the slots no token took."""
    n, d = routing.experts * routing.capacity, x.shape[-1]
    k = routing.slots.shape[-1]
    rows = jnp.repeat(x, k, axis=0)  # (tokens * k, d), a token once per choice
    buffer = jnp.zeros((n + 1, d), x.dtype).at[routing.slots.reshape(-1)].add(rows)  # (one token a slot)
    return buffer[:n].reshape(routing.experts, routing.capacity, d)


def combine(y: jax.Array, routing: Routing) -> jax.Array:
    """Each token's output ``(tokens, d)``: its kept choices' expert outputs (``y``, shaped as
    :func:`dispatch`'s buffers) summed with their weights."""
    flat = y.reshape(-1, y.shape[-1])
    flat = jnp.concatenate([flat, jnp.zeros((1, flat.shape[-1]), flat.dtype)])  # the dropped's slot
    picked = flat[routing.slots]  # (tokens, k, d)
    return jnp.einsum("tkd,tk->td", picked, routing.weights.astype(y.dtype))


def load_balancing_loss(fractions: jax.Array, probs: jax.Array, batch_axes: tuple | None = None) -> jax.Array:
    """Switch Transformer's ``E * sum_e f_e * P_e`` over the *global* batch: ``fractions``
    (``f``: the share of this device's choices each expert got; it has no gradient) and
    ``probs`` (``P``: its tokens' mean router probabilities), both ``(experts,)``, each averaged
    over the batch axes before the product, so every device holds the global batch's loss and
    the mean's transpose gives each device's tokens their share of its gradient. A mean of
    per-device losses ``E * sum_e f_e^i * P_e^i`` is another loss (a product of means is not a
    mean of products). ``batch_axes``: left out, the step's (as a transform takes them);
    outside ``jax.shard_map`` (the unsharded model) nothing is averaged."""
    f = jax.lax.stop_gradient(fractions)
    if bound_axis_names():
        axes = resolve_batch_axes(batch_axes, "load_balancing_loss")
        f, probs = batch_mean((f, probs), axes) if axes else (f, probs)
    return probs.shape[-1] * jnp.sum(f * probs)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)

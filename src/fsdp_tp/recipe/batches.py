"""A step's batch as ``fsdp-tp train`` feeds it, and its loss: the windows of tokens (each
``(rows, seq_len + 1)``), or, under a sequence split, their inputs and targets laid out over
``context`` (and the MoE LM's positions, for its RoPE); packed, with their documents' segment
ids and loss weights (:func:`~fsdp_tp.recipe.data.packed`), the loss token-weighted over the
step's axes. What :class:`~fsdp_tp.recipe.trainer.Settings.batch_specs` says, built here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..gradients import global_mean_loss
from ..tp.pieces import vocab_parallel_cross_entropy
from .data import packed

__all__ = ["batch_loss", "split_windows", "window_loss"]


def window_loss(model: Any, params, windows: jax.Array) -> jax.Array:
    """Mean next-token loss of this device's windows ``(rows, seq_len + 1)`` under ``model``
    (its ``logits`` and ``objective``)."""
    return model.objective(model.logits(params, windows[:, :-1]), windows[:, 1:])


def batch_loss(model: Any, params, batch, axes=None, count=None) -> jax.Array:
    """:func:`window_loss` of windows, or of a sequence split's ``(inputs, targets)``; of packed
    documents ``(inputs, targets, segments, weights)``, the loss over the tokens ``weights``
    keeps, token-weighted over ``axes`` (its mean there the global one, however unevenly the
    devices count: :func:`~fsdp_tp.gradients.global_mean_loss`), ``count`` the tokens it
    counts here (default: ``weights``'; a microbatch's share of its batch's)."""
    if isinstance(batch, tuple) and len(batch) == 4:
        inputs, targets, segments, weights = batch
        losses = vocab_parallel_cross_entropy(model.logits(params, inputs, segments), targets)
        return global_mean_loss((losses * weights).sum(), weights.sum() if count is None else count, axes)
    if isinstance(batch, tuple):  # (inputs, targets[, positions])
        return model.objective(model.logits(params, batch[0], *batch[2:]), batch[1])
    return window_loss(model, params, batch)


def split_windows(settings: Any, windows: jax.Array):
    """The step's batch of ``windows`` ``(rows, seq_len + 1)``: themselves, or, under a sequence
    split, their inputs and targets, which the step lays out over ``context``; packed, with
    their documents (:func:`~fsdp_tp.recipe.data.packed`)."""
    if settings.packed is not None:
        return packed(windows, settings.packed)
    if settings.sequence is None:
        return windows
    if settings.model.experts:  # (the MoE LM's RoPE: each token's place in the whole sequence)
        positions = jnp.broadcast_to(jnp.arange(windows.shape[1] - 1, dtype=jnp.int32), windows[:, 1:].shape)
        return windows[:, :-1], windows[:, 1:], positions
    return windows[:, :-1], windows[:, 1:]

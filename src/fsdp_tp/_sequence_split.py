"""How a sequence is laid out over the ``context`` axis: :class:`SequenceSplit`; and, inside a
step's trace, the split it runs (:func:`sequence_split`, :func:`split_here`,
:func:`checked_here`).

A contiguous split gives device ``i`` of ``n`` tokens ``[i·S/n, (i+1)·S/n)``: under a causal
mask its queries see ``i + 1/2`` blocks of keys on average, so the last device does
``(2n-1)/n`` of the mean work (1.875x at ``n = 8``). Balanced (zigzag), the sequence is cut in
``2n`` chunks and device ``i`` holds chunks ``i`` and ``2n-1-i``: every device does the same
work. Every per-token array of a batch (tokens, labels, positions, segment ids, loss weights)
is laid out alike by :meth:`SequenceSplit.to_devices` on the way in and back by
:meth:`SequenceSplit.from_devices`, so a user's batch and outputs stay in the order they wrote.

>>> import jax.numpy as jnp
>>> split = SequenceSplit(balanced=True)
>>> split.to_devices(jnp.arange(8), dim=0, size=2).tolist()   # device 0: chunks 0, 3; device 1: 1, 2
[0, 1, 6, 7, 2, 3, 4, 5]
>>> split.from_devices(split.to_devices(jnp.arange(8), 0, 2), 0, 2).tolist()
[0, 1, 2, 3, 4, 5, 6, 7]
>>> split.token_index(1, 2, 4).tolist()    # device 1's tokens, in its local order
[2, 3, 4, 5]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ._axes import CONTEXT, bound_axis_names
from ._context import CHECK, STEP
from ._layout import axis_text, require_divisible

__all__ = [
    "STRATEGIES",
    "SequenceSplit",
    "checked_here",
    "document_positions",
    "next_token_targets",
    "sequence_split",
    "split_here",
]

STRATEGIES = ("ring", "all_to_all", "auto")
"""How attention is computed across the ``context`` axis: ``ring`` (k, v passed round),
``all_to_all`` (sequence split to head split and back), ``auto`` (the fewer bytes)."""


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position in its document, ``(..., S)`` integers from segment ids (a
    document's tokens contiguous, 0 padding, whose position is 0): what RoPE needs of a packed
    sequence, computed on the whole sequence before it is laid out, and laid out with it.

    >>> document_positions(jnp.array([1, 1, 1, 2, 2, 0, 0])).tolist()
    [0, 1, 2, 0, 1, 0, 0]
    """
    index = jnp.arange(segment_ids.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], -1
    )
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)
    return jnp.where(segment_ids == 0, 0, index - first)


def next_token_targets(
    tokens: jax.Array, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Each token's next token as its target, and the target's weight (float32): 0 for the
    last token, a padding token (segment id 0) and the last token of a document (its next is
    another document's), else 1. Computed on the whole batch before a step lays it out, and
    passed as batch leaves split like the tokens: a shift inside the step (``jnp.roll``,
    ``logits[:, :-1]``) pairs tokens across a device's chunks when the sequence is split.

    >>> targets, weights = next_token_targets(jnp.array([5, 6, 7, 8, 9, 0]), jnp.array([1, 1, 1, 2, 2, 0]))
    >>> targets.tolist(), weights.tolist()
    ([6, 7, 8, 9, 0, 0], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])

    With them the loss is the token-weighted mean of the whole batch under every split:
    ``global_mean_loss((ce * weights).sum(), weights.sum(), axes)`` in the step.
    """
    tokens = jnp.asarray(tokens)
    targets = jnp.concatenate([tokens[..., 1:], jnp.zeros_like(tokens[..., :1])], -1)
    last = jnp.arange(tokens.shape[-1]) < tokens.shape[-1] - 1
    keep = jnp.broadcast_to(last, tokens.shape)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != tokens.shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(
                f"next_token_targets: segment_ids must be integers of the tokens' shape "
                f"{tuple(tokens.shape)}, got {segment_ids.dtype} {tuple(segment_ids.shape)}; pass one id a "
                f"token (0 for padding), as fsdp_tp.context.document_positions takes them."
            )
        following = jnp.concatenate([segment_ids[..., 1:], jnp.zeros_like(segment_ids[..., :1])], -1)
        keep = keep & (segment_ids != 0) & (following == segment_ids)
    return targets, keep.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """The sequence split over mesh axis ``axis``: ``balanced`` (zigzag: device ``i`` of ``n``
    holds chunks ``i`` and ``2n-1-i`` of ``2n``) or contiguous (chunk ``i`` of ``n``), and how
    a step's attention crosses it (``strategy``: one of :data:`~fsdp_tp.context.STRATEGIES`,
    :func:`~fsdp_tp.context.attention`'s)."""

    axis: str = CONTEXT
    balanced: bool = True
    strategy: str = "ring"

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"SequenceSplit: strategy {self.strategy!r} is not one of {STRATEGIES}: 'ring' (k, v "
                f"passed round), 'all_to_all' (heads split instead), 'auto' (the fewer bytes)."
            )

    @property
    def parts(self) -> int:
        """The chunks a device holds: 2 balanced, 1 contiguous."""
        return 2 if self.balanced else 1

    def chunks(self, size: int) -> int:
        """The chunks the sequence is cut in over ``size`` devices."""
        return self.parts * size

    def chunk_of(self, device, part: int, size: int):
        """The global chunk that is part ``part`` of ``device``'s tokens (``device`` may be
        traced: ``jax.lax.axis_index``)."""
        return device if part == 0 else 2 * size - 1 - device

    def token_index(self, device, size: int, local: int) -> jax.Array:
        """The global index in the sequence of each of ``device``'s ``local`` tokens, in its
        local order (``device`` may be traced)."""
        width = local // self.parts
        return jnp.concatenate(
            [self.chunk_of(device, part, size) * width + jnp.arange(width) for part in range(self.parts)]
        )

    def _order(self, size: int) -> np.ndarray:
        """The global chunks in device order: device 0's parts, then device 1's, ..."""
        return np.array([self.chunk_of(d, p, size) for d in range(size) for p in range(self.parts)])

    def require_divides(self, length: int, size: int, where: str) -> None:
        """Raises ``IndivisibleShapeError`` unless ``length`` tokens cut into whole chunks."""
        chunks = self.chunks(size)
        by = (
            f"the chunks of a balanced split over {axis_text(self.axis)}"
            if self.balanced
            else axis_text(self.axis)
        )
        fix = f"pad it to {-(-length // chunks) * chunks} tokens"
        fix += f", or pass balanced=False (then a multiple of {size})" if self.balanced else ""
        require_divisible(where, "the sequence", length, by, chunks, fix)

    def to_devices(self, x: jax.Array, dim: int, size: int) -> jax.Array:
        """``x`` (a global array with the sequence on ``dim``) reordered so that splitting
        ``dim`` evenly over the ``size`` devices gives each its chunks."""
        return self._permute(x, dim, size, self._order(size))

    def from_devices(self, x: jax.Array, dim: int, size: int) -> jax.Array:
        """The inverse of :meth:`to_devices`: the sequence back in its order."""
        return self._permute(x, dim, size, np.argsort(self._order(size)))

    def _permute(self, x: jax.Array, dim: int, size: int, order: np.ndarray) -> jax.Array:
        dim = dim % x.ndim
        self.require_divides(x.shape[dim], size, "SequenceSplit")
        chunks = self.chunks(size)
        cut = x.reshape(*x.shape[:dim], chunks, x.shape[dim] // chunks, *x.shape[dim + 1 :])
        return jnp.take(cut, order, axis=dim).reshape(x.shape)


def sequence_split() -> tuple[str, int] | None:
    """The axis and size a step splits the sequence over here, in any trace of it, the plan
    check's too (``None``: whole, or one device): a call there is checked as the blocks of the
    model on the whole sequence, and what cannot split so (a routing capacity) is refused."""
    split = STEP.get().sequence
    if split is None or split.axis not in bound_axis_names():
        return None
    size = jax.lax.axis_size(split.axis)
    return (split.axis, size) if size > 1 else None


def split_here() -> SequenceSplit | None:
    """The step's sequence split where its axis is bound (inside its per-device trace), else
    ``None``: attention called here computes across the axis. In the plan check's own traces
    (``unringed``) it is ``None``: there attention is :func:`on_device`'s."""
    split = STEP.get().sequence
    if split is None or CHECK.get().unringed or split.axis not in bound_axis_names():
        return None
    return split


def checked_here() -> bool:
    """Whether this is the plan check's trace of a call in a step that splits the sequence:
    attention is then :func:`on_device`'s, the library's own operations in both of the check's
    traces (a device's, the whole sequence's), which it carries as it carries a collective."""
    split = STEP.get().sequence
    return split is not None and CHECK.get().unringed and split.axis in bound_axis_names()

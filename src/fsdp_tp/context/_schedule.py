"""The ring's schedule: which blocks of scores a device computes on each hop (:class:`Schedule`).

On hop ``h`` of ``n``, device ``me`` holds the keys of device ``me - h``. A device's tokens are
``parts`` chunks (2 balanced: zigzag; 1 contiguous), so each hop brings ``parts²`` blocks
``(query part, key part)``, each with its mask (causal, and segment ids for packed documents)
and its place in the unsharded ``(S, S)`` scores, which attention dropout draws its mask at.
The forward, the backward and :func:`blocks_run` go through the same list, so the work counted
is the work run.

>>> blocks_run(4, 64), blocks_run(4, 64, balanced=False)   # zigzag: the same work everywhere
([9, 9, 9, 9], [1, 2, 3, 4])
"""

from __future__ import annotations

import dataclasses

import jax

from .._sequence_split import SequenceSplit
from . import _blocks

__all__ = ["Schedule", "blocks_run"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The blocks a ring over ``split``'s axis runs, ``causal`` or not, within a sliding
    ``window`` where one is given (a block wholly outside it is skipped: a layer's work grows
    with the window, not the sequence)."""

    split: SequenceSplit
    causal: bool
    window: int | None = None

    def place(self, q, segments):
        """This device's place on the ring ``(n, me)``, its queries' indices ``(parts, c)``
        and segment ids ``(B, parts, c)``, for its queries ``q`` ``(B, L, ...)``."""
        axis, parts = self.split.axis, self.split.parts
        n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        b, length = q.shape[:2]
        q_index = self.split.token_index(me, n, length).reshape(parts, -1)
        return n, me, q_index, None if segments is None else segments.reshape(b, parts, -1)

    def visiting(self, source, n: int, length: int, q_index, q_segments, segments_all) -> list:
        """Each ``(query part, key part, mask)`` of the block device ``source``'s keys make
        with this device's queries (``segments_all``: every device's segment ids, or ``None``)."""
        k_index, k_segments = self._keys_of(source, n, length, segments_all)
        mask = lambda a, p: _blocks.causal_mask(
            q_index[a], k_index[p], _part(q_segments, a), _part(k_segments, p), self.causal, self.window
        )
        return [(a, p, mask(a, p)) for a in range(self.split.parts) for p in range(self.split.parts)]

    def starts(self, me, source, n: int, a: int, p: int, c: int):
        """Where this device's query part ``a`` and device ``source``'s key part ``p`` start
        in the whole sequence (chunks of ``c`` tokens)."""
        return self.split.chunk_of(me, a, n) * c, self.split.chunk_of(source, p, n) * c

    def _keys_of(self, source, n: int, length: int, segments_all):
        """The indices ``(parts, c)`` and segment ids ``(B, parts, c)`` of ``source``'s tokens."""
        parts = self.split.parts
        index = self.split.token_index(source, n, length).reshape(parts, length // parts)
        if segments_all is None:
            return index, None
        segments = jax.lax.dynamic_index_in_dim(segments_all, source, 0, keepdims=False)
        return index, segments.reshape(segments.shape[0], parts, -1)


def _part(x, a: int):
    return None if x is None else x[:, a]


def blocks_run(
    size: int, length: int, causal: bool = True, balanced: bool = True, window: int | None = None
) -> list[int]:
    """The blocks of scores each of ``size`` devices computes for a sequence of ``length``
    tokens (one document), a block wholly masked skipped: the ring's own schedule, counted.
    A block is ``(length / size / parts)²`` entries (``parts``: 2 balanced, 1 contiguous).

    >>> blocks_run(8, 128), blocks_run(8, 128, balanced=False)   # zigzag: 17 blocks each
    ([17, 17, 17, 17, 17, 17, 17, 17], [1, 2, 3, 4, 5, 6, 7, 8])
    >>> blocks_run(8, 1024, window=64)   # a window of 64: each 64-token chunk and the one before
    [3, 4, 4, 4, 4, 4, 4, 4]
    """
    schedule, local = Schedule(SequenceSplit(balanced=balanced), causal, window), length // size
    ran = []
    for me in range(size):
        q_index = schedule.split.token_index(me, size, local).reshape(schedule.split.parts, -1)
        visits = [schedule.visiting((me - h) % size, size, local, q_index, None, None) for h in range(size)]
        ran.append(sum(int(_blocks.live(mask)) for visit in visits for _, _, mask in visit))
    return ran

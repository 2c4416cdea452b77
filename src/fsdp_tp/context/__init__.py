"""Context parallelism: the sequence split over a ``context`` mesh axis, and attention computed
across it, equal to the unsharded model's.

:class:`SequenceSplit` lays a sequence out over the axis (balanced by default: every device
does the same causal work); :func:`ring_attention` computes attention of a device's queries
over every device's keys and values, passed round the ring; :func:`all_to_all_attention` by
turning the sequence split into a head split and back; :func:`attention` picks either, with
flax's attention dropout where asked (:class:`AttentionDropout`, the unsharded mask). A
train step whose batch spec names ``context`` on the sequence dim (``P("data", "context")``)
lays its batch out so (:mod:`fsdp_tp.train._sequence_layout`) and computes the library's
attention across the axis (:mod:`._across`).
"""

from .._sequence_split import STRATEGIES, SequenceSplit, document_positions, next_token_targets
from ._all_to_all import all_to_all_attention, all_to_all_bytes, attention, ring_or_all_to_all
from ._dropout import AttentionDropout
from ._ring import ring_attention, ring_bytes
from ._schedule import blocks_run

__all__ = [
    "STRATEGIES",
    "AttentionDropout",
    "SequenceSplit",
    "all_to_all_attention",
    "all_to_all_bytes",
    "attention",
    "blocks_run",
    "document_positions",
    "next_token_targets",
    "ring_attention",
    "ring_bytes",
    "ring_or_all_to_all",
]

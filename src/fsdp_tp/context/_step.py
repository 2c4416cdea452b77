"""The sequence split as a train step runs it: which batch dims the ``context`` axis splits
(:func:`step_split`), the batch laid out over it on the way in and the outputs back
(:class:`LaidOut`), and attention inside the step computed across it (:func:`split_here`,
:func:`across`, :func:`jax_attention_across`).

A batch spec that names ``context`` on a leaf's dim past the first (``P("data", "context")``:
the sequence dim) is the whole request: :func:`~fsdp_tp.shard_step` lays each such leaf out as
:class:`~fsdp_tp.context.SequenceSplit` says (balanced by default), so the devices' tokens are
the chunks the ring expects, and puts the outputs it returns back in the user's order. Inside,
the axis is a batch axis (gradients and FSDP's gathers average over it) and the library's
attention (:func:`fsdp_tp.attention.attend`, and ``jax.nn.dot_product_attention`` as the
model calls it) computes over every device's keys.

>>> from jax.sharding import PartitionSpec as P
>>> step_split({"tokens": P("data", "context"), "doc": P("data")}, {"data": 2, "context": 4})
SequenceSplit(axis='context', balanced=True, strategy='ring')
>>> step_split(P("data"), {"data": 8}) is None
True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._axes import bound_axis_names, entry_axes
from .._context import CHECK, STEP
from .._types import Specs
from . import _blocks
from ._all_to_all import attention
from ._split import SequenceSplit

__all__ = [
    "LaidOut",
    "across",
    "checked_here",
    "jax_attention_across",
    "on_device",
    "sequence_split",
    "split_here",
    "step_split",
]

_is_spec = lambda s: isinstance(s, PartitionSpec)


def _dims_over(spec: PartitionSpec, axis: str) -> list[tuple[int, Any]]:
    """The dims of ``spec`` whose entry names ``axis``, with the entry."""
    return [(dim, entry) for dim, entry in enumerate(spec) if axis in entry_axes(entry)]


def step_split(
    batch_specs: Specs,
    sizes: Mapping[str, int],
    given: SequenceSplit | None = None,
    where: str = "shard_step",
) -> SequenceSplit | None:
    """The sequence split ``batch_specs`` ask for on a mesh of ``sizes``: ``given`` (or the
    default :class:`SequenceSplit`) where a leaf's dim past the first is split over its axis,
    else ``None``. Refused: the axis sharing a dim with another axis, or on dim 0 (a batch
    axis there, not the sequence's), and a ``given`` split its batch specs do not name."""
    split = given or SequenceSplit()
    specs = [s for s in jax.tree.leaves(batch_specs, is_leaf=_is_spec) if _is_spec(s)]
    found = False
    for spec in specs:
        for dim, entry in _dims_over(spec, split.axis):
            if dim == 0 or entry != split.axis:
                raise ValueError(
                    f"{where}: batch spec {spec} names the sequence axis {split.axis!r} "
                    f"{'on dim 0, the rows' if dim == 0 else f'with other axes on dim {dim} ({entry!r})'}; "
                    f"the sequence split takes a dim of its own past the rows: P(('data', 'fsdp'), "
                    f"{split.axis!r}) for (rows, tokens, ...)."
                )
            found = True
    if not found:
        if given is not None:
            raise ValueError(
                f"{where}: sequence={given} splits the sequence over {split.axis!r}, but no batch spec "
                f"names {split.axis!r} ({specs}); split each per-token leaf's sequence dim over it, "
                f"e.g. P('data', {split.axis!r})."
            )
        return None
    if split.axis not in sizes:
        raise ValueError(
            f"{where}: the batch specs split the sequence over {split.axis!r}, which is no axis of the "
            f"mesh ({dict(sizes)}); add it (make_mesh({{..., {split.axis!r}: n}})) or drop it from the specs."
        )
    return split


def _normal(spec: PartitionSpec) -> tuple:
    """``spec``'s entries, trailing ``None`` dropped: ``P("data", "context")`` is
    ``P("data", "context", None)``."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """``split`` over ``size`` devices, applied to trees by their specs: each leaf of the batch
    whose spec splits a dim over the split's axis is reordered on that dim (:meth:`batch`, the
    way in), and each output laid out as such a leaf of ``batch_specs`` is, back
    (:meth:`outputs`): a per-token output, never a parameter's gradient stored over the axis."""

    split: SequenceSplit
    size: int
    batch_specs: Specs

    def batch(self, tree: Any) -> Any:
        return self._each(tree, self.batch_specs, self.split.to_devices, None)

    def tokens(self, tree: Any) -> int | None:
        """A device's tokens a sequence in its block of the batch ``tree`` (``None``: the
        leaves the split lays out differ in length)."""
        found: set[int] = set()

        def each(spec, sub):
            if _is_spec(spec) and (dims := _dims_over(spec, self.split.axis)):
                found.update(x.shape[dims[0][0]] for x in jax.tree.leaves(sub))

        jax.tree.map(each, self.batch_specs, tree, is_leaf=_is_spec)
        return found.pop() if len(found) == 1 else None

    def outputs(self, tree: Any, specs: Specs) -> Any:
        per_token = {
            _normal(s)
            for s in jax.tree.leaves(self.batch_specs, is_leaf=_is_spec)
            if _is_spec(s) and _dims_over(s, self.split.axis)
        }
        return self._each(tree, specs, self.split.from_devices, per_token)

    def _each(self, tree, specs, move, only: set | None):
        def leaf(spec, x):
            dims = _dims_over(spec, self.split.axis) if _is_spec(spec) else []
            if not dims or (only is not None and _normal(spec) not in only):
                return x
            return move(x, dims[0][0], self.size)

        each = lambda spec, sub: jax.tree.map(lambda x: leaf(spec, x), sub)
        return jax.tree.map(each, specs, tree, is_leaf=_is_spec)


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


def on_device(q, k, v, segment_ids=None, *, causal: bool = True, scale=None):
    """Attention of ``q`` ``(..., S, H, D)`` over ``k``, ``v`` ``(..., S, G, D)``, all of it on
    this device, by the ring's own block (:mod:`._blocks`): what the check traces in its place."""
    lead, (length, heads, dim), groups = q.shape[:-3], q.shape[-3:], k.shape[-2]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    qs, ks, vs = fold(q), fold(k), fold(v)
    qs = qs.reshape(*qs.shape[:2], groups, heads // groups, dim)
    segments = None if segment_ids is None else segment_ids.reshape(-1, length)
    index = jnp.arange(length)
    mask = _blocks.causal_mask(index, index, segments, segments, causal)
    return _blocks.whole(qs, ks, vs, mask, scale).reshape(*lead, length, heads, dim).astype(q.dtype)


def across(
    split: SequenceSplit,
    q,
    k,
    v,
    segment_ids=None,
    *,
    causal: bool = True,
    scale=None,
    dropout=None,
    key=None,
):
    """Attention of ``q`` ``(..., L, H, D)`` over ``k``, ``v`` ``(..., L, G, D)`` (a device's
    tokens) across ``split``'s axis, by its strategy; leading dims folded into the batch
    (``dropout``, ``key``: :func:`~fsdp_tp.context.ring_attention`'s)."""
    lead = q.shape[:-3]
    fold = lambda t: t.reshape(-1, *t.shape[-3:])
    segments = None if segment_ids is None else segment_ids.reshape(-1, segment_ids.shape[-1])
    out = attention(
        fold(q),
        fold(k),
        fold(v),
        segments,
        strategy=split.strategy,
        axis=split.axis,
        causal=causal,
        balanced=split.balanced,
        scale=scale,
        dropout=dropout,
        key=key,
    )
    return out.reshape(*lead, *out.shape[-3:])


_JAX_ATTENTION = jax.nn.dot_product_attention


def _jax_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **rest):
    """``jax.nn.dot_product_attention`` within a step that splits the sequence: computed across
    the axis where it can be (no ``bias`` or ``mask``: both are built from a device's local
    shapes), refused otherwise."""
    split = split_here()
    if split is None and checked_here() and bias is None and mask is None:
        return on_device(query, key, value, causal=is_causal, scale=scale)
    if split is None:
        return _JAX_ATTENTION(query, key, value, bias, mask, scale=scale, is_causal=is_causal, **rest)
    given = {"bias": bias, "mask": mask, **{k: v for k, v in rest.items() if k != "implementation"}}
    if named := [name for name, value in given.items() if value is not None and value is not False]:
        raise ValueError(
            f"jax.nn.dot_product_attention({', '.join(f'{n}=...' for n in named)}) inside a step that "
            f"splits the sequence over {split.axis!r}: a mask or bias the model builds holds a device's "
            f"tokens only, and the attention across devices cannot read it. Pass is_causal=True for a "
            f"causal mask, and packed documents' segment ids through "
            f"fsdp_tp.attention.attend(q, k, v, segment_ids=...)."
        )
    if query.ndim == 3:  # (T, N, H): one sequence
        return across(split, query[None], key[None], value[None], causal=is_causal, scale=scale)[0]
    return across(split, query, key, value, causal=is_causal, scale=scale)


@contextlib.contextmanager
def jax_attention_across(split: SequenceSplit | None) -> Iterator[None]:
    """Within (a step's per-device trace, where ``split`` is not ``None``):
    ``jax.nn.dot_product_attention`` computes across the split's axis (:func:`_jax_attention`),
    as a model calls it by that name. Reset when the trace ends."""
    if split is None:
        yield
        return
    jax.nn.dot_product_attention = _jax_attention
    try:
        yield
    finally:
        jax.nn.dot_product_attention = _JAX_ATTENTION

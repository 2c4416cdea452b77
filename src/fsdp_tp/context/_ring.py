"""Ring attention over the ``context`` axis: :func:`ring_attention`.

Each device keeps its queries; the keys and values (only the kv heads) go round the ring by
``ppermute``, one hop a step, and each device merges the block it holds into a running softmax
(:mod:`._blocks`), so no device ever holds more than one block of scores per head. The next
hop's transfer is issued before the current block is computed, so the compiled schedule can
overlap them. A block every entry of which is masked is skipped (``lax.cond``).

The backward is a custom VJP that sends the keys and values round again (not kept from the
forward: :func:`_backward_hop`), with the gradients of the visiting block's keys and values
(accumulated by every device, in the softmax's dtype) one hop behind them and one hop more at
the end, which brings each home. Per layer and device, with ``B`` sequences of ``S`` tokens
over ``n`` devices, ``G`` kv heads of ``D`` dims, ``b`` bytes an element (``b_acc`` accumulated):

- forward: ``n-1`` hops of ``k`` and ``v``: ``2(n-1)/n · B·S·G·D·b``, as all-gathering them;
- backward: ``k`` and ``v`` again, plus ``n`` hops of their gradients:
  ``2(n-1)/n · B·S·G·D·b + 2 · B·S·G·D·b_acc``.

Segment ids (packed documents) are all-gathered once a call (``B·S`` integers). Attention
dropout (:class:`~fsdp_tp.context._dropout.AttentionDropout`) sends nothing: each block draws
its block of the unsharded mask from the key, in the forward and again in the backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .._axes import CONTEXT, checks_vma, require_axes, varying_axes
from .._context import STEP
from .._layout import require_divisible
from .._sequence_split import SequenceSplit
from . import _blocks
from ._dropout import AttentionDropout
from ._schedule import Schedule

__all__ = ["dropout_key", "require_shapes", "ring_attention", "ring_bytes"]


@dataclasses.dataclass(frozen=True)
class _Ring:
    schedule: Schedule
    scale: float
    dropout: AttentionDropout | None = None


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    axis: str = CONTEXT,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
    dropout: AttentionDropout | None = None,
    key: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """Softmax attention of this device's queries ``q`` ``(B, L, H, D)`` over the whole
    sequence's keys and values, of which this device holds ``k``, ``v`` ``(B, L, G, D)`` (``H``
    a multiple of ``G``: grouped-query attention, each kv head sent once). Call inside
    ``jax.shard_map`` with the sequence split over ``axis`` as :class:`SequenceSplit` lays it
    out (``balanced``: zigzag, the default; else contiguous). ``segment_ids`` ``(B, L)``: each
    token's document (a query sees keys of its own document only; 0 is padding, which no query
    sees and whose output is 0). The softmax is in float32 (float64 inputs: float64).
    ``dropout`` with ``key`` (the unsharded model's dropout key): the weights dropped as the
    unsharded attention drops them, each block with its block of the mask. ``window``: a
    sliding window (causal; each query sees itself and the ``window - 1`` tokens before it),
    the blocks wholly outside it skipped.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> from fsdp_tp.attention import attend
    >>> mesh = make_mesh({"context": 4}, devices=jax.devices()[:4])
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 4, 8))   # 16 tokens, 4 heads
    >>> from fsdp_tp.context import SequenceSplit
    >>> split = SequenceSplit()
    >>> seq = P(None, "context")
    >>> ring = jax.jit(jax.shard_map(ring_attention, mesh=mesh, in_specs=seq, out_specs=seq))
    >>> out = split.from_devices(ring(*(split.to_devices(t, 1, 4) for t in (q, k, v))), 1, 4)
    >>> bool(jnp.allclose(out, attend(q, k, v), atol=1e-5))
    True
    """
    require_axes(axis, "ring_attention")
    split = SequenceSplit(axis, balanced)
    require_shapes(q, k, v, segment_ids, split)
    ring = _Ring(Schedule(split, causal, window), q.shape[-1] ** -0.5 if scale is None else scale, dropout)
    q, k, v = _alike(axis, q, k, v)
    return _attention(ring, q, k, v, segment_ids, dropout_key(dropout, key))


def ring_bytes(rows: int, length: int, kv_heads: int, head_dim: int, size: int, dtype) -> tuple[int, int]:
    """The bytes :func:`ring_attention` sends a device per call, ``(forward, backward)``, for
    ``rows`` sequences of ``length`` tokens split over ``size`` devices, ``kv_heads`` kv heads
    of ``head_dim`` dims on this device, keys and values of ``dtype`` (the formulas above; the
    gradients accumulate in the softmax's dtype). A plan or a benchmark checks a compiled
    program's collective-permutes against these.

    >>> ring_bytes(8, 256, 1, 16, 2, "float32")   # forward as all-gathering k, v; backward + dk, dv home
    (131072, 393216)
    """
    elements = rows * length * kv_heads * head_dim
    forward = 2 * (size - 1) * elements * jnp.dtype(dtype).itemsize // size
    return forward, forward + 2 * elements * _blocks.compute_dtype(dtype).itemsize


def dropout_key(dropout: AttentionDropout | None, key):
    """The key's data (uint32: the custom VJP's operand, no cotangent), or ``None``."""
    if dropout is None:
        return None
    if key is None:
        raise ValueError(
            f"ring_attention: dropout={dropout} without a key; pass key= the unsharded model's dropout "
            f"key (its mask is drawn from it, a block on each device)."
        )
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return jax.random.key_data(key)[..., :2] if typed else key


def _alike(axis: str, *arrays):
    """``arrays`` typed to vary over every mesh axis one of them does, and ``axis`` (under
    ``check_vma``): what the ring's blocks vary over (each hop's k, v, the mask's place on the
    ring). Inside a model's ``nn.scan`` a layer's input may be typed narrower than its values
    are; the cast's transpose sums the cotangents over what it adds, as JAX's own would."""
    if not checks_vma(axis):
        return arrays
    axes = frozenset({axis}).union(*(varying_axes(a) for a in arrays))
    widen = lambda a: jax.lax.pcast(a, tuple(sorted(axes - varying_axes(a), key=str)), to="varying")
    return tuple(widen(a) if axes - varying_axes(a) else a for a in arrays)


def require_shapes(q, k, v, segment_ids, split: SequenceSplit) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"ring_attention: q {q.shape}, k {k.shape}, v {v.shape}; pass q (batch, tokens, heads, dim) "
            f"and k, v (batch, tokens, kv_heads, dim) of one shape."
        )
    (b, length, heads, dim), (_, k_length, groups, k_dim) = q.shape, k.shape
    if k.shape[0] != b or k_length != length or k_dim != dim or heads % groups:
        raise ValueError(
            f"ring_attention: q {q.shape} and k, v {k.shape} do not fit: pass the same batch, tokens "
            f"and head dim, and kv heads that divide the {heads} query heads."
        )
    by, fix = "the chunks a balanced split gives a device", "pass balanced=False"
    if STEP.get().sequence is not None:  # (the step laid the tokens out whole: the step's code cut them)
        fix = (
            "the step lays each device's tokens out in whole chunks, so the step's code cut them "
            "(tokens[:, :-1]): call the model on the batch's tokens and shift the targets with the "
            "batch, before the step lays it out: targets, weights = "
            "fsdp_tp.context.next_token_targets(tokens, segment_ids)"
        )
    require_divisible("ring_attention", "a device's tokens", length, by, split.parts, fix)
    if segment_ids is not None and segment_ids.shape != (b, length):
        raise ValueError(
            f"ring_attention: segment_ids {segment_ids.shape}; pass one document id per token, {(b, length)}."
        )


def _hop(x, axis: str):
    """One step round the ring: device ``j``'s ``x`` to device ``j + 1``."""
    n = jax.lax.axis_size(axis)
    return jax.lax.ppermute(x, axis, [(j, (j + 1) % n) for j in range(n)])


def _backward_hop(kv: tuple, axis: str) -> tuple:
    """The keys' and values' hop in the backward (its own name: a test breaks it alone), the two
    sent as one array. The forward's hops of the same k and v, XLA would merge the two rings
    (CSE; an ``optimization_barrier`` did not stop it on CPU) and keep every device's k and v
    from the forward to the backward: the whole sequence's, where a device holds one block."""
    k, v = _hop(jnp.stack(kv), axis)
    return k, v


def _drawn(ring: _Ring, key, shape, groups: int, starts, total: int, dtype):
    """This block's dropout multipliers (``None``: no dropout), drawn where the block runs."""
    if ring.dropout is None:
        return None
    return ring.dropout.keep(key, shape, groups, starts, total, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(ring: _Ring, q, k, v, segments, key):
    return _forward(ring, q, k, v, segments, key)[0]


def _forward(ring: _Ring, q, k, v, segments, key):
    schedule = ring.schedule
    axis, parts = schedule.split.axis, schedule.split.parts
    b, length, heads, dim = q.shape
    groups, c = k.shape[2], length // parts
    ct = _blocks.compute_dtype(q.dtype)
    n, me, q_index, q_segments = schedule.place(q, segments)
    segments_all = None if segments is None else jax.lax.all_gather(segments, axis)  # (once a call)
    qs = q.reshape(b, parts, c, groups, heads // groups, dim)
    states = [_blocks.empty(qs[:, a]) for a in range(parts)]
    kv = (k, v)
    for hop in range(n):
        ahead = _hop(kv, axis) if hop < n - 1 else kv  # (issued before this block is computed)
        ks, vs = (t.reshape(b, parts, c, groups, dim) for t in kv)
        source = (me - hop) % n
        for a, p, mask in schedule.visiting(source, n, length, q_index, q_segments, segments_all):
            starts = schedule.starts(me, source, n, a, p, c)
            keep = functools.partial(_drawn, ring, key, (b, heads, c, c), groups, starts, n * length, ct)
            block = functools.partial(_merged, qs[:, a], ks[:, p], vs[:, p], mask, ring.scale, keep)
            states[a] = jax.lax.cond(_blocks.live(mask), block, lambda state: state, states[a])
        kv = ahead
    finished = [_blocks.finish(state) for state in states]
    out = jnp.stack([o for o, _ in finished], 1).reshape(q.shape).astype(q.dtype)
    lse = jnp.stack([m for _, m in finished], 1)  # (B, parts, G, r, c)
    return out, (q, k, v, segments, segments_all, key, out, lse)


def _merged(q, k, v, mask, scale, keep, state):
    return _blocks.merge(state, _blocks.forward(q, k, v, mask, scale, keep()))


def _backward(ring: _Ring, residuals, g):
    q, k, v, segments, segments_all, key, out, lse = residuals
    schedule = ring.schedule
    axis, parts = schedule.split.axis, schedule.split.parts
    b, length, heads, dim = q.shape
    groups, c = k.shape[2], length // parts
    ct = _blocks.compute_dtype(q.dtype)
    n, me, q_index, q_segments = schedule.place(q, segments)
    shape = (b, parts, c, groups, heads // groups, dim)
    qs, dos = q.reshape(shape), g.reshape(shape)
    rows = (dos.astype(ct) * out.reshape(shape).astype(ct)).sum(-1)
    delta = jnp.moveaxis(rows, 2, -1)  # (B, parts, G, r, c)
    dq = [_blocks.empty(qs[:, a])[2] for a in range(parts)]
    zeros = _blocks._typed_as(jnp.zeros((b, parts, c, groups, dim), ct), k)
    kv, grads = (k, v), (zeros, zeros)
    for hop in range(n):
        ahead = _backward_hop(kv, axis) if hop < n - 1 else kv
        source = (me - hop) % n
        ks, vs = (t.reshape(b, parts, c, groups, dim) for t in kv)
        dks, dvs = [grads[0][:, p] for p in range(parts)], [grads[1][:, p] for p in range(parts)]
        for a, p, mask in schedule.visiting(source, n, length, q_index, q_segments, segments_all):
            starts = schedule.starts(me, source, n, a, p, c)
            keep = functools.partial(_drawn, ring, key, (b, heads, c, c), groups, starts, n * length, ct)
            rows = (qs[:, a], ks[:, p], vs[:, p], dos[:, a], lse[:, a], delta[:, a])
            block = functools.partial(_added, *rows, mask, ring.scale, keep)
            dq[a], dks[p], dvs[p] = jax.lax.cond(
                _blocks.live(mask), block, lambda sums: sums, (dq[a], dks[p], dvs[p])
            )
        grads = _hop((jnp.stack(dks, 1), jnp.stack(dvs, 1)), axis)  # (behind k, v; home at the end)
        kv = ahead
    dq_all = jnp.stack(dq, 1).reshape(q.shape).astype(q.dtype)
    dk, dv = (t.reshape(k.shape).astype(k.dtype) for t in grads)
    return dq_all, dk, dv, None, None


def _added(q, k, v, do, lse, delta, mask, scale, keep, sums):
    dq, dk, dv = _blocks.backward(q, k, v, do, lse, delta, mask, scale, keep())  # (drawn again)
    return sums[0] + dq, sums[1] + dk, sums[2] + dv


_attention.defvjp(_forward, _backward)

"""Megatron's tensor-parallel pieces, once: what a column, a row and a vocabulary-parallel
layer do around their local computation. Framework-free (no ``flax.linen``).

Every tensor-parallel path of the library computes through these functions: the layers of
:mod:`fsdp_tp.linen.layers` (``ColumnParallelDense``, ``RowParallelDense``,
``VocabParallelEmbed``, the blocks) and the tp-rule roles of :mod:`fsdp_tp.tp`
(``ColumnParallel``, ``RowParallel``, ``HeadParallel``, ``VocabParallel``) that put them
around a module the user did not write, in either front end. A new role composes these; it does not write a
collective of its own.

- :func:`column_input`: the input of column-parallel layers — Megatron's *f* (identity
  forward, sum backward), or in sequence-parallel mode the all-gather of the sequence
  (whose backward reduce-scatters), or its ``ppermute`` ring; once per activation within
  :func:`shared_column_inputs` (a gated MLP's gate and up: one backward all-reduce);
- :func:`row_reduce`: the partial products of a row-parallel layer summed over the axis
  (Megatron's *g*), or reduce-scattered along the sequence;
- :func:`add_bias_once`: a row-parallel layer's bias, whole on every device, added once
  after the reduction;
- :func:`kept_block`: this device's block of a parameter kept whole over the axis (kv heads
  fewer than devices: each device reads the one its query heads use), its gradient summed;
- :func:`vocab_lookup`: the rows of a vocabulary-split table for the ids this device holds,
  zeros for the rest (summed by :func:`row_reduce`);
- :func:`vocab_parallel_cross_entropy`: the loss of logits split on the vocabulary, from
  per-token scalars only (the logits are never gathered); these two are defined in
  :mod:`fsdp_tp.tp._vocab_pieces`.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
>>> x, w, b = jnp.arange(8.0).reshape(1, 8) / 8, jnp.ones((8, 3)), jnp.arange(3.0)
>>> def row(x_slice, w_slice):   # each device holds 2 of the 8 input features and rows of w
...     return add_bias_once(row_reduce(x_slice @ w_slice, "tensor"), b, "tensor")
>>> out = jax.shard_map(row, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")), out_specs=P())(x, w)
>>> bool(jnp.allclose(out, x @ w + b))   # the bias once, not four times
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.extend
import jax.numpy as jnp

from .._context import STEP
from .._layout import axis_text, require_divisible
from .._renamed import RENAMED, renamed_keywords
from .._types import AxisName
from ..collective_matmul import RingChunks, ring_all_gather
from ..collectives import copy_to_axis, reduce_from_axis
from ..dropout import split_after
from ..errors import warn
from ._vocab_pieces import vocab_lookup, vocab_parallel_cross_entropy, vocab_start

__all__ = [
    "add_bias_once",
    "column_input",
    "kept_block",
    "require_kept_blocks",
    "row_reduce",
    "shared_column_inputs",
    "vocab_lookup",
    "vocab_parallel_cross_entropy",
    "vocab_start",
]


@contextlib.contextmanager
def shared_column_inputs() -> Iterator[None]:
    """Within (``shard_step`` traces every step in it), column-parallel layers that read the
    same activation in the same trace share its :func:`column_input`: their input gradients
    are summed before the one backward all-reduce (or reduce-scatter). A gated MLP's gate and
    up, or attention's separate q and kv projections, pay one, as Megatron's block does; each
    its own would all-reduce a gradient per layer (8 where a 2-layer gated model needs 6)."""
    # {(id, what, ...): (activation, trace, what a layer made of it)} while the step traces
    with STEP.scoped(column_inputs={}):
        yield


@renamed_keywords("tp.pieces.column_input")
def column_input(
    x: jax.Array, axis: AxisName, sequence_dim: int | None = None, collective_matmul: str | None = None
) -> jax.Array | RingChunks:
    """The input of column-parallel layers, once however many layers read it (within
    :func:`shared_column_inputs`): *f*, or the sequence all-gather (``sequence_dim`` set),
    or its ring (``collective_matmul`` set)."""
    make = lambda: _column_input(x, axis, sequence_dim, collective_matmul)
    return once(x, ("column", axis, sequence_dim, collective_matmul), make)


def once(x: jax.Array, key: tuple, make: Callable[[], object]):
    """``make()``, the collective a layer puts on its input ``x``, once for every layer of the
    trace that reads ``x`` with the same ``key`` (within :func:`shared_column_inputs`)."""
    shared = STEP.get().column_inputs
    if shared is None:
        return make()
    key = (id(x), *key)
    # Another trace (a remat, a scan body) cannot use this one's value: it computes its own.
    trace = jax.extend.core.get_opaque_trace_state(convention="fsdp_tp")
    if (hit := shared.get(key)) is not None and hit[0] is x and hit[1] == trace:
        return hit[2]
    shared[key] = (x, trace, make())
    return shared[key][2]


def _column_input(x, axis, sequence_dim, collective_matmul):
    if sequence_dim is None:
        return copy_to_axis(x, axis)
    if collective_matmul is not None:
        return ring_all_gather(x, axis, sequence_dim, collective_matmul)
    return jax.lax.all_gather(x, axis, axis=sequence_dim, tiled=True)


@renamed_keywords("tp.pieces.row_reduce")
def row_reduce(partial: jax.Array, axis: AxisName, sequence_dim: int | None = None) -> jax.Array:
    """This device's partial products summed over ``axis`` (*g*: identity backward), or
    reduce-scattered along ``sequence_dim`` so each device leaves with its slice of it (where
    dropout draws its mask by sequence slice: :mod:`fsdp_tp.dropout`)."""
    if sequence_dim is None:
        split_after({})  # summed: the same on every device of the axis
        return reduce_from_axis(partial, axis)
    out = jax.lax.psum_scatter(partial, axis, scatter_dimension=sequence_dim, tiled=True)
    split_after({sequence_dim - partial.ndim: axis}, out.shape)
    return out


@renamed_keywords("tp.pieces.add_bias_once")
def add_bias_once(
    y: jax.Array, bias: jax.Array | None, axis: AxisName, sequence_dim: int | None = None, dtype=None
) -> jax.Array:
    """``y + bias`` after the row reduction, so the bias counts once, in ``dtype`` (default:
    the promoted type, as ``nn.Dense`` adds it). With ``y`` split along ``sequence_dim`` over
    ``axis`` (sequence parallelism) the bias's gradient is a partial sum: *f* completes it."""
    if isinstance(sequence_dim, bool):  # (0.2's `sequence_parallel` flag, passed by position)
        (row,) = (r for r in RENAMED if r.owner == "tp.pieces.add_bias_once" and r.old == "sequence_parallel")
        warn(DeprecationWarning(row.message(sequence_dim)))
        sequence_dim = row.value(sequence_dim)
    if bias is None:
        return y
    if sequence_dim is not None:
        bias = copy_to_axis(bias, axis)
    dtype = dtype or jnp.result_type(y, bias)
    return y.astype(dtype) + bias.astype(dtype)


@renamed_keywords("tp.pieces.kept_block")
def kept_block(
    param: jax.Array,
    dim: int,
    blocks: int,
    axis: AxisName,
    where: str = "kept_block",
    what: str = "blocks",
) -> jax.Array:
    """This device's block of ``param``, whole on every device of ``axis``, cut in
    ``blocks`` along ``dim``: ``blocks / size`` of them from block ``t * blocks // size`` on
    device t, or that one block where the axis is larger (grouped-query attention with fewer
    kv heads than devices: device t's query heads read kv head ``t * K // size``). Read
    through *f*, so its gradient, nonzero on this block only, is summed over the axis: whole
    on every device, as the parameter is. ``where`` and ``what`` name the layer and its
    blocks when the axis and ``blocks`` do not divide one another.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    >>> kept = lambda w: kept_block(w, 0, 2, "tensor")[None]   # 2 kv heads over 4 devices
    >>> jax.shard_map(kept, mesh=mesh, in_specs=P(), out_specs=P("tensor"))(jnp.array([[10.0], [20.0]]))
    Array([[[10.]],
    <BLANKLINE>
           [[10.]],
    <BLANKLINE>
           [[20.]],
    <BLANKLINE>
           [[20.]]], dtype=float32)
    """
    size = jax.lax.axis_size(axis)
    require_kept_blocks(where, what, blocks, axis, size)
    start = jax.lax.axis_index(axis) * blocks // size
    whole = copy_to_axis(param, axis)
    width = param.shape[dim] // blocks
    return jax.lax.dynamic_slice_in_dim(whole, start * width, max(1, blocks // size) * width, dim)


@renamed_keywords("tp.pieces.require_kept_blocks")
def require_kept_blocks(where: str, what: str, blocks: int, axis: AxisName, size: int) -> None:
    """Raises ``IndivisibleShapeError`` unless each device of ``axis`` (``size``) reads whole
    blocks of ``blocks`` kept whole (:func:`kept_block`): the axis divides them, or they
    divide the axis (each block read by a whole group of devices)."""
    said, fix = axis_text(axis), f"a {axis!r} size that divides {blocks} or that {blocks} divides"
    if blocks >= size:
        require_divisible(where, what, blocks, said, size, fix)
    else:
        require_divisible(where, f"the size of {axis}", size, what, blocks, fix)

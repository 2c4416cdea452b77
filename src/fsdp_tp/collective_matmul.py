"""Collective matmul: an all-gather or reduce-scatter cut into ``ppermute`` ring steps,
each overlapped with the matmul of the chunk that already arrived.

The ring replaces the collective of a sequence-parallel layer: the gather of the
input before a column-parallel matmul, the reduce-scatter of the partial sums
after a row-parallel one. Step ``s`` sends one chunk to a neighbour while the
chunk of step ``s - 1`` is multiplied; nothing in the data flow ties the two,
so XLA may run them at once. JAX differentiates the ring (a ``ppermute``
transposes to the reverse ``ppermute``), so the backward pass is a ring too.

Two variants: ``"unidirectional"`` passes chunks one way round the ring
(``n - 1`` steps); ``"bidirectional"`` uses both directions of every link: the
gather takes ``n // 2`` steps, the reduce-scatter sends half of each chunk's rows each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ._aliases import REMOVED_IN
from ._layout import axis_text, require_divisible
from ._renamed import renamed_keywords
from ._types import AxisName
from .errors import warn

__all__ = [
    "MODES",
    "RingChunks",
    "matmul_reduce_scatter",
    "require_mode",
    "ring_all_gather",
    "ring_reduce_scatter",
]

MODES = ("unidirectional", "bidirectional")


def require_mode(mode: str | None, caller: str) -> None:
    """``mode`` is None (plain collectives) or one of :data:`MODES`."""
    if mode is not None and mode not in MODES:
        raise ValueError(
            f"{caller}: collective_matmul={mode!r} is not a mode; pass None (plain collectives), "
            f"'unidirectional' or 'bidirectional'."
        )


def _shift(x: jax.Array, axis: AxisName, step: int) -> jax.Array:
    """Device ``i`` receives the ``x`` of device ``i + step`` (mod the axis size)."""
    n = jax.lax.axis_size(axis)
    return jax.lax.ppermute(x, axis, [(j, (j - step) % n) for j in range(n)])


@dataclass(frozen=True)
class RingChunks:
    """The chunks of a sequence-split array as they arrive round the ring.

    ``chunks[k]`` is the chunk of device ``i + offsets[k]`` (mod ``n``) on
    device ``i``. A column-parallel layer multiplies each chunk by its kernel
    (:meth:`matmul`) instead of waiting for the whole gathered input; several
    layers reading the same input (q, k, v) share one ring.
    """

    chunks: tuple[jax.Array, ...]
    offsets: tuple[int, ...]
    dim: int
    axis: AxisName

    @property
    def axis_name(self) -> AxisName:
        """0.2's name of :attr:`axis` (deprecated: read ``axis``)."""
        warn(
            DeprecationWarning(
                f"RingChunks.axis_name is deprecated since 0.2.0 and goes in {REMOVED_IN}: read .axis"
            )
        )
        return self.axis

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the gathered array."""
        first = self.chunks[0].shape
        return (*first[: self.dim], first[self.dim] * len(self.chunks), *first[self.dim + 1 :])

    @property
    def dtype(self):
        return self.chunks[0].dtype

    def map(self, fn, out_dim: int | None = None) -> jax.Array:
        """``fn`` applied to every chunk, the results placed in sequence order along ``dim``
        (along ``out_dim`` of the results where ``fn`` moves the sequence's dim)."""
        outputs = {
            offset % len(self.chunks): fn(chunk)
            for chunk, offset in zip(self.chunks, self.offsets, strict=True)
        }
        # In offset order the chunks run i, i+1, ..., i-1: the gathered result rolled by i chunks.
        dim = self.dim if out_dim is None else out_dim
        rolled = jnp.concatenate([outputs[k] for k in range(len(outputs))], axis=dim)
        width = rolled.shape[dim] // len(outputs)
        return jnp.roll(rolled, jax.lax.axis_index(self.axis) * width, axis=dim)


@renamed_keywords("collective_matmul.ring_all_gather")
def ring_all_gather(x: jax.Array, axis: AxisName, dim: int, mode: str) -> RingChunks:
    """Starts the ring all-gather of ``x`` along ``dim``: the chunks, in arrival order.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> f = lambda x: ring_all_gather(x, "tensor", 0, "bidirectional").map(lambda c: 10 * c)
    >>> g = jax.shard_map(f, mesh=mesh, in_specs=P("tensor"), out_specs=P(), check_vma=False)
    >>> g(jnp.arange(4.0)).tolist()   # the gathered value is the same on every device
    [0.0, 10.0, 20.0, 30.0]
    """
    require_mode(mode, "ring_all_gather")
    n = jax.lax.axis_size(axis)
    chunks, offsets = [x], [0]
    ahead = behind = x
    forward_steps = n - 1 if mode == "unidirectional" else n // 2
    for step in range(1, forward_steps + 1):
        ahead = _shift(ahead, axis, 1)
        chunks.append(ahead)
        offsets.append(step)
    for step in range(1, n - forward_steps):
        behind = _shift(behind, axis, -1)
        chunks.append(behind)
        offsets.append(-step)
    return RingChunks(tuple(chunks), tuple(offsets), dim, axis)


def _reduce_scatter_stream(partial_of, axis: AxisName, direction: int) -> jax.Array:
    """One ring of accumulators: the one arriving last on device ``i`` holds chunk ``i``'s sum.

    The accumulator for chunk ``t`` starts on device ``t + direction`` and
    moves by ``direction`` each step, each device adding its partial product.
    """
    n = jax.lax.axis_size(axis)
    index = jax.lax.axis_index(axis)
    acc = partial_of((index - direction) % n)
    for step in range(1, n):
        acc = _shift(acc, axis, -direction)
        acc = acc + partial_of((index - direction * (step + 1)) % n)
    return acc


@renamed_keywords("collective_matmul.ring_reduce_scatter")
def ring_reduce_scatter(
    product, x: jax.Array, axis: AxisName, dim: int, mode: str, where: str = "", fix: str = "pad it"
) -> jax.Array:
    """``psum_scatter(product(x), axis, scatter_dimension=dim, tiled=True)`` as a ring, for
    a ``product`` that computes each slice of ``x`` along ``dim`` on its own (a layer's matmul
    on rows of the sequence; it keeps every dim but the last).

    Each step computes one output chunk's partial from its rows of ``x`` and adds it to the
    accumulator that arrived from the neighbour. Bidirectional: each chunk's rows are halved,
    and each half's accumulator travels its own way round the ring. ``dim`` must divide over
    the axis: else the package's divisibility error, naming ``where`` (the caller's layer) and
    ``fix``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> x, w = jnp.arange(64.0).reshape(8, 8), jnp.ones((8, 2))
    >>> f = lambda x, w: ring_reduce_scatter(lambda rows: rows @ w, x, "tensor", 0, "bidirectional")
    >>> ring = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")), out_specs=P("tensor"))
    >>> bool((ring(x, w) == x @ w).all())
    True
    """
    require_mode(mode, "ring_reduce_scatter")
    n, dim = jax.lax.axis_size(axis), dim % x.ndim
    what = f"dim {dim} of the input (collective_matmul={mode!r} chunks it)" if where else f"dim {dim}"
    said = axis_text(axis)
    require_divisible(where or "ring_reduce_scatter", what, x.shape[dim], said, n, fix, x.shape)
    width = x.shape[dim] // n

    def partial_of(start: int, size: int):
        return lambda chunk: product(jax.lax.dynamic_slice_in_dim(x, chunk * width + start, size, axis=dim))

    if mode == "unidirectional" or width < 2:
        return _reduce_scatter_stream(partial_of(0, width), axis, 1)
    half = width // 2
    first = _reduce_scatter_stream(partial_of(0, half), axis, 1)
    second = _reduce_scatter_stream(partial_of(half, width - half), axis, -1)
    return jnp.concatenate([first, second], dim)


@renamed_keywords("collective_matmul.matmul_reduce_scatter")
def matmul_reduce_scatter(
    x: jax.Array, kernel: jax.Array, axis: AxisName, dim: int, mode: str, precision=None
) -> jax.Array:
    """``psum_scatter(x @ kernel, axis, scatter_dimension=dim, tiled=True)`` as a ring
    (:func:`ring_reduce_scatter` of the matmul).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> x, w = jnp.arange(32.0).reshape(4, 8), jnp.ones((8, 2))
    >>> f = lambda x, w: matmul_reduce_scatter(x, w, "tensor", 0, "unidirectional")
    >>> ring = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")), out_specs=P("tensor"))
    >>> bool((ring(x, w) == x @ w).all())
    True
    """

    def product(rows):
        dims = (((rows.ndim - 1,), (0,)), ((), ()))
        return jax.lax.dot_general(rows, kernel, dims, precision=precision)

    return ring_reduce_scatter(product, x, axis, dim, mode)

"""A key whose random numbers are this device's block of another key's: :func:`block_key`.

JAX's threefry is counter based (``jax_threefry_partitionable``, on by default): element ``i``
of ``random_bits(key, shape)`` is ``threefry_2x32(key, i)`` for its flat index ``i``. A device
holding a block of an array (split over mesh axes, box-name style) draws exactly its block of
the unsharded draw by hashing its elements' *global* flat indices (:func:`flat_index`).
:func:`block_key` wraps a key's data in a PRNG implementation of the library's
(``jax.extend.random.define_prng_impl``) whose ``random_bits`` does that: every ``jax.random``
draw from it, made by anyone's code on the block's shape (flax's attention dropout inside its
own attention function), is the block of the same draw from the key, unsharded. One
implementation per split and axis sizes, so JAX's caches, keyed on the key's type, never
hand one split's draw to another. A dim may also be a :class:`Window` of a global dim at an
offset the key carries (traced: a ring's visiting block of keys), where no mesh axis says it.

>>> import jax
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> key, mesh = jax.random.key(0), make_mesh({"fsdp": 8})
>>> rows = lambda: jax.random.uniform(block_key(key, ("fsdp", None)), (2, 3))  # any draw, a block
>>> blocks = jax.shard_map(rows, mesh=mesh, in_specs=(), out_specs=P("fsdp"))()
>>> bool((blocks == jax.random.uniform(key, (16, 3))).all())   # the unsharded draw's rows
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend.random import define_prng_impl, threefry_2x32

from .._axes import axis_size, entry_axes
from .._sequence_split import SequenceSplit

__all__ = ["Window", "block_key", "flat_index", "is_block_key", "keep_mask", "split_axes", "wide_index"]

# per dim: None, an axis, or a tuple of axes (major first), as box names are; the step's
# SequenceSplit, for the sequence dim it lays out (a device's tokens, balanced: two chunks); or
# a Window, a run of a dim's indices starting where the key says
Split = tuple


@dataclasses.dataclass(frozen=True)
class Window:
    """A dim of which the block holds consecutive indices of a global dim of ``total``, from
    an offset the block key carries (:func:`block_key`'s ``starts``, one per window, in order):
    attention weights' queries and keys in one block of a ring, whose place no mesh axis gives."""

    total: int


def split_axes(entry) -> tuple:
    """The mesh axes one entry of a :data:`Split` splits its dim over."""
    if isinstance(entry, Window):
        return ()
    return (entry.axis,) if isinstance(entry, SequenceSplit) else entry_axes(entry)


_U32 = jnp.uint32
_UINTS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _mul_wide(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """``a * b`` as (high, low) 32-bit words, for uint32 ``a`` and a Python int ``b < 2**32``:
    16-bit limbs, so no product overflows (jax has no uint64 without ``jax_enable_x64``)."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    lo_lo, lo_hi, hi_lo = a_lo * _U32(b_lo), a_lo * _U32(b_hi), a_hi * _U32(b_lo)
    mid = (lo_lo >> 16) + (lo_hi & 0xFFFF) + (hi_lo & 0xFFFF)
    low = (lo_lo & 0xFFFF) | (mid << 16)
    high = a_hi * _U32(b_hi) + (lo_hi >> 16) + (hi_lo >> 16) + (mid >> 16)
    return high, low


def _add_wide(x: tuple, y: tuple) -> tuple[jax.Array, jax.Array]:
    low = x[1] + y[1]
    return x[0] + y[0] + (low < x[1]).astype(_U32), low


def wide_index(coords: Sequence[jax.Array], sizes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """The row-major flat index of uint32 coordinates ``coords`` in an array of ``sizes``, as
    (high, low) uint32 words, exact up to ``2**64`` elements."""
    total = (jnp.zeros_like(coords[0]), jnp.zeros_like(coords[0]))
    stride = math.prod(sizes)
    for coord, size in zip(coords, sizes, strict=True):
        stride //= size
        high, low = _mul_wide(coord, stride & 0xFFFFFFFF)
        total = _add_wide(total, (high + coord * _U32(stride >> 32), low))
    return total


def flat_index(shape: tuple[int, ...], split: Split, starts=()) -> tuple[jax.Array, jax.Array]:
    """Inside ``jax.shard_map``: for each element of this device's block (``shape``, split as
    ``split`` says; ``starts``: each :class:`Window`'s offset), its flat index in the global
    array, as (high, low) uint32 words: the counters ``jax.random`` hashes for that element
    (``iota_2x32_shape``)."""
    split = tuple(split) + (None,) * (len(shape) - len(split))
    coords, sizes, offsets = [], [], iter(starts)
    for dim, (n, s) in enumerate(zip(shape, split, strict=True)):
        coord = jax.lax.broadcasted_iota(_U32, shape, dim)
        if isinstance(s, Window):
            coords.append(coord + next(offsets).astype(_U32))
            sizes.append(s.total)
            continue
        if isinstance(s, SequenceSplit):  # (this device's tokens' places in the sequence)
            size = jax.lax.axis_size(s.axis)
            places = s.token_index(jax.lax.axis_index(s.axis), size, n).astype(_U32)
            coords.append(jnp.take(places, coord))
            sizes.append(n * size)
            continue
        if axes := entry_axes(s):
            index = jnp.zeros((), _U32)
            for axis in axes:  # the block's position along the axes, major first
                index = index * _U32(jax.lax.axis_size(axis)) + jax.lax.axis_index(axis).astype(_U32)
            coord = coord + index * _U32(n)
        coords.append(coord)
        sizes.append(n * axis_size(axes) if axes else n)
    return wide_index(coords, sizes)


def _block_bits(split: Split, key_data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """``random_bits``: this device's block of the key's bits, as threefry's partitionable draw
    makes them (32 bits: the two hashes xor-ed; 64: the first over the second)."""
    high, low = flat_index(tuple(shape), split, key_data[2:])
    if not high.size:
        return jnp.zeros(shape, _UINTS[bit_width])
    counts = jnp.concatenate([high.ravel(), low.ravel()])  # threefry_2x32 hashes (first half, second half)
    hashed = threefry_2x32((key_data[0], key_data[1]), counts)
    first, second = hashed[: high.size].reshape(shape), hashed[high.size :].reshape(shape)
    if bit_width == 64:
        return (first.astype(jnp.uint64) << 32) | second.astype(jnp.uint64)
    return (first ^ second).astype(_UINTS[bit_width])


def _refuse(*_):
    raise ValueError(
        "a block key (fsdp_tp.dropout._block_key) draws this device's block of one key's numbers; it cannot "
        "be seeded, split or folded: split or fold the unsharded key, then make the block key."
    )


@functools.cache
def _impl(split: Split, sizes: tuple[int, ...]):
    """The PRNG implementation of blocks split as ``split`` over axes of ``sizes`` (one each:
    JAX's caches, keyed on a key's type, then tell splits apart)."""
    windows = sum(isinstance(s, Window) for s in split)  # (their offsets: key data past the key's)
    return define_prng_impl(
        key_shape=(2 + windows,),
        seed=_refuse,
        split=_refuse,
        fold_in=_refuse,
        random_bits=functools.partial(_block_bits, split),
        name=f"fsdp_tp_block{split}{sizes}",
    )


def _key_data(key: jax.Array, where: str) -> jax.Array:
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(key)) if typed else "threefry2x32"
    if is_block_key(key):
        return jax.random.key_data(key)[:2]  # (made again for another split: the same numbers)
    partitionable = bool(getattr(jax.config, "jax_threefry_partitionable"))  # noqa: B009 (untyped)
    if impl != "threefry2x32" or not partitionable:
        raise ValueError(
            f"{where}: a device draws its block of the unsharded dropout mask from threefry's "
            f"counters, which needs a threefry2x32 key (got {impl}) and jax_threefry_partitionable "
            f"on (it is {partitionable}); use jax.random.key(seed) "
            f"and leave jax_threefry_partitionable at its default."
        )
    return jax.random.key_data(key) if typed else key


def is_block_key(key) -> bool:
    """Whether ``key`` is one :func:`block_key` made."""
    typed = hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return typed and str(jax.random.key_impl(key)).startswith("fsdp_tp_block")


def block_key(key: jax.Array, split: Split, where: str = "dropout", starts=()) -> jax.Array:
    """Inside ``jax.shard_map``: a key whose every draw on a block's shape (split as ``split``
    says; ``starts``: the offset of each :class:`Window` of it) is this device's block of the
    same draw from ``key`` on the global shape."""
    split = tuple(split)
    sizes = tuple(axis_size(split_axes(s)) for s in split)
    data = _key_data(key, where)
    if starts:
        data = jnp.concatenate([data, jnp.stack([jnp.asarray(s).astype(data.dtype) for s in starts])])
    return jax.random.wrap_key_data(data, impl=_impl(split, sizes))


def keep_mask(key: jax.Array, keep_prob: float, shape: tuple[int, ...], split: Split, where: str = "dropout"):
    """This device's block (``shape``, split over mesh axes as ``split`` says, box-name style)
    of ``jax.random.bernoulli(key, keep_prob, global_shape)``, bit for bit: that very draw, from
    the block key (the uniform of ``keep_prob``'s dtype, float64 under ``jax_enable_x64``)."""
    return jax.random.bernoulli(block_key(key, split, where), keep_prob, tuple(shape))

"""Mixed-precision FSDP gathers: which dtype a parameter crosses the wire in, each way.

Parameters stay stored (and the optimizer runs) in their own dtype, f32 say. A model that
computes in bf16 casts every gathered f32 parameter to bf16 right after the all-gather:
the gather moved twice the bytes that compute reads. :class:`MixedPrecision` casts the
shard before the all-gather instead, and chooses the dtype the gradient is
reduce-scattered in, as PyTorch FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
The FSDP transforms take it as ``mixed_precision=``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._types import PyTree

__all__ = ["MixedPrecision", "checked_policy", "dequantized", "quantized", "scale_for"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rounded(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype).astype(x.dtype)


# Straight through: the value is rounded, its gradient is not (as the gather's backward).
_rounded.defvjp(lambda x, dtype: (_rounded(x, dtype), None), lambda dtype, _, g: (g,))


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """The scale an 8-bit ``dtype`` reads a row whose largest magnitude is ``amax`` in:
    ``amax`` lands on the format's largest finite value (1 for an all-zero row)."""
    top = np.float32(1) / np.float32(jnp.finfo(dtype).max)
    return jnp.where(amax > 0, amax * top.astype(amax.dtype), jnp.ones_like(amax))


def quantized(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale`` in the 8-bit ``dtype`` (clipped to its finite range first: a value one
    rounding above the largest would become NaN in ``float8_e4m3fn``). Computed as ``x``
    times the reciprocal of ``scale``, written out: XLA turns a division by a broadcast
    value into that product in some programs and not in others, which changed the last bit
    between a sharded program and its twin."""
    top = jnp.finfo(dtype).max.astype(x.dtype)
    return jnp.clip(x * (1 / scale), -top, top).astype(dtype)


def dequantized(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The 8-bit ``q`` read back in ``dtype``: ``q * scale``."""
    return q.astype(dtype) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scaled(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return dequantized(quantized(x, scale, dtype), scale, x.dtype)


# Straight through to x; the scale is a statistic of the parameter, not differentiated.
_scaled.defvjp(lambda x, s, dtype: (_scaled(x, s, dtype), s), lambda dtype, s, g: (g, jnp.zeros_like(s)))


def _amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of each row of ``x`` (along its last dim), kept as a size-1 dim:
    one scale a row, so a stack of layers (``nn.scan``, ``nnx.scan``: a leading layer dim)
    has each layer's scales whether it is read stacked or one layer at a time."""
    dims = (x.ndim - 1,) if x.ndim else ()
    return jnp.max(jnp.abs(x), axis=dims, keepdims=True, initial=0)


def _floating(value: Any, field: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(
            f"MixedPrecision: {field} {value!r} is not a dtype; pass one such as jnp.bfloat16 or jnp.float32."
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"MixedPrecision: {field} {dtype} is not a floating dtype; parameters and gradients are "
            f"gathered and reduced in a floating dtype such as jnp.bfloat16 or jnp.float32."
        )
    return dtype


@dataclass(frozen=True)
class MixedPrecision:
    """Gather parameters in ``gather_dtype``; reduce-scatter their gradients in ``reduce_dtype``
    (``None``: the parameter's own dtype, f32 for f32 parameters).

    The model reads every floating parameter of the transform rounded to ``gather_dtype``
    (:meth:`round`), on every mesh, whether a parameter is gathered or left whole: the
    numbers are those of the unsharded model computing on ``policy.round(params)``. The
    gathered ones cross the wire in ``gather_dtype``. Values come back in the stored dtype,
    holding the rounded values, so a model computing in bf16 reads exactly what it would
    have cast itself. Gradients pass the rounding straight through, in the stored dtype,
    rounded only by a ``reduce_dtype`` narrower than it. A parameter is never widened (a
    bf16 one is not gathered in f32), and only floating ones are cast.

    >>> import jax.numpy as jnp
    >>> policy = MixedPrecision(jnp.bfloat16)
    >>> policy.dtypes_for(jnp.float32), policy.dtypes_for(jnp.bfloat16), policy.dtypes_for(jnp.int32)
    ((dtype(bfloat16), None), (None, None), (None, None))
    """

    gather_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "gather_dtype", _floating(self.gather_dtype, "gather_dtype"))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", _floating(self.reduce_dtype, "reduce_dtype"))

    def dtypes_for(self, stored) -> tuple[np.dtype | None, np.dtype | None]:
        """``(gather, reduce)`` dtypes for a parameter stored as ``stored``; ``None`` where it
        crosses as stored (not floating, or the policy's dtype is not narrower)."""
        stored = jnp.dtype(stored)
        if not jnp.issubdtype(stored, jnp.floating):
            return None, None

        def narrower(dtype):
            return dtype if dtype is not None and dtype.itemsize < stored.itemsize else None

        return narrower(self.gather_dtype), narrower(self.reduce_dtype)

    def round(self, tree: PyTree) -> PyTree:
        """Every leaf rounded to ``gather_dtype`` as the model will read it, its gradient
        straight through: what an unsharded twin computes on to equal the sharded run.

        >>> import jax.numpy as jnp
        >>> MixedPrecision(jnp.bfloat16).round({"w": jnp.array([1.0 + 2**-10])})["w"].tolist()
        [1.0]
        """

        # (a whole leaf is its own block: split over no axis, its rows' scales are its own)
        return jax.tree.map(lambda x: self.round_block(x, self.scale_of(x, ())), tree)

    @property
    def scaled(self) -> bool:
        """Whether gathers carry 8-bit values with a scale per row (``float8_e4m3fn``,
        ``float8_e5m2``): ``x`` crosses as ``x / s`` in 8 bits, ``s = max|x| / the format's
        largest value`` over each row of the parameter (along its last dim), and is read back
        as ``q * s``."""
        return self.gather_dtype.itemsize == 1

    def scale_of(self, block: jax.Array, axes: tuple) -> jax.Array | None:
        """The scales of this device's ``block`` of a parameter, inside ``shard_map``: each
        row's largest magnitude, the max over ``axes`` (the mesh axes that split the last dim:
        a ``pmax`` of one scalar a row), as :meth:`round` computes it on the whole parameter.
        ``None`` where the policy is not :attr:`scaled` or the parameter crosses as stored."""
        dtype = self.dtypes_for(block.dtype)[0]
        if not self.scaled or dtype is None:
            return None
        amax = jax.lax.stop_gradient(_amax(block))  # (a statistic: pmax has no derivative)
        if axes:
            amax = jax.lax.pmax(amax, axes)
        return scale_for(amax, dtype)

    def round_block(self, block: jax.Array, scale: jax.Array | None) -> jax.Array:
        """This device's ``block`` of a parameter as :meth:`round` reads the whole one, given the
        whole parameter's ``scale`` (:meth:`scale_of`; ``None``: unscaled)."""
        dtype = self.dtypes_for(block.dtype)[0]
        if dtype is None:
            return block
        return _rounded(block, dtype) if scale is None else _scaled(block, scale, dtype)


def checked_policy(policy, who: str) -> MixedPrecision | None:
    """``policy`` if it is a :class:`MixedPrecision` or ``None``; else a ``TypeError`` naming
    what ``who`` was given and what to pass."""
    if policy is None or isinstance(policy, MixedPrecision):
        return policy
    raise TypeError(
        f"{who}: mixed_precision must be a fsdp_tp.MixedPrecision or None, got {policy!r} "
        f"({type(policy).__name__}); pass fsdp_tp.MixedPrecision(gather_dtype=jnp.bfloat16, "
        f"reduce_dtype=jnp.float32)."
    )

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

__all__ = ["MixedPrecision", "checked_policy"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rounded(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype).astype(x.dtype)


# Straight through: the value is rounded, its gradient is not (as the gather's backward).
_rounded.defvjp(lambda x, dtype: (_rounded(x, dtype), None), lambda dtype, _, g: (g,))


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

        def one(x):
            dtype = self.dtypes_for(x.dtype)[0]
            return x if dtype is None else _rounded(x, dtype)

        return jax.tree.map(one, tree)


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

"""Megatron's pieces for a vocabulary split over an axis: the rows of a split table looked up
for the ids this device holds (:func:`vocab_lookup`), and the loss of logits split on the
vocabulary from per-token scalars only (:func:`vocab_parallel_cross_entropy`). Re-exported by
:mod:`fsdp_tp.tp.pieces`, where users meet them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._axes import TENSOR, checks_vma, require_axes, varying_axes
from .._renamed import renamed_keywords
from .._types import AxisName
from ..errors import SpecError

__all__ = ["vocab_lookup", "vocab_parallel_cross_entropy", "vocab_start"]


@renamed_keywords("tp.pieces.vocab_start")
def vocab_start(rows: int, axis: AxisName) -> jax.Array:
    """The first id this device holds of a vocabulary split in blocks of ``rows``."""
    return jax.lax.axis_index(axis) * rows


@renamed_keywords("tp.pieces.vocab_lookup")
def vocab_lookup(
    ids: jax.Array, rows: int, axis: AxisName, lookup: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """``lookup`` of the ids in this device's ``rows`` of a vocabulary-split table (device
    ``i`` holds ids ``[i * rows, (i + 1) * rows)``), zeros for the ids it does not hold:
    this device's part of the embedding, for :func:`row_reduce` to sum."""
    local = ids - vocab_start(rows, axis)
    mine = (local >= 0) & (local < rows)
    found = lookup(jnp.where(mine, local, 0))
    return jnp.where(mine[..., None], found, jnp.zeros((), found.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(logits, labels, axis):
    return _cross_entropy_fwd(logits, labels, axis)[0]


def _cross_entropy_fwd(logits, labels, axis):
    width = logits.shape[-1]
    local = labels - vocab_start(width, axis)
    hit = (local >= 0) & (local < width)
    # Only per-token scalars cross the wire: the max, the sum of exps, the target logit.
    peak = jax.lax.pmax(jax.lax.stop_gradient(logits.max(axis=-1)), axis)
    shifted = logits - peak[..., None]
    exps = jnp.exp(shifted)
    total = jax.lax.psum(exps.sum(axis=-1), axis)
    picked = jnp.take_along_axis(shifted, jnp.where(hit, local, 0)[..., None], axis=-1)[..., 0]
    target = jax.lax.psum(jnp.where(hit, picked, 0.0), axis)
    return jnp.log(total) - target, (exps / total[..., None], local, hit, labels)


def _cross_entropy_bwd(axis, residuals, g):
    probs, local, hit, labels = residuals
    onehot = jax.nn.one_hot(jnp.where(hit, local, -1), probs.shape[-1], dtype=probs.dtype)
    return g[..., None] * (probs - onehot), np.zeros(labels.shape, jax.dtypes.float0)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


@renamed_keywords("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(logits: jax.Array, labels: jax.Array, axis: str = TENSOR) -> jax.Array:
    """Per-token softmax cross-entropy of logits split on the vocab (last) dim over ``axis``.

    ``logits``: this device's vocab slice, ``(..., vocab / axis size)``;
    ``labels``: global token ids, the same on every device of the axis.
    Returns ``(...)`` losses, the same on every device; the full logits are
    never gathered. The backward pass is explicit (softmax minus one-hot on
    the local slice), so it is right with and without ``check_vma``.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> logits, labels = jax.random.normal(jax.random.key(0), (3, 8)), jnp.array([1, 6, 3])
    >>> f = jax.shard_map(vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, "tensor"), P()),
    ...                   out_specs=P())
    >>> ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    >>> bool(jnp.allclose(f(logits, labels), ref, rtol=1e-6))
    True

    Logits the same on every device of the axis (a whole head's) are refused where JAX's
    checking can tell (``check_vma=True``): read as slices, the vocabulary would count once per
    device. On an axis of one device they are that device's slice, and the loss is the plain one.
    """
    require_axes(axis, "vocab_parallel_cross_entropy")
    if checks_vma(axis) and axis not in varying_axes(logits):
        size = jax.lax.axis_size(axis)
        if size > 1:
            raise SpecError(
                f"vocab_parallel_cross_entropy: logits of shape {tuple(logits.shape)} are the same on "
                f"every device of mesh axis {axis!r} (size {size}), not each device's slice of the "
                f"vocabulary: read as slices, each token's vocabulary would count {size} times. Pass each "
                f"device's slice (a ColumnParallel head without gather_output, logits split by P(..., "
                f"{axis!r})), or take a plain cross-entropy of whole logits "
                f"(optax.softmax_cross_entropy_with_integer_labels)."
            )
        # Typed as the slice a device holds: the gradient's type is then the logits' (the
        # cast's transpose sums over the one device), as JAX's checking asks of a custom rule.
        logits = jax.lax.pcast(logits, axis, to="varying")
    return _cross_entropy(logits, labels, axis)

"""One block of attention, as the ring computes it: a part of a device's queries against a part
of the keys and values visiting it, merged into the running softmax (flash attention's online
softmax), and its backward from the saved log-sum-exp.

Shapes: queries ``(B, c, G, r, D)`` (``r = H / G`` query heads per kv head: grouped-query
attention reads each kv head once, never repeated to the query heads), keys and values
``(B, c, G, D)``; the running max and sum ``(B, G, r, c)`` and output ``(B, c, G, r, D)``, in
the compute dtype (float32, or the inputs' where wider). A block every entry of which is
masked (a causal future, another document) has max ``-inf``; the merge and the backward guard
``exp(-inf - -inf)``, and the ring skips such blocks altogether (:func:`live`).

Attention dropout (flax's: the softmax's weights times ``keep / keep_prob``) multiplies the
numerator only: a block's ``keep`` ``(B or 1, G, r, c_q, c_k)`` scales the probabilities the
values are summed with, never the sum they are divided by. Its backward needs no more than
the forward's: ``dV = (P∘K)ᵀ dO`` and ``dS = P∘(K∘dO·Vᵀ - δ)`` with ``δ`` the rows of
``dO·O`` as before (``O`` already holds the mask).

>>> import jax, jax.numpy as jnp
>>> q, k = jax.random.normal(jax.random.key(0), (1, 4, 1, 2, 8)), jnp.ones((1, 4, 1, 8))
>>> mask = causal_mask(jnp.arange(4), jnp.arange(4), None, None, causal=True)
>>> out, lse = finish(merge(empty(q), forward(q, k, k, mask, 8**-0.5)))
>>> out.shape, lse.shape, bool(jnp.allclose(out, 1.0))   # (every value is 1: so is the average)
((1, 4, 1, 2, 8), (1, 1, 2, 4), True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._axes import varying_axes

__all__ = ["backward", "causal_mask", "empty", "finish", "forward", "live", "merge", "whole"]


def causal_mask(
    q_index, k_index, q_segments, k_segments, causal: bool, window: int | None = None
) -> jax.Array:
    """``(B or 1, c_q, c_k)``: which key each query sees, from the tokens' indices in the
    sequence (a key after the query is masked where ``causal``; with a sliding ``window``, a
    key ``window`` or more tokens before it too: the query and the ``window - 1`` before it, as
    transformers' sliding-window attention) and their documents (segment ids ``(B, c)``, or
    ``None``: one document; 0 is padding, which no query sees)."""
    mask = jnp.ones((1, q_index.shape[0], k_index.shape[0]), bool)
    if causal:
        mask = k_index[None, None, :] <= q_index[None, :, None]
    if window is not None:
        mask = mask & (q_index[None, :, None] - k_index[None, None, :] < window)
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]
        mask = mask & same & (k_segments[:, None, :] != 0)
    return mask


def live(mask: jax.Array) -> jax.Array:
    """Whether a block has an entry to compute (a scalar: the ring skips the block otherwise)."""
    return jnp.any(mask)


def _finite(m: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _rows(x: jax.Array) -> jax.Array:
    """A ``(B, G, r, c)`` statistic as ``(B, c, G, r, 1)``, to scale outputs by."""
    return jnp.moveaxis(x, -1, 1)[..., None]


def _typed_as(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` (a constant) cast to vary over the mesh axes ``like`` varies over, so a ``cond``'s
    two branches (a block computed or skipped) have one type under ``check_vma``."""
    axes = tuple(sorted(varying_axes(like) - varying_axes(x), key=str))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def compute_dtype(dtype) -> jnp.dtype:
    """The softmax's dtype: float32, or the inputs' where wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def empty(q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The running ``(max, sum, output)`` before any block: ``(-inf, 0, 0)``, typed as ``q``."""
    b, c, g, r, d = q.shape
    ct = compute_dtype(q.dtype)
    m = _typed_as(jnp.full((b, g, r, c), -jnp.inf, ct), q)
    return m, _typed_as(jnp.zeros((b, g, r, c), ct), q), _typed_as(jnp.zeros((b, c, g, r, d), ct), q)


def _scores(q, k, scale):
    ct = compute_dtype(q.dtype)
    return jnp.einsum("bqgrd,bkgd->bgrqk", q.astype(ct), k.astype(ct)) * scale


def _kept(p, keep):
    return p if keep is None else p * keep.astype(p.dtype)


def forward(q, k, v, mask, scale, keep=None):
    """This block's ``(max, sum, output)``: the softmax's numerator against ``k``, ``v``
    (``keep``: attention dropout's multipliers, on the values' weights only)."""
    s = jnp.where(mask[:, None, None], _scores(q, k, scale), -jnp.inf)
    m = s.max(-1)
    p = jnp.exp(s - _finite(m)[..., None])  # (a masked entry: exp(-inf) = 0)
    return m, p.sum(-1), jnp.einsum("bgrqk,bkgd->bqgrd", _kept(p, keep), v.astype(p.dtype))


def merge(state, block):
    """The running softmax with one more block: the larger max, each side rescaled to it."""
    (m0, l0, o0), (m1, l1, o1) = state, block  # (max, sum, output) of each
    m = jnp.maximum(m0, m1)
    a, b = jnp.exp(m0 - _finite(m)), jnp.exp(m1 - _finite(m))  # (-inf on one side: 0 there)
    return m, l0 * a + l1 * b, o0 * _rows(a) + o1 * _rows(b)


def finish(state) -> tuple[jax.Array, jax.Array]:
    """The attention's output ``(B, c, G, r, D)`` and log-sum-exp ``(B, G, r, c)``; a query
    that sees no key (padding) gives 0."""
    m, total, o = state
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    return jnp.where(_rows(seen), o / _rows(total), 0.0), jnp.where(seen, m + jnp.log(total), 0.0)


def whole(q, k, v, mask, scale=None, keep=None) -> jax.Array:
    """Attention of ``q`` over every key at once, one block: the output ``(B, c, G, r, D)`` in the
    compute dtype (``scale``: ``D ** -0.5`` where ``None``). All-to-all's, where a device holds
    the whole sequence for its heads, and the plan check's stand-in for the ring."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return finish(merge(empty(q), forward(q, k, v, mask, scale, keep)))[0]


def backward(q, k, v, do, lse, delta, mask, scale, keep=None):
    """This block's ``(dq, dk, dv)``, from the saved log-sum-exp and ``delta`` (the rows of
    ``do · out``): the softmax's probabilities recomputed, never stored (``keep``: the
    forward's dropout multipliers, drawn again)."""
    ct = compute_dtype(q.dtype)
    q, k, v, do = (t.astype(ct) for t in (q, k, v, do))
    p = jnp.where(mask[:, None, None], jnp.exp(_scores(q, k, scale) - lse[..., None]), 0.0)
    dv = jnp.einsum("bgrqk,bqgrd->bkgd", _kept(p, keep), do)
    ds = p * (_kept(jnp.einsum("bqgrd,bkgd->bgrqk", do, v), keep) - delta[..., None])
    dq = jnp.einsum("bgrqk,bkgd->bqgrd", ds, k) * scale
    dk = jnp.einsum("bgrqk,bqgrd->bkgd", ds, q) * scale
    return dq, dk, dv

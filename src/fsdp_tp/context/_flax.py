"""Flax's own attention function inside a step that splits the sequence, attention dropout
included: :func:`flax_attention`.

``nn.MultiHeadDotProductAttention`` and ``nnx.MultiHeadAttention`` call their
``attention_fn`` (flax's ``dot_product_attention`` by default), which writes its softmax out
over the keys a device holds and draws its dropout mask on that device's weights. Within a
split step the front ends hand the module :func:`flax_attention`'s function for the call
instead, with flax's signature: attention computed across the split's axis
(:func:`~fsdp_tp.context._across.across`), and the weights dropped with each block's block of
the mask the unsharded model draws from the same ``dropout_rng``
(:class:`~fsdp_tp.context._dropout.AttentionDropout`): the unsharded numbers, the mask's too.
What the ring cannot read (a mask or bias built from a device's tokens, weights sown, einsums
of the user's) is refused with the fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import jax.numpy as jnp

from .._sequence_split import checked_here, split_here
from .._trace.sites import calling_site
from .._types import AxisName
from ..dropout import weights_split
from ..errors import RuleError
from ._across import across, on_device
from ._dropout import AttentionDropout

__all__ = ["across_for", "flax_attention"]


def across_for(
    fn: Callable, flax_fn: Callable, batch_axes: Sequence[AxisName], where: str
) -> Callable | None:
    """In a step that splits the sequence (its trace, or the plan check's): the function a
    module whose attention function is ``fn`` calls instead, where ``fn`` is flax's own
    (``flax_fn``), a ``functools.partial`` of it (its keywords kept: ``is_causal=True``) or one
    made here; else (not such a step, or another function: the check refuses it if it mixes
    tokens) ``None``."""
    if split_here() is None and not checked_here():
        return None
    if getattr(fn, "_fsdp_tp_across", False) or fn is flax_fn:
        return flax_attention(flax_fn, batch_axes, where)
    if isinstance(fn, functools.partial) and fn.func is flax_fn and not fn.args:
        return functools.partial(flax_attention(flax_fn, batch_axes, where), **fn.keywords)
    return None


def _refuse_unread(where: str, axis: str, given: dict) -> None:
    named = [name for name, value in given.items() if value is not None]
    if not named:
        return
    fixes = {
        "mask": "a causal mask: is_causal=True at nnx.MultiHeadAttention's call, or for Linen's an "
        "attention_fn of jax.nn.dot_product_attention with is_causal=True; packed documents: "
        "fsdp_tp.attention.attend(q, k, v, segment_ids=...) as the attention_fn",
        "bias": "drop the bias, or compute attention with fsdp_tp.attention.attend",
        "module": "sow_weights=False (no device holds the whole weights)",
        "precision": "precision=None (the ring's softmax is float32 or wider)",
        "qk_attn_weights_einsum": "leave the module's einsums flax's own",
        "attn_weights_value_einsum": "leave the module's einsums flax's own",
    }
    site = calling_site()  # (the model's line that called the module: Linen's and NNX's refusal alike)
    raise RuleError(
        f"{where}{f' (called at {site})' if site is not None else ''}: flax's attention function given "
        f"{', '.join(f'{n}=...' for n in named)} inside a step that splits the sequence over {axis!r}: the "
        f"attention across devices cannot read it (it holds a device's tokens only, or every key's "
        f"weights at once). Fix: {'; '.join(fixes[n] for n in named)}."
    )


def flax_attention(flax_fn: Callable, batch_axes: Sequence[AxisName], where: str) -> Callable:
    """Flax's ``dot_product_attention`` (``flax_fn``, Linen's or NNX's) as a split step computes
    it: across the sequence axis, dropout drawn as the unsharded model draws it (rows over
    ``batch_axes``; ``where`` names the module in errors). In the plan check's traces (no axis
    to cross) it is the library's attention on the device's tokens, which the check carries as
    it carries the ring; or, given what the ring cannot read, ``flax_fn`` itself, which the
    check then refuses at the model's line where the mask or bias was made."""
    taken = inspect.signature(flax_fn).parameters

    def dot_product_attention(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout: bool = True,
        dropout_rng=None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax: bool = False,  # (the ring's softmax is float32 or wider already)
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
        is_causal: bool = False,
    ):
        split = split_here()
        unread = {"mask": mask, "bias": bias, "module": module, "precision": precision}
        unread |= {"qk_attn_weights_einsum": qk_attn_weights_einsum}
        unread |= {"attn_weights_value_einsum": attn_weights_value_einsum}
        if split is None and any(value is not None for value in unread.values()):
            given = {**unread, "broadcast_dropout": broadcast_dropout, "dropout_rng": dropout_rng}
            given |= {"dropout_rate": dropout_rate, "deterministic": deterministic, "dtype": dtype}
            given |= {"force_fp32_for_softmax": force_fp32_for_softmax, "is_causal": is_causal}
            return flax_fn(query, key, value, **{k: v for k, v in given.items() if k in taken})
        _refuse_unread(where, split.axis if split else "context", unread)
        dtype = dtype or jnp.result_type(query, key, value)
        query, key, value = (t.astype(dtype) for t in (query, key, value))
        if split is None:
            return on_device(query, key, value, causal=is_causal)
        if deterministic or dropout_rate == 0.0:
            return across(split, query, key, value, causal=is_causal)
        rows, heads = weights_split(query, batch_axes, where)
        dropout = AttentionDropout(dropout_rate, broadcast_dropout, rows, heads)
        return across(split, query, key, value, causal=is_causal, dropout=dropout, key=dropout_rng)

    dot_product_attention._fsdp_tp_across = True  # type: ignore[attr-defined]
    return dot_product_attention

"""``nn.Dropout`` inside a transformed Linen model draws this device's block of the unsharded
model's mask (:mod:`fsdp_tp.dropout`), bit for bit, from the key the unsharded model would use.

The transforms (:func:`~fsdp_tp.linen._transform.map_params`) run the model under
:func:`exact_dropout`: an ``nn.intercept_methods`` interceptor answers every ``nn.Dropout``
call the way flax does (``deterministic``, ``rate`` 0 or 1, the rng from ``rng=`` or
``make_rng``), with the mask drawn for this device's block: dim 0 over the batch axes, and
the dims a tensor-parallel role left split. Pass the model the key the unsharded model gets
(``rngs={"dropout": rng}``); a key folded over the batch axes per shard
(:func:`~fsdp_tp.dropout.fold_rng_over_axis`) still gives every device its own independent
mask, but not the unsharded one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import flax.linen as nn

from .._tree import module_path
from .._types import AxisName
from ..context._flax import across_for
from ..dropout import (
    activation_split,
    attention_key,
    dropout,
    fold_over_block,
    is_block_key,
    splitting,
    warn_folded,
)
from ._call import calling, current

__all__ = ["exact_dropout"]

_SIGNATURE = inspect.signature(nn.Dropout.__call__)


@contextlib.contextmanager
def exact_dropout(batch_axes: Callable[[], tuple[AxisName, ...]]) -> Iterator[None]:
    """Within (a transformed model's call): every ``nn.Dropout`` draws this device's block of
    the unsharded mask; ``batch_axes()`` gives the axes dim 0 is split over. A model call
    starts with no tensor-parallel split (an outer transform's call already did)."""
    if current().exact_dropout:
        yield
        return
    with (
        calling(exact_dropout=True),
        splitting(),
        nn.intercept_methods(functools.partial(_intercept, batch_axes)),
    ):
        yield


def _intercept(batch_axes, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    if isinstance(module, nn.MultiHeadDotProductAttention):
        return _attention(batch_axes, module, next_fun, args, kwargs)
    if not isinstance(module, nn.Dropout):
        return next_fun(*args, **kwargs)
    bound = _SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    inputs, rng = bound.arguments["inputs"], bound.arguments["rng"]
    deterministic = nn.merge_param("deterministic", module.deterministic, bound.arguments["deterministic"])
    if module.rate == 0.0 or module.rate == 1.0 or deterministic:
        return next_fun(*args, **kwargs)  # no mask is drawn
    if rng is None:
        rng = module.make_rng(module.rng_collection)
    where = f"nn.Dropout at {module_path(module.path) or 'the model'}"
    split = activation_split(inputs, batch_axes(), where)
    return dropout(inputs, module.rate, rng, module.broadcast_dims, split, where)


def _attention(batch_axes, module: nn.MultiHeadDotProductAttention, next_fun, args, kwargs):
    """An attention that drops draws, with flax's ``dot_product_attention``, this device's block
    of the unsharded mask: its ``dropout_rng`` (``make_rng``, once per call that drops, as flax
    draws it) made a block key for its weights (:func:`fsdp_tp.dropout.attention_key`). The
    call is seen twice under a head-parallel role: the model's module (batch split known),
    then the role's clone (its heads, and their split); the key is made again there from the
    same numbers. Another attention function folds the rng over the block's axes, and says so."""
    bound = inspect.signature(type(module).__call__).bind(module, *args, **kwargs)
    given = bound.arguments.get("dropout_rng")
    where = f"{type(module).__name__} at {module_path(module.path) or 'the model'}"
    instead = across_for(module.attention_fn, nn.dot_product_attention, batch_axes(), where)
    if instead is not None:  # (a step that splits the sequence)
        return _across(module, instead, next_fun, bound, args, kwargs)
    if module.dropout_rate == 0.0 or (given is not None and not is_block_key(given)):
        return next_fun(*args, **kwargs)
    deterministic = bound.arguments.get("deterministic")
    if nn.merge_param("deterministic", module.deterministic, deterministic) or module.is_initializing():
        return next_fun(*args, **kwargs)
    rng = given if given is not None else module.make_rng("dropout")
    inputs_q = bound.arguments["inputs_q"]
    if module.attention_fn is not nn.dot_product_attention:
        warn_folded(where, module.attention_fn)
        folded = fold_over_block(rng, inputs_q, batch_axes(), where)
        return next_fun(*args, **{**kwargs, "dropout_rng": folded})
    keys = bound.arguments.get("inputs_k")
    keys = keys if keys is not None else bound.arguments.get("inputs_kv")
    keys = keys if keys is not None else inputs_q
    weights = (*inputs_q.shape[:-2], module.num_heads, inputs_q.shape[-2], keys.shape[-2])
    key = attention_key(rng, weights, inputs_q, module.broadcast_dropout, batch_axes(), where)
    return next_fun(*args, **{**kwargs, "dropout_rng": key})


def _across(module: nn.MultiHeadDotProductAttention, instead, next_fun, bound, args, kwargs):
    """The call in a step that splits the sequence, flax's attention function computed across
    it (:func:`fsdp_tp.context._flax.flax_attention`), its rng made here (a head-parallel
    role's clone, seen next, receives the same: the unsharded model's, from this module's path)."""
    deterministic = bound.arguments.get("deterministic")
    drops = module.dropout_rate > 0.0 and not module.is_initializing()
    if drops and bound.arguments.get("dropout_rng") is None:
        if not nn.merge_param("deterministic", module.deterministic, deterministic):
            kwargs = {**kwargs, "dropout_rng": module.make_rng("dropout")}
    own = module.attention_fn
    object.__setattr__(module, "attention_fn", instead)  # (for this call: a module is frozen)
    try:
        return next_fun(*args, **kwargs)
    finally:
        object.__setattr__(module, "attention_fn", own)

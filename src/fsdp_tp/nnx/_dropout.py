"""``nnx.Dropout`` in a merged model draws this device's block of the unsharded model's mask
(:mod:`fsdp_tp.dropout`), bit for bit, with model-held rngs and with rngs passed at call time.

:meth:`~fsdp_tp.nnx.ShardedModel.merge` swaps each ``nnx.Dropout``'s class for a subclass
(:func:`exact_dropouts`) whose call takes its key as flax's does (``rngs=`` at call time, else
the module's own stream) and draws the mask for this device's block: dim 0 over the batch
axes, and the dims a tensor-parallel role left split. A model-held stream is read unfolded
here (:func:`~fsdp_tp.nnx._read.unfolded`): the key is the unsharded model's, and each device
draws its block of that key's mask. Everywhere else a model-held key is still read folded over
the batch axes, so a module's own draws differ per batch shard.
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx

from .._types import AxisName
from ..context._flax import across_for
from ..dropout import activation_split, dropout, exact_attention, folded_attention, warn_folded
from ._read import unfolded
from ._swap import Swap, swaps

__all__ = ["exact_dropouts"]


@Swap.kind("exact dropout")
def _exact(cls: type, batch_axes: tuple[AxisName, ...], path: str) -> dict:
    """An ``nnx.Dropout`` (or a user's subclass) that draws its block of the unsharded mask."""
    original = cls.__call__
    where = f"nnx.Dropout at {path or 'the model'}"

    def __call__(self, inputs, *, deterministic=None, rngs=None):
        off = self.deterministic if deterministic is None else deterministic
        stream = self.rngs if rngs is None else rngs
        if off is None or off or self.rate in (0.0, 1.0) or stream is None:
            return original(self, inputs, deterministic=deterministic, rngs=rngs)  # flax's answer
        with unfolded():
            if isinstance(stream, nnx.Rngs):
                key = stream[self.rng_collection]()
            elif isinstance(stream, nnx.RngStream):
                key = stream()
            elif isinstance(stream, jax.Array):
                key = stream
            else:
                return original(self, inputs, deterministic=deterministic, rngs=rngs)  # its TypeError
        split = activation_split(inputs, batch_axes, where)
        return dropout(inputs, self.rate, key, self.broadcast_dims, split, where)

    return {"__call__": __call__}


@Swap.kind("exact attention dropout")
def _attending(cls: type, batch_axes: tuple[AxisName, ...], path: str) -> dict:
    """An ``nnx.MultiHeadAttention`` (maybe a role's) whose attention function, for each call,
    draws its block of the unsharded model's dropout mask
    (:func:`fsdp_tp.dropout.exact_attention`), the rng read unfolded; an attention function the
    library does not own folds it over the block's axes instead, and says so once."""
    original = cls.__call__
    where = f"{cls.__name__} at {path or 'the model'}"

    def __call__(self, *args, **kwargs):
        own = self.__dict__["attention_fn"]
        instead = across_for(own, nnx.dot_product_attention, batch_axes, where)  # (a split step)
        exact = instead is not None or own is nnx.dot_product_attention
        if not exact:
            warn_folded(where, own)
        wrapped = instead or (exact_attention if exact else folded_attention)(own, batch_axes, where)
        object.__setattr__(self, "attention_fn", wrapped)
        try:
            with unfolded() if exact else contextlib.nullcontext():
                return original(self, *args, **kwargs)
        finally:  # the model the step holds keeps its own attention function
            object.__setattr__(self, "attention_fn", own)

    return {"__call__": __call__}


def exact_dropouts(model: nnx.Module, batch_axes: tuple[AxisName, ...], path_text) -> None:
    """Every ``nnx.Dropout`` of ``model`` draws its block of the unsharded mask from now on, and
    so does every ``nnx.MultiHeadAttention`` that drops (with flax's attention function)."""
    for path, node in nnx.iter_graph(model):
        if {_exact.name, _attending.name} & set(swaps(node)):
            continue
        if isinstance(node, nnx.Dropout):
            _exact(node, tuple(batch_axes), path_text(path))
        elif isinstance(node, nnx.MultiHeadAttention) and node.dropout_rate > 0:
            _attending(node, tuple(batch_axes), path_text(path))

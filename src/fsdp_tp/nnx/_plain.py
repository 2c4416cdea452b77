"""A model from ``nnx.merge`` in a step that splits the sequence, checked against the model on
the whole sequence at its first call (:mod:`fsdp_tp._check.plain`): within the step's trace
``nnx.merge`` gives the model a class whose call is checked so (:func:`plain_checked`), unless a
laid-out model's check (:meth:`~fsdp_tp.nnx.ShardedModel.merge`'s) ran inside. NNX has no
interceptor; ``nnx.merge`` is how a step rebuilds a model from its state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flax import nnx

from .._check.driver import checking
from .._check.plain import plain_call, register
from .._sequence_split import sequence_split
from ..tp._front import RolePlan
from ._check import check_call
from ._layers import NNX
from ._swap import Swap, swaps

__all__ = ["plain_checked"]

_MERGE = nnx.merge
_WHERE = "shard_step (a model from nnx.merge)"


@Swap.kind("plain check")
def plain_checked(cls: type) -> dict:
    """A model whose call is checked against the whole sequence after it runs, unless a check
    ran inside it."""

    def __call__(self, *args, **kwargs):
        if "plan check" in swaps(self):  # (a ShardedModel's merge: its own check, before the call)
            return cls.__call__(self, *args, **kwargs)
        check = lambda checked: check_call(self, self, RolePlan((), NNX), args, kwargs, checked, _WHERE)
        return plain_call(lambda: cls.__call__(self, *args, **kwargs), check)

    return {"__call__": __call__}


def _merge(*args, **kwargs):
    model = _MERGE(*args, **kwargs)
    if isinstance(model, nnx.Module) and checking() and sequence_split() is not None:
        if "plain check" not in swaps(model):
            plain_checked(model)
    return model


@register
@contextlib.contextmanager
def _merged_models() -> Iterator[None]:
    nnx.merge = _merge
    try:
        yield
    finally:
        nnx.merge = _MERGE

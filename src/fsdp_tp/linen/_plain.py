"""A plain Linen ``model.apply`` in a step that splits the sequence, checked against the model
on the whole sequence (:mod:`fsdp_tp._check.plain`): an interceptor sees each root module's
call (the module ``apply`` binds, under no other module) and checks it, as
:func:`~fsdp_tp.shard_by_rules`'s model is checked, unless a laid-out model's check ran inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as nn

from .._check.plain import plain_call, register
from ._check import check_call

__all__: list[str] = []


@register
@contextlib.contextmanager
def _root_calls() -> Iterator[None]:
    with nn.intercept_methods(_intercept):
        yield


def _intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or isinstance(module.parent, nn.Module):
        return next_fun(*args, **kwargs)  # (a submodule's call, or a method the check cannot call)
    where = f"shard_step ({type(module).__name__}'s apply)"
    check = lambda checked: check_call(module, type(module), args, kwargs, (), checked, where=where)
    return plain_call(lambda: next_fun(*args, **kwargs), check)

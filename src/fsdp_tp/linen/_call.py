"""The record of one call of a transformed Linen module (:class:`Call`), for the flax callbacks
that take no argument: ``map_variables``' gathers and stores, and the interceptors flax calls
from the middle of the user's code.

Each transform that knows a fact of the call (the axes its inputs vary over, the module's
path, the logical rules, what the tp rules' interceptor saw, the clones computing on slices,
the exact dropout, the finder's unsharded trace) sets it for the ``with`` block of the call
(:func:`calling`), and the callbacks read the record (:func:`current`). One context variable
for all of them, reset where it is set.

>>> with calling(module_path="block_0/mlp"):
...     current().module_path
'block_0/mlp'
>>> current().module_path
''
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from .._context import Ambient

__all__ = ["CALL", "Call", "calling", "current"]


@dataclasses.dataclass(frozen=True)
class Call:
    """What the transforms of one Linen call tell the callbacks inside it.

    ``input_varying``: the axes the wrapped module's inputs vary over (where JAX would pcast a
    gathered parameter); ``module_path``: the wrapped module's path (``"a/b"``, root ``""``),
    for the names errors give; ``logical``: the call's logical axis rules, read by the store;
    ``seen``: what the tp rules' interceptor saw (a ``Seen``: submodules, splits, stored paths);
    ``local``: the ids of the clones computing on slices, which pass the interceptor again;
    ``exact_dropout``: ``nn.Dropout`` draws this device's block of the unsharded mask here;
    ``traced``: the unsharded call's graph where the plan finder traced it on the inputs the
    check will see (the check reads it instead of tracing the model again)."""

    input_varying: frozenset = frozenset()
    module_path: str = ""
    logical: Any = ()
    seen: Any = None
    local: frozenset[int] = frozenset()
    exact_dropout: bool = False
    traced: Any = None


CALL: Ambient[Call] = Ambient("fsdp_tp_linen_call", Call())


def current() -> Call:
    """The record of the Linen call being traced (the defaults outside any)."""
    return CALL.get()


def calling(**facts: Any) -> contextlib.AbstractContextManager[Call]:
    """Within: the record with ``facts`` (fields of :class:`Call`) set; after, what it was."""
    return CALL.scoped(**facts)

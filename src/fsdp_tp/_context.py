"""A context variable set for the duration of a ``with`` block: the one spelling of the
library's scoped switches (the plan check off, roles without rings, a traced call handed on).

>>> import contextvars
>>> flag = contextvars.ContextVar("flag", default=False)
>>> with set_for(flag, True):
...     flag.get()
True
>>> flag.get()
False
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["set_for"]

T = TypeVar("T")


@contextlib.contextmanager
def set_for(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """Within: ``var`` is ``value``; after, what it was."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)

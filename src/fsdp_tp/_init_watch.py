"""The init watchers: what a front end checks after the per-device init's trace.

A front end's own layers that run their roles themselves (Linen's Megatron layers) are seen
only inside that trace, in a model the core's :func:`~fsdp_tp.init_sharded` cannot name. A
watcher is entered around the trace and gives the check to run after it (outside any mesh):
``check(mesh, check_vma, error)``, ``error`` what the trace raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ._check.driver import checking

__all__ = ["Watcher", "watch_inits", "watched_init"]

Watcher = Callable[[], contextlib.AbstractContextManager[Callable[[Any, bool, Exception | None], None]]]
_WATCHERS: list[Watcher] = []


def watch_inits(watcher: Watcher) -> None:
    """Has ``watcher`` watch every per-device init's trace (a front end's, once at its import)."""
    if watcher not in _WATCHERS:
        _WATCHERS.append(watcher)


@contextlib.contextmanager
def watched_init(mesh: Any, check_vma: bool) -> Iterator[None]:
    """Within, the per-device init is traced under every watcher; after, each one's check runs
    (a :class:`~fsdp_tp.errors.RuleError` before anything is compiled), and where the trace
    failed, each may say why (the model's code on a device's slices) before the error passes."""
    if not checking() or not _WATCHERS:
        yield
        return
    failed = None
    with contextlib.ExitStack() as stack:
        checks = [stack.enter_context(watch()) for watch in _WATCHERS]
        try:
            yield
        except Exception as err:
            failed = err
    for check in checks:
        check(mesh, check_vma, failed)
    if failed is not None:
        raise failed

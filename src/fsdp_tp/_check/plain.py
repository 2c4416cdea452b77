"""A step's calls of a model that no front end lays out, checked against the whole sequence.

Under a step's sequence split (:mod:`fsdp_tp.context`) a model that builds positions from a
device's length, or a mask from its shapes, computes wrong numbers without an error, whether
or not the library laid it out. A model laid out by ``shard_by_rules`` is checked at its first
call (:func:`~fsdp_tp._check.driver.check_call`); a plain ``model.apply`` in the user's own
step is checked here. Each front end registers how it sees such a call (:func:`register`:
Linen's interceptor of a root module's call, NNX's ``nnx.merge``) and runs it through
:func:`plain_call`, which checks it with the front end's ``check`` unless a check ran inside it
(a laid-out model's own). :func:`step_calls` wraps a step's per-device trace in every registered
way; a step that splits the sequence and met no check warns once
(:class:`~fsdp_tp.errors.UncheckedPlanWarning`), with the proof that covers it.

>>> calls = Calls()
>>> calls.count, calls.checked
(0, set())
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .._context import CHECK
from .._sequence_split import sequence_split
from ..errors import UncheckedPlanWarning, warn
from .driver import checking

__all__ = ["Calls", "laid_out", "plain_call", "register", "register_when_loaded", "step_calls"]

_HOOKS: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
_LOADED: dict[str, str] = {}  # a framework's module -> the front end module that registers its hook


@dataclasses.dataclass
class Calls:
    """A step's record: how many calls a check of the whole sequence met (``count``: any front
    end's, counted by the driver), the plain calls' checks done (``checked``: their keys), and
    whether a plain call is running (``inside``: a call within it is its own, checked with it;
    a laid-out Linen model's module is a root of its own scope inside the model's)."""

    checked: set = dataclasses.field(default_factory=set)
    count: int = 0
    inside: bool = False


def register(
    hook: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """``hook()``: a context within which a front end sees its plain calls (a decorator)."""
    _HOOKS.append(hook)
    return hook


def register_when_loaded(framework: str, front_end: str) -> None:
    """Imports ``front_end`` (which registers its hook) at a step's trace where ``framework``
    is loaded: a model of a framework the library's own import does not load (NNX)."""
    _LOADED[framework] = front_end


def plain_call(run: Callable[[], Any], check: Callable[[set], None]) -> Any:
    """``run()``, a plain call of a model, then ``check(checked)`` (refusing what does not
    compute blocks of the model on the whole sequence) unless a check ran inside it; outside a
    step that splits the sequence, or in the check's own traces (``unringed``: the unsharded
    model's among them), ``run()`` alone."""
    scope = CHECK.get()
    calls = scope.calls
    if calls is None or calls.inside or not checking() or scope.unringed or sequence_split() is None:
        return run()
    before = calls.count
    with laid_out():  # (a call inside it is its own, checked with it)
        out = run()
    if calls.count == before:
        check(calls.checked)
    return out


@contextlib.contextmanager
def laid_out() -> Iterator[None]:
    """Within, the call of a model a front end lays out (and checks itself), or a plain call
    being run: no call inside it is a plain one of its own (a Linen transform's module is the
    root of a scope of its own)."""
    calls = CHECK.get().calls
    if calls is None or calls.inside:
        yield
        return
    calls.inside = True
    try:
        yield
    finally:
        calls.inside = False


@contextlib.contextmanager
def step_calls(where: str) -> Iterator[None]:
    """Within (a step's per-device trace), each front end's plain calls are checked; after, a
    step that splits the sequence and met no check warns that nothing was checked."""
    for framework, front_end in _LOADED.items():
        if framework in sys.modules:
            importlib.import_module(front_end)
    calls = Calls()
    with CHECK.scoped(calls=calls), contextlib.ExitStack() as stack:
        for hook in _HOOKS:
            stack.enter_context(hook())
        yield
    split = sequence_split()
    if split is not None and checking() and not calls.count:
        axis, size = split
        warn(
            UncheckedPlanWarning(
                f"{where}: the step splits the sequence over {axis!r} ({size} devices) and no model call "
                f"in it was checked against the whole sequence (checked: a Linen module's apply, a model "
                f"from nnx.merge, a model laid out by shard_by_rules). A model that builds positions or a "
                f"mask from a device's length computes wrong numbers there without an error: call it so, "
                f"or prove it equal to unsharded on this mesh: fsdp_tp.testing.check_sharded(model, "
                f"batch, loss, mesh, rules) with {axis!r} in the mesh."
            )
        )

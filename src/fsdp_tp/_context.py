"""The library's ambient state: a few typed records, each in one context variable
(:class:`Ambient`), set for the duration of a ``with`` block and reset there.

The library runs inside the user's code: flax calls its interceptors and ``map_variables``
transforms, and JAX traces the user's loss, from code that passes nothing on. What one end
of such a call tells the other is a field of a record: the step's (:data:`STEP`, told by
``shard_step``, asked inside the user's loss), the plan check's (:data:`CHECK`, the check's
own trace of the user's call), and a Linen call's (:mod:`fsdp_tp.linen._call`).

>>> with STEP.scoped(batch_axes=("data",)):
...     STEP.get().batch_axes
('data',)
>>> STEP.get().batch_axes is None
True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

__all__ = ["CHECK", "STEP", "Ambient", "Check", "Step"]

T = TypeVar("T")


class Ambient(Generic[T]):
    """A frozen dataclass record held in the context variable ``name`` (``default`` outside any
    scope): :meth:`get` reads it, :meth:`scoped` sets fields for a ``with`` block."""

    def __init__(self, name: str, default: T):
        self.name = name
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)

    def get(self) -> T:
        return self._var.get()

    @contextlib.contextmanager
    def scoped(self, **fields: Any) -> Iterator[T]:
        """Within: the record with ``fields`` set; after, the record as it was."""
        record = dataclasses.replace(self._var.get(), **fields)  # type: ignore[type-var]
        token = self._var.set(record)
        try:
            yield record
        finally:
            self._var.reset(token)

    def update(self, **fields: Any) -> None:
        """``fields`` set until the innermost enclosing :meth:`scoped` ends (a fact that holds
        from here on in the trace, like the split a column layer leaves)."""
        self._var.set(dataclasses.replace(self._var.get(), **fields))  # type: ignore[type-var]


@dataclasses.dataclass(frozen=True)
class Step:
    """What the step tells the code it traces (the user's loss, the model, the roles).

    ``batch_axes``: the axes the step's batch is split over (``None``: outside a step), asked by
    gathers, the gradient sync and dropout; ``per_device``: inside ``shard_step``'s per-device
    ``step_fn``, where an optimizer update is refused; ``column_inputs``: the column inputs of
    the step's trace, so the layers reading one activation share one *f* (``None``: not
    shared); ``region``: the dims the roles left split (entries of
    :mod:`fsdp_tp.dropout._activation_split`), set by a role's call, read by a dropout layer the model
    calls later; ``keys_as_stored``: rng keys read as stored, within an exact dropout's draw
    (an NNX Variable's ``get_value`` takes no argument); ``sequence``: the step's
    :class:`~fsdp_tp.context.SequenceSplit` (``None``: the sequence whole on each device), read
    by the library's attention, which then computes across its axis; ``tokens``: a device's
    tokens a sequence under it (dim 1 of the batch's leaves it splits), for dropout's masks;
    ``unplaceable``: why a dropout inside the module a role runs as written cannot be placed."""

    batch_axes: tuple | None = None
    per_device: bool = False
    column_inputs: dict | None = None
    region: tuple = ()
    keys_as_stored: bool = False
    sequence: Any = None
    tokens: int | None = None
    unplaceable: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    """The plan check's scope. ``off``: no plan is checked (in the check's own trace of the
    user's call, and where a test switches it off); ``unringed``: the roles run without their
    rings there (the same numbers, each layer called once), and attention on a device's tokens
    (a sequence split's ring is not the tensor plan's concern); ``calls``: within a step that
    splits the sequence, its record of the calls checked against the whole sequence
    (:class:`fsdp_tp._check.plain.Calls`; ``None``: no such step)."""

    off: bool = False
    unringed: bool = False
    calls: Any = None


STEP: Ambient[Step] = Ambient("fsdp_tp_step", Step())
CHECK: Ambient[Check] = Ambient("fsdp_tp_check", Check())

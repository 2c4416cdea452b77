"""What a front end is to the core's roles: :class:`FrontEnd`, the protocol it implements, and its
module classes per layer kind (:class:`Kinds`: which roles a module can take, and how the plan's
errors spell the classes a role takes, ``nn.Dense``, ``nnx.Linear``). The seam a front end
imports (:mod:`fsdp_tp.tp._front`) gives both."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ._registered import computes_of
from ._role import Layer, Local, TPRole
from ._roles import ROLES

__all__ = ["FrontEnd", "Kinds"]


@dataclasses.dataclass(frozen=True)
class Kinds:
    """A front end's module classes per layer kind (``"dense"``: ``nn.Dense``, ...) and the
    prefix its users write them with (``nn``, ``nnx``): what the plan's errors spell.

    >>> class Dense: ...
    >>> plain = Kinds("plain", {"dense": (Dense,)})
    >>> plain.of(Dense), plain.spelled(["dense", "embed"]), plain.roles_for(Dense)
    ('dense', 'plain.Dense', ['ColumnParallel', 'RowParallel'])
    """

    prefix: str
    classes: Mapping[str, tuple[type, ...]]

    def of(self, cls: type) -> str | None:
        if computes_of(cls) is not None:  # a class of the user's, registered
            return "einsum"
        return next((kind for kind, types in self.classes.items() if issubclass(cls, types)), None)

    def spelled(self, kinds: Sequence[str], sep: str = " or ") -> str:
        types = [t for kind in kinds for t in self.classes.get(kind, ())]
        return sep.join(f"{self.prefix}.{t.__name__}" for t in types)

    def takes(self, role: TPRole, cls: type) -> bool:
        """Whether ``role`` computes a module of class ``cls``: one of its kinds, or any module
        for a role that names the module's parameters itself (``takes_any_module``)."""
        return role.takes_any_module() or self.of(cls) in role.kinds

    def roles_for(self, cls: type) -> list[str]:
        kind = self.of(cls)
        return [r.__name__ for r in ROLES if kind in r.kinds]


@runtime_checkable
class FrontEnd(Protocol):
    """What a front end does for the roles: ``kinds``, its module classes per layer kind
    (:class:`Kinds`; the plan refuses a role on a module of another kind, naming the classes it takes);
    :meth:`layer_of`, a module as a role sees it; :meth:`with_local`, the module's method
    computing on the sizes a role gives it on this device. The roles, the plan, the checks and
    every error's wording are the core's, the same for every front end."""

    kinds: ClassVar[Kinds]

    def layer_of(self, module: Any, path: str, args: tuple, kwargs: dict) -> Layer:
        """``module`` (at ``path``, called with ``args`` and ``kwargs``) as a role sees it: its
        sizes as the unsharded model has them."""
        ...

    def with_local(
        self, module: Any, method: str, role: TPRole, layer: Layer, local: Local, args: tuple, kwargs: dict
    ) -> Callable[..., Any]:
        """``module``'s ``method`` computing with ``local``'s sizes (each one it sets, none
        dropped) on the blocks the step holds; a call whose inputs are not the slices the role
        gives is told so (:func:`~fsdp_tp.tp._rules.slice_error`)."""
        ...

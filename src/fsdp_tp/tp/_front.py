"""The seam between the core's roles and a front end: what a front end does for them
(:class:`FrontEnd`: its layer classes, a module as a role sees it, the module's method on its
local sizes) and the one way a module a rule names computes (:func:`compute`), which both
front ends call, as the role plan's :meth:`~fsdp_tp.tp._role_plan.RolePlan.meet` is the one
way they record it.

A front end lists no model's modules here: NNX holds them before anything runs
(``nnx.iter_graph`` of the abstract model), Linen creates a module only as the call reaches it
(its interceptor), so each meets them in its own order and hands each one to the plan.

A front end for the layers of another library is two methods and a table. Here, a layer that
multiplies by its kernel, split on its features over a ``tensor`` axis of eight devices:

>>> import dataclasses
>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> from fsdp_tp.tp import ColumnParallel
>>> @dataclasses.dataclass
... class Dense:                 # the other library's layer: its size, and its kernel as the step holds it
...     features: int
...     kernel: jax.Array
...     def __call__(self, x):
...         assert self.kernel.shape[-1] == self.features, "the layer's size is its kernel's"
...         return x @ self.kernel
>>> class Plain:
...     kinds = Kinds("plain", {"dense": (Dense,)})
...     def layer_of(self, module, path, args, kwargs):
...         return Layer("dense", path, features=(module.features,), in_size=args[0].shape[-1])
...     def with_local(self, module, method, role, layer, local, args, kwargs):
...         return getattr(dataclasses.replace(module, features=local.features[0]), method)
>>> mesh = make_mesh({"tensor": 8})
>>> def step(x, kernel):
...     dense, front = Dense(8, kernel), Plain()
...     layer = front.layer_of(dense, "up", (x,), {})
...     return compute(front, ColumnParallel(gather_output=True), dense, "__call__", layer, (x,), {})
>>> x, kernel = jnp.ones((3, 4)), jnp.arange(32.0).reshape(4, 8)
>>> y = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(None, "tensor")), out_specs=P())(x, kernel)
>>> bool((y == x @ kernel).all())
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from ._registered import computes_of
from ._role import Layer, Local, TPRole
from ._roles import ROLES

__all__ = ["FrontEnd", "Kinds", "compute"]


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


def compute(front: FrontEnd, role: TPRole, module: Any, method: str, layer: Layer, args: tuple, kwargs: dict):
    """``module``'s ``method`` called with ``args`` and ``kwargs`` as ``role`` computes it
    (``layer``: ``front.layer_of(module, ...)``): the local sizes for this device's share of
    the role's axis, the front end's method on them, and the role's collectives around it
    (:meth:`~fsdp_tp.tp.TPRole.around`). The one way a front end runs a role a rule names."""
    local = role.local(layer, jax.lax.axis_size(role.axis))
    return role.around(
        method, front.with_local(module, method, role, layer, local, args, kwargs), layer, args, kwargs
    )

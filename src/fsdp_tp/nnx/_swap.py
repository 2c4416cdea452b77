"""The one way the NNX front end changes what a module's call does: its class swapped, in place,
for a subclass of it (:class:`Swap`).

NNX has no interceptor (Linen's ``nn.intercept_methods``), and a module's class is what
survives ``nnx.split`` / ``nnx.merge`` into the model's ``nnx.scan``: so a role, an exact
dropout, the plan check and the check's path names each reach a module's call as a class. Every
swap is made alike, here:

- a subclass of the module's class, so every ``isinstance`` the user's code makes still holds,
  named as that class;
- made once per class and key, so graphs that hold it compare equal from
  step to step and jit's cache hits;
- marked with its kind (:func:`swaps`), so a kind is applied once and a reader (an error, a
  test) sees what was swapped.

>>> import jax
>>> from flax import nnx
>>> @Swap.kind("doubled")
... def doubled(cls, factor):
...     def __call__(self, x):
...         return factor * cls.__call__(self, x)
...     return {"__call__": __call__}
>>> layer = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))
>>> before = layer(jax.numpy.ones((1, 2)))
>>> doubled(layer, 2.0)
>>> type(layer).__name__, isinstance(layer, nnx.Linear), swaps(layer)
('Linear', True, ('doubled',))
>>> bool((layer(jax.numpy.ones((1, 2))) == 2.0 * before).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Swap", "swaps"]

_KINDS = "_fsdp_tp_swaps"  # a swapped class's attribute: the kinds its swaps were, outermost last


def swaps(node: Any) -> tuple[str, ...]:
    """The kinds of the swaps ``node``'s class has had, the first one first."""
    return getattr(type(node), _KINDS, ())


class Swap:
    """One kind of class swap: ``methods(cls, *key)`` gives the methods (by name) of the subclass
    that ``swap(node, *key)`` sets as ``node``'s class. Made by :meth:`kind`, as a decorator."""

    def __init__(self, name: str, methods: Callable[..., dict[str, Callable]]):
        self.name, self.methods = name, methods
        self.__doc__ = methods.__doc__
        self._made: dict[tuple, type] = {}

    @classmethod
    def kind(cls, kind: str) -> Callable[[Callable[..., dict[str, Callable]]], Swap]:
        """``@Swap.kind("role")`` over a function ``(cls, *key) -> {name: method}``."""
        return lambda methods: cls(kind, methods)

    def subclass(self, cls: type, *key: Any) -> type:
        """This kind's subclass of ``cls`` at ``key``, made once."""
        if (cls, *key) not in self._made:
            namespace = {**self.methods(cls, *key), "__module__": cls.__module__}
            kinds = (*getattr(cls, _KINDS, ()), self.name)
            self._made[(cls, *key)] = type(cls.__name__, (cls,), {**namespace, _KINDS: kinds})
        return self._made[(cls, *key)]

    def __call__(self, node: Any, *key: Any) -> None:
        """``node``'s class swapped for this kind's subclass of it at ``key`` (in place)."""
        object.__setattr__(node, "__class__", self.subclass(type(node), *key))

"""Module classes the library has never seen, registered as einsum layers
(:func:`register_einsum`): what each computes (:class:`Computes`), which the tensor-parallel
roles read as they read an ``nn.Einsum``'s equation (:class:`~fsdp_tp.tp._einsum.Equation`).

>>> class Projection:
...     pass
>>> _ = register_einsum(Projection, "btd,dh->bth", sizes={"features": "h"})
>>> computes_of(Projection).attributes((16, 4))   # (a kernel of 4 features: the attribute says 4)
{'features': 4}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import RuleError
from ._einsum import Equation

__all__ = ["Computes", "computes_of", "register_einsum"]


@dataclasses.dataclass(frozen=True)
class Computes:
    """What a module class the library has never seen computes, as :func:`register_einsum`
    was told: ``equation`` (inputs, its kernel parameter, output), the kernel parameter's
    name, and ``sizes``: the module's attributes that hold a kernel letter's size (which a
    role sets to this device's size for the call)."""

    equation: str
    kernel: str = "kernel"
    sizes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def held(self, module: object, path: str) -> dict[str, int]:
        """``{letter: size}`` of the ``sizes`` attributes ``module`` holds; a missing one is
        named with the attributes it has."""
        for attr in self.sizes:
            if not hasattr(module, attr):
                raise RuleError(self._missing(module, path, f"sizes={{{attr!r}: ...}} names", attr))
        return {letter: getattr(module, attr) for attr, letter in self.sizes.items()}

    def kernel_of(self, module: object, path: str):
        """The kernel parameter ``module`` holds under the name it was registered with."""
        if not hasattr(module, self.kernel):
            raise RuleError(self._missing(module, path, f"kernel={self.kernel!r} names", self.kernel))
        return getattr(module, self.kernel)

    def _missing(self, module: object, path: str, said: str, name: str) -> str:
        cls = type(module).__name__
        own = vars(module) if hasattr(module, "__dict__") else {}
        have = sorted(a for a in own if not a.startswith("_") and a not in ("name", "parent", "scope"))
        return (
            f"{path}: register_einsum({cls}, {self.equation!r}, ...): {said} an attribute {cls} does "
            f"not have (it has {', '.join(have) or 'none'}); register it again with the name the "
            f"module uses (register_einsum(..., replace=True))."
        )

    def attributes(self, kernel_shape: tuple[int, ...]) -> dict[str, int]:
        """The ``sizes`` attributes' values for a kernel of ``kernel_shape`` (a role's local one)."""
        letters = Equation.parse(self.equation, self.kernel).kernel
        return {attr: kernel_shape[letters.index(letter)] for attr, letter in self.sizes.items()}


_REGISTERED: dict[type, Computes] = {}


def register_einsum(
    cls: type,
    equation: str,
    *,
    kernel: str = "kernel",
    sizes: Mapping[str, str] | None = None,
    replace: bool = False,
) -> type:
    """Tells the tensor-parallel roles that ``cls`` (a Linen or NNX module class, and its
    subclasses) computes ``einsum(equation, inputs, <its parameter kernel>)``: a
    ``ColumnParallel`` or ``RowParallel`` rule on it then splits the kernel by the equation's
    letters, as it splits an ``nn.Einsum``. ``sizes`` maps each attribute the module builds
    its kernel's shape from (or reads in its call) to the letter it is the size of: for the
    call the role sets it to this device's size. Register a module whose only parameter is
    the kernel: a rule on one that makes others (a bias a row layer would add on every
    device) is refused at init. The same registration again changes nothing; another one for
    the same class needs ``replace=True``. Flax's own layers are the roles' already and cannot
    be registered (a subclass of one can). Returns ``cls``.

    >>> class MyDense:
    ...     pass
    >>> _ = register_einsum(MyDense, "...i,io->...o", kernel="w", sizes={"features": "o"})
    >>> computes_of(MyDense).kernel
    'w'
    """
    if not isinstance(cls, type):
        raise RuleError(
            f"register_einsum takes the module class; got an instance of {type(cls).__name__}: pass "
            f"{type(cls).__name__} (every instance, and its subclasses', computes as registered)."
        )
    if cls.__module__.split(".")[0] == "flax":
        raise RuleError(
            f"register_einsum({cls.__module__}.{cls.__name__}): a Flax layer the tp roles already "
            f"compute by its own kind; registering it would change every {cls.__name__} in the "
            f"process. Register a class of your own (a subclass of {cls.__name__} is one)."
        )
    given = dict(sizes or {})
    eq = Equation.parse(equation, cls.__name__)
    if bad := {attr: letter for attr, letter in given.items() if letter not in eq.kernel}:
        raise RuleError(
            f"register_einsum({cls.__name__}, {equation!r}): sizes={bad!r} name letters the kernel "
            f"{eq.kernel!r} does not have; map each attribute to a letter of {eq.kernel!r}."
        )
    computes = Computes(eq.text, kernel, given)
    if (before := _REGISTERED.get(cls)) not in (None, computes) and not replace:
        raise RuleError(
            f"register_einsum({cls.__name__}, {equation!r}, kernel={kernel!r}, sizes={given!r}): "
            f"{cls.__name__} is already registered as {before.equation!r} (kernel={before.kernel!r}, "
            f"sizes={dict(before.sizes)!r}); pass replace=True to register it anew."
        )
    _REGISTERED[cls] = computes
    return cls


def computes_of(cls: type) -> Computes | None:
    """What ``cls`` (or the nearest registered class it derives from) was registered as."""
    return next((_REGISTERED[c] for c in cls.__mro__ if c in _REGISTERED), None)

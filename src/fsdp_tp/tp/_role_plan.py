"""The role plan of one model (:class:`RolePlan`): which role each submodule computes with,
where the roles split its parameters and which they keep whole, built here for both front
ends as each meets the model's modules (NNX: the abstract model's tree, before anything runs;
Linen: its interceptor, as the call reaches each module, whose children are created only then).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._types import AxisName
from ._protocol import FrontEnd, Kinds
from ._role import Layer, TPRole
from ._rules import (
    CompiledRole,
    add_placements,
    kind_error,
    require_all_matched,
    require_divides,
    role_of,
)

__all__ = ["RolePlan"]

# (role, pattern, the rule's index: None for a role a module's role gives its child)
Found = tuple[TPRole, str, int | None]


class RolePlan:
    """The roles ``rules`` give one model's submodules, for the front end ``kinds`` names:
    ``modules`` (every submodule met: path -> class, for errors that list them), ``roles``
    (module path -> ``(role, pattern, layer)``), ``splits`` (parameter path -> its ``(dim,
    axis, pattern)`` splits: two for an expert kernel split within), ``whole`` (parameter path
    -> the axis a role reads blocks of it over, stored whole there) and the rules that named a
    module.

    >>> from fsdp_tp.tp import HeadParallel, Layer
    >>> from fsdp_tp.tp._protocol import Kinds
    >>> from fsdp_tp.tp._rules import compile_tp_rules
    >>> plan = RolePlan(compile_tp_rules([("attn$", HeadParallel())], "example"), Kinds("nnx", {}))
    >>> plan.role_of("block/attn")[1], plan.role_of("block/mlp")
    ('attn$', None)
    >>> plan.give("block/attn", plan.role_of("block/attn"), Layer("attention", "block/attn", num_heads=4))
    >>> type(plan.role_of("block/attn/out")[0]).__name__   # a child's role is its module's role's
    'RowParallel'
    >>> sorted(plan.splits)[:2]
    ['block/attn/key/bias', 'block/attn/key/kernel']
    """

    def __init__(self, rules: tuple[CompiledRole, ...], kinds: Kinds):
        self.rules, self.kinds = rules, kinds
        self.modules: dict[str, type] = {}
        self.roles: dict[str, tuple[TPRole, str, Layer]] = {}
        self.splits: dict[str, tuple[tuple[int, AxisName, str], ...]] = {}
        self.whole: dict[str, AxisName] = {}
        self.used: set[int] = set()

    def role_of(self, path: str) -> Found | None:
        """``(role, pattern, rule index)`` of the module at ``path``: inside a module a role
        computes, what that role gives its child of that name (``inner``), never the rules (the
        role computes its module's children; index None); elsewhere the first rule naming it."""
        parts = path.split("/")
        for k in range(1, len(parts)):
            governing = "/".join(parts[:k])
            if governing in self.roles:
                inner = self.roles[governing][0].inner()
                name = "/".join(parts[k:])
                return (inner[name], f"{governing} (inside)", None) if name in inner else None
        return role_of(path, self.rules)

    def require_kind(self, path: str, found: Found, cls: type) -> None:
        """The role ``found`` names computes a module of class ``cls`` (at ``path``); else the
        error that names a rule that works, from the modules met so far."""
        role, pattern, _ = found
        if not self.kinds.takes(role, cls):
            raise kind_error(role, pattern, cls, path, self.modules, self.kinds)

    def meet(
        self,
        front: FrontEnd,
        module: Any,
        path: str,
        found: Found,
        call: tuple[tuple, dict],
        params: Sequence[str] | None = None,
    ) -> Layer:
        """The module at ``path``, called with ``call``'s ``(args, kwargs)``, computes with the role
        ``found`` names (:meth:`role_of`): its kind checked, the layer ``front`` sees, then given
        (:meth:`give`, ``params`` as there) and returned. The one way a front end records a module
        a rule names."""
        self.require_kind(path, found, type(module))
        layer = front.layer_of(module, path, *call)
        self.give(path, found, layer, params)
        return layer

    def give(self, path: str, found: Found, layer: Layer, params: Sequence[str] | None = None) -> None:
        """The module at ``path`` computes with the role ``found`` names: its splits of
        ``layer``'s parameters (of ``params`` where given: a layer without a bias has none to
        split) and those it keeps whole are recorded."""
        role, pattern, index = found
        if index is not None:
            self.used.add(index)
        self.roles[path] = (role, pattern, layer)
        add_placements(self.splits, path, role, layer, pattern, params)
        kept = (f"{path}/{name}" for name in role.kept_whole(layer))
        self.whole |= {name: role.axis for name in kept if params is None or name in params}

    def require_divides(self) -> None:
        """Per device (the axes bound): every role's axis divides what it splits."""
        for role, pattern, layer in self.roles.values():
            require_divides(role, pattern, layer)

    def require_all_matched(self, params: Sequence[str]) -> None:
        """Every rule named a submodule (of those met, whose parameters are ``params``)."""
        require_all_matched(self.rules, self.used, self.modules, params, self.kinds)

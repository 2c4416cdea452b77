"""The core of TP by rules: a submodule a rule names runs on its slices, from outside.

An ``nn.intercept_methods`` interceptor sees every submodule call of the transformed
model. At init it lets a named submodule create its full parameters from its own rng
(so the init is the unsplit model's, bit for bit) and records, per parameter path, the
dim its role splits, which the transform's :func:`~fsdp_tp.linen._transform.store` adds to the
rule's layout (:func:`fsdp_tp.tp._storage.with_split`). At apply it runs a clone of the submodule bound to
the same scope, with the attributes that make it compute on the local sizes (a
``Dense`` with ``features / size``), so flax reads the stored slices as the module's
own parameters; the role puts the collectives around that call
(:mod:`fsdp_tp.tp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar

import flax.linen as nn
import jax
from flax import errors as flax_errors
from flax.core import meta

from .._axes import require_axes, varying_axes
from .._tree import module_path
from ..tp import Layer, TPRole
from ..tp._front import Kinds, Local, RolePlan, compute, require_divides, require_own_parameters, slice_error
from ._call import calling, current
from ._gather import GatheredOnRead
from .tp_rules import LINEN, layer_of, local_attributes

__all__ = ["LinenFront", "Seen", "local_compute"]


@dataclasses.dataclass
class Seen:
    """What one call of the model saw: the role plan it fills (the core's: every submodule, the
    role each computes with, the splits the roles make, the rules that matched), the parameter
    paths the transform stored (at init), and the local clones of the call."""

    plan: RolePlan
    params: list[str] = dataclasses.field(default_factory=list)
    clones: dict[tuple, tuple[nn.Module, nn.Module]] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def local_compute(seen: Seen) -> Iterator[None]:
    """Within: every submodule a rule names (or its module's role, ``inner``) computes on its
    slices, and ``seen.plan`` records it as the call reaches it."""
    with nn.intercept_methods(functools.partial(_intercept, LinenFront(seen))):
        yield


def _intercept(front: LinenFront, next_fun, args, kwargs, context):
    module: nn.Module = context.module
    if id(module) in current().local:  # (a clone on slices, through the interceptor again)
        return next_fun(*args, **kwargs)
    path, plan = module_path(module.path), front.seen.plan
    initializing = module.is_initializing()
    if initializing and context.method_name == "__call__":
        plan.modules.setdefault(path, type(module))
    found = plan.role_of(path)
    if found is not None and context.method_name == "setup" and not initializing:
        # flax runs a setup-style module's setup (nn.Embed reads its table there) before any
        # interceptor sees the call; the clone runs its own, on the local sizes.
        return None
    if found is None or context.method_name not in found[0].methods:
        return next_fun(*args, **kwargs)
    role, pattern, _ = found
    if not front.kinds.takes(role, type(module)):
        next_fun(*args, **kwargs)  # to name the module's children in the error
        plan.require_kind(path, found, type(module))
    require_axes(role.axis, f"tp rule {pattern!r}")
    # (met before the call: its children's roles are its role's)
    layer = plan.meet(front, module, path, found, (args, kwargs))
    if initializing:
        require_divides(role, pattern, layer)
        out = next_fun(*args, **kwargs)
        # (a layer that made parameters the role does not split is refused, as NNX's is)
        require_own_parameters(role, pattern, layer, type(module), list(module.variables.get("params", {})))
        return out
    return compute(front, role, module, context.method_name, layer, args, kwargs)


@dataclasses.dataclass(frozen=True)
class LinenFront:
    """The Linen front end as the core's roles see it (:class:`~fsdp_tp.tp._front.FrontEnd`),
    within one call of the model (``seen``: its local clones)."""

    seen: Seen
    kinds: ClassVar[Kinds] = LINEN

    def layer_of(self, module: nn.Module, path: str, args: tuple, kwargs: dict) -> Layer:
        return layer_of(module, args, kwargs)  # (its path is the module's own, as flax names it)

    def with_local(
        self, module: nn.Module, method: str, role: TPRole, layer: Layer, local: Local, args, kwargs
    ):
        """A clone of ``module`` with ``local``'s sizes as its attributes, bound to its scope
        (flax reads the stored blocks as its own parameters), running ``method``."""
        clone = _clone(self.seen, module, local_attributes(module, local, args, kwargs))
        return _runner(clone, method, role, layer.path, local)


def _clone(seen: Seen, module: nn.Module, attributes: dict) -> nn.Module:
    """The module with ``attributes``, bound to its scope; one per module, so a second method
    call (``nn.Embed.attend`` after ``__call__``) does not run a setup-style module's setup twice."""
    key = (id(module), tuple(sorted(attributes.items())))
    if key not in seen.clones:  # the module is kept with its clone, so its id is not reused
        seen.clones[key] = (module, module.clone(parent=module.scope, **attributes))
    return seen.clones[key][1]


def _read_as_blocks(clone: nn.Module, blocks: Mapping[str, int], size: int) -> None:
    """``clone`` reads each parameter ``blocks`` names as this device's block along its dim while
    its attributes keep the unsharded sizes (a module of raw kernels): flax checks a stored
    parameter's shape against its init's at every read, so the init the clone's ``param`` checks
    against is the block's (the module's own sizes, a ``size``-th of the dim) and a mistake in
    them is still caught."""
    own = type(clone).param

    def param(name: str, init_fn: Callable, *init_args, **init_kwargs):
        if name in blocks:
            init_fn = functools.partial(_block_init, init_fn, blocks[name], size)
        return own(clone, name, init_fn, *init_args, **init_kwargs)

    object.__setattr__(clone, "param", param)  # (the module's own code calls self.param)


def _block_init(init_fn: Callable, dim: int, size: int, *args, **kwargs):
    """``init_fn``'s value cut to the first of ``size`` blocks along ``dim``: its shape, which
    flax's check reads (abstractly; nothing here is drawn)."""
    cut = lambda x: jax.lax.slice_in_dim(x, 0, x.shape[dim] // size, axis=dim % x.ndim)
    return jax.tree.map(cut, init_fn(*args, **kwargs))


def _runner(clone: nn.Module, method: str, role: TPRole, path: str, local: Local):
    """``clone``'s ``method``, reading each parameter ``local.read`` names through its function
    (a block of a parameter kept whole: flax's ``map_variables`` over the module's own scope)
    and each ``local.blocks`` names as a block (on the module the call runs: map_variables
    binds a clone of its own)."""
    size = jax.lax.axis_size(local.blocks_axis or role.axis) if local.blocks else 0

    def call(module: nn.Module, *args, **kwargs):
        if local.blocks:
            _read_as_blocks(module, local.blocks, size)
        with calling(local=current().local | {id(module)}):
            return getattr(module, method)(*args, **kwargs)

    if local.read:
        call = nn.map_variables(call, "params", trans_in_fn=functools.partial(_read, local.read, role.axis))

    def run(*args, **kwargs):
        try:
            return call(clone, *args, **kwargs)
        except flax_errors.ScopeParamShapeError as err:
            raise slice_error(path, role, err) from None

    return run


def _read(read: Mapping[str, Callable], axis: str, variables: dict) -> dict:
    """``variables`` (``{"params": the module's own}``) with each parameter ``read`` names
    replaced by its function of the stored value, unboxed (a block the transform gathers at
    read is gathered first, its gradient then summed over ``axis`` on the block, under
    ``check_vma=True``, as NNX's ``ReadPlan.read_whole_over`` does: W_min over fsdp stays)."""
    params = variables["params"]
    for name, fn in read.items():
        *owners, leaf = name.split("/")
        owner = functools.reduce(lambda tree, key: tree[key], owners, params)
        if leaf in owner:
            stored = owner[leaf]
            if isinstance(stored, GatheredOnRead) and varying_axes(stored.block.value):
                stored = stored.replace(vary=stored.vary | {axis})
            owner[leaf] = fn(meta.unbox(stored))
    return variables

"""The seam between the core's roles and a front end, the one module of tp's insides a front end
imports besides the drivers (the check's, its plain calls', the finder's): what a front end does
for the roles (:class:`FrontEnd`, from :mod:`~fsdp_tp.tp._protocol`: its layer classes, a module
as a role sees it, the module's method on its local sizes), the one way a module a rule names
computes (:func:`compute`), which both front ends call, as the role plan's
:meth:`~fsdp_tp.tp._role_plan.RolePlan.meet` is the one way they record it, and everything
else the core gives a front end (``__all__``).

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

from typing import Any

import jax

from .._trace.graph import Graph
from .._trace.sites import module_of
from ._einsum import Equation
from ._experts import EXPERT
from ._find.plan import spelled
from ._protocol import FrontEnd, Kinds
from ._registered import computes_of
from ._role import Layer, Local, TPRole, axes_of
from ._role_plan import RolePlan
from ._rules import (
    CompiledRole,
    compile_tp_rules,
    dims,
    require_divides,
    require_own_parameters,
    role_of,
    slice_error,
)
from ._storage import require_no_tp_axis, spec_source, with_split

# What a front end does for the core (FrontEnd) and the one way it runs a role (compute), then what
# the core gives it besides the drivers (the plan check's, its plain calls', the finder's): these names and
# nothing else of tp's private modules (tests/test_layering.py keeps linen/ and nnx/ to this module,
# fsdp_tp.tp and the drivers), so tp's insides move freely and a front end's contract is one page.
__all__ = [
    "EXPERT",  # the expert axis's default name
    "CompiledRole",  # a tp rule as matched: its pattern and its role
    "Equation",  # an einsum layer's equation, for layer_of
    "FrontEnd",
    "Graph",  # a traced call, as the check and the finder read it
    "Kinds",  # a front end's module classes per layer kind
    "Layer",  # a module as a role sees it
    "Local",  # the sizes a role gives a module on one device
    "RolePlan",  # one model's roles, filled as a front end meets each module (RolePlan.meet)
    "TPRole",
    "axes_of",  # the mesh axes roles compute over
    "compile_tp_rules",  # the user's tp rules checked and compiled
    "compute",
    "computes_of",  # what a class of the user's registered as an einsum layer computes
    "dims",  # a layer attribute of one size or several, as a tuple
    "module_of",  # the module path a name stack ends in
    "require_divides",  # a layer's sizes checked against its rule's axes, in the step
    "require_no_tp_axis",  # a parameter no role splits, refused a split over a role's axis
    "require_own_parameters",  # a module a role computes holds only what the role splits
    "role_of",  # the first rule a path matches, and its role
    "slice_error",  # a module fed other sizes than its role's slices
    "spec_source",  # where a parameter's storage spec came from, for its errors
    "spelled",  # a role as the user writes it
    "with_split",  # a role's split added to a parameter's storage spec
]


def compute(front: FrontEnd, role: TPRole, module: Any, method: str, layer: Layer, args: tuple, kwargs: dict):
    """``module``'s ``method`` called with ``args`` and ``kwargs`` as ``role`` computes it
    (``layer``: ``front.layer_of(module, ...)``): the local sizes for this device's share of
    the role's axis, the front end's method on them, and the role's collectives around it
    (:meth:`~fsdp_tp.tp.TPRole.around`). The one way a front end runs a role a rule names."""
    local = role.local(layer, jax.lax.axis_size(role.axis))
    return role.around(
        method, front.with_local(module, method, role, layer, local, args, kwargs), layer, args, kwargs
    )

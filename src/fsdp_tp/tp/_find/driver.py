"""The plan finder driven once for every front end: :func:`find`.

``find_tp_rules(model, x, size=4)`` and ``tp_rules="auto"`` are one computation: the model's
call traced once, abstractly, Megatron's plan found from it
(:func:`~fsdp_tp.tp.auto.find_plan`), and, for an axis size, the plan checked where each
device computes (:mod:`fsdp_tp._check.driver`), each region the check refuses left whole with
its reason (:func:`~fsdp_tp.tp._find.plan.fitted`). A front end only traces its model's call and
initializes the model under a plan (a :class:`FindCall`); the sizes are the ones a user
passes (:class:`Sizes`, checked on an abstract mesh of them) or the bound axes' under the
mesh (:meth:`Sizes.here`, for ``"auto"``).

>>> import jax, jax.numpy as jnp
>>> from fsdp_tp.tp import Layer
>>> def mlp(p, x):
...     return jax.nn.gelu(x @ p["up"]["kernel"]) @ p["down"]["kernel"]
>>> params = {"up": {"kernel": jnp.ones((8, 32))}, "down": {"kernel": jnp.ones((32, 8))}}
>>> layers = {"up": Layer("dense", "up", features=(32,), in_size=8),
...           "down": Layer("dense", "down", features=(8,), in_size=32)}
>>> call = FindCall("demo", lambda: (Graph.trace(mlp, params, jnp.ones((2, 8))), layers))
>>> [pattern for pattern, _ in find(call, Sizes()).rules]
['^up$', '^down$']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..._axes import TENSOR
from ..._context import STEP
from ..._trace.graph import Graph
from ..._trace.per_device import trace_per_device
from .._experts import EXPERT
from .._roles import Layer
from .finder import find_plan
from .mesh import AUTO_AXIS, auto_sizes, calling, plan_mesh, require_size
from .plan import TPPlan, fitted, warn_left_whole

# The finder as a front end calls it: find, and what a front end needs around its trace (the axis
# "auto" splits over by default, the scope that names the traced call's errors, the abstract mesh a
# plan is checked on, the warning for what the plan leaves whole).
__all__ = ["AUTO_AXIS", "FindCall", "Sizes", "calling", "find", "plan_mesh", "warn_left_whole"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The axes a plan is found for: ``axis`` of ``size`` devices (``None``: no tensor split
    checked, or none at all where ``axis`` is ``None``), and a mixture's experts on
    ``expert_axis`` of ``expert_size``. ``bound``: the sizes are the mesh's, bound where the
    plan is found (inside the step), so it is checked there; else on an abstract mesh of them."""

    axis: str | None = TENSOR
    size: int | None = None
    expert_axis: str = EXPERT
    expert_size: int | None = None
    bound: bool = False

    @classmethod
    def here(cls, where: str) -> Sizes:
        """The sizes ``tp_rules="auto"`` finds its plan for under the mesh
        (:func:`~fsdp_tp.tp._find.mesh.auto_sizes`; ``where``: the caller, for its refusal)."""
        axis, size, experts = auto_sizes(where)
        return cls(axis, size, EXPERT, experts, bound=True)

    @property
    def checked(self) -> bool:
        """Whether a plan for these sizes is checked where each device computes."""
        return self.size is not None or self.expert_size is not None


@dataclasses.dataclass(frozen=True)
class FindCall:
    """One call of a model as its front end traces it for the finder: ``trace()`` gives the
    unsharded call's graph and the modules a role can compute (``{path: Layer}``);
    ``attempt(plan, graph)`` initializes the model under ``plan`` and traces its call, which
    checks the plan against ``graph`` and raises the check's refusal (``None``: never checked).
    ``caller``: what the user called, as an error starts."""

    caller: str
    trace: Callable[[], tuple[Graph, Mapping[str, Layer]]]
    attempt: Callable[[TPPlan, Graph], None] | None = None


def find(call: FindCall, sizes: Sizes, outputs_split: bool = False) -> TPPlan:
    """The plan Megatron's rules give ``call``'s model for ``sizes``, less each region the plan
    check refuses (left whole, with the check's reason). ``outputs_split``: the model's output
    may leave split on its last dim (logits for :func:`~fsdp_tp.vocab_parallel_cross_entropy`).
    A step's sequence split is not the plan's: it is found as on the whole sequence (as at init,
    where nothing is split), and the call it is found for checks the split after."""
    with STEP.scoped(sequence=None):
        return _find(call, sizes, outputs_split)


def _find(call: FindCall, sizes: Sizes, outputs_split: bool) -> TPPlan:
    require_size(sizes.size, call.caller)
    require_size(sizes.expert_size, call.caller)
    graph, layers = call.trace()
    plan = find_plan(
        graph, layers, sizes.axis, sizes.size, outputs_split, sizes.expert_axis, sizes.expert_size
    )
    if not sizes.checked or call.attempt is None:
        return plan
    attempt = call.attempt
    if sizes.bound:
        return fitted(plan, lambda p: attempt(p, graph))
    mesh = plan_mesh({sizes.axis or TENSOR: sizes.size, sizes.expert_axis: sizes.expert_size})
    return fitted(plan, lambda p: trace_per_device(lambda: attempt(p, graph), mesh, (), ()))

"""tp rules on an NNX model: the core's roles (:mod:`fsdp_tp.tp`) computing NNX layers on
their slices.

At :func:`~fsdp_tp.nnx.shard_by_rules` the rules are matched against the module paths of the
abstract model (:func:`role_plan`, which fills the core's role plan), so a wrong rule is named
before anything runs, and each role's split joins the parameter's storage spec. Inside the step
the model merged from the blocks has each named module's class swapped for a subclass whose
call runs the role (:func:`compute_roles`): the role puts Megatron's collectives around the
module's own ``__call__`` (``attend``), which runs with the local sizes as its attributes for
the call (``out_features / size``, ``num_heads / size``) and reads the stored slices. A swapped
class survives ``nnx.split`` / ``nnx.merge``, so the roles run inside the model's ``nnx.scan``.
"""

from __future__ import annotations

from flax import nnx

from .._types import AxisName
from ..tp._front import CompiledRole, RolePlan, compile_tp_rules, require_own_parameters
from ._layers import NNX, NNXFront, computed, path_text

__all__ = ["compute_roles", "role_plan", "tp_splits"]


def role_plan(model: nnx.Module, rules: tuple[CompiledRole, ...], params: list[str]) -> RolePlan:
    """The roles the tp rules give an NNX model's submodules (the core's :class:`RolePlan`),
    read off the abstract model, parents before children; a rule that names a module no role
    computes, or nothing, is refused."""
    modules = sorted(
        ((path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module) and path),
        key=lambda item: len(item[0]),
    )
    plan = RolePlan(rules, NNX)
    plan.modules.update({path_text(path): type(node) for path, node in modules})
    for path, node in modules:
        text = path_text(path)
        if (found := plan.role_of(text)) is None:
            continue
        layer = plan.meet(NNXFront(type(node)), node, text, found, ((), {}), params)
        own = [p[len(text) + 1 :] for p in params if p.startswith(text + "/")]
        require_own_parameters(found[0], found[1], layer, type(node), own)
    plan.require_all_matched(params)
    return plan


def tp_splits(model: nnx.Module, tp_rules) -> dict[str, tuple[tuple[int, AxisName], ...]]:
    """Where the roles of ``tp_rules`` split each parameter of ``model`` (abstract is enough):
    ``{parameter path: ((dim counted from the end, mesh axis), ...)}`` (two for an expert
    kernel whose hidden dim is split within: ``ExpertParallel(within=...)``), what :func:`shard_by_rules`
    adds to each storage spec. Storage rules that must leave those dims alone (FSDP on the
    largest dim tensor parallelism leaves whole, say) read it, so no table repeats the roles.

    >>> from flax import nnx
    >>> from fsdp_tp.tp import ColumnParallel, RowParallel
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.up, self.down = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
    >>> model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    >>> tp_splits(model, [("up$", ColumnParallel()), ("down$", RowParallel())])
    {'down/kernel': ((-2, 'tensor'),), 'up/kernel': ((-1, 'tensor'),), 'up/bias': ((-1, 'tensor'),)}
    """
    params = [path_text(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    plan = role_plan(model, compile_tp_rules(tp_rules, "fsdp_tp.nnx.tp_splits"), params)
    return {path: tuple((dim, axis) for dim, axis, _ in splits) for path, splits in plan.splits.items()}


def compute_roles(model: nnx.Module, plan: RolePlan) -> None:
    """Each module a role computes runs it from now on (its class swapped, in place)."""
    for path, node in nnx.iter_graph(model):
        if path and (text := path_text(path)) in plan.roles:
            role, _, layer = plan.roles[text]
            computed(node, role, layer.path, layer.kernel_shape)

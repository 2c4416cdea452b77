"""tp rules on an NNX model: the core's roles (:mod:`fsdp_tp.tp`) computing NNX layers on
their slices.

At :func:`~fsdp_tp.nnx.shard_by_rules` the rules are matched against the module paths of the
abstract model (:class:`RolePlan`), so a wrong rule is named before anything runs, and each
role's split joins the parameter's storage spec. Inside the step the model merged from the
blocks has each named module's class swapped for a subclass whose call runs the role
(:func:`compute_roles`): the role puts Megatron's collectives around the module's own
``__call__`` (``attend``), which runs with the local sizes as its attributes for the call
(``out_features / size``, ``num_heads / size``) and reads the stored slices. A swapped class
survives ``nnx.split`` / ``nnx.merge``, so the roles run inside the model's ``nnx.scan``.
"""

from __future__ import annotations

from flax import nnx

from .._types import AxisName
from ..tp import Layer, TPRole
from ..tp._rules import (
    CompiledRole,
    add_placements,
    compile_tp_rules,
    kind_error,
    require_all_matched,
    require_divides,
    require_own_parameters,
    role_of,
)
from ._layers import NNX, Path, computed, layer_of, path_text

__all__ = ["RolePlan", "compute_roles", "tp_splits"]


class RolePlan:
    """The roles the tp rules give an NNX model's submodules, read off the abstract model:
    ``roles`` (module path -> (role, pattern, layer)), ``splits`` (parameter path -> its
    ``(dim, axis, pattern)`` splits: two for an expert kernel split within), ``whole``
    (parameter path -> the axis a role reads blocks of it over, the parameter stored whole
    there). A rule that names a module no role computes, or nothing, is refused."""

    def __init__(self, model: nnx.Module, rules: tuple[CompiledRole, ...], params: list[str]):
        modules = sorted(
            ((path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module) and path),
            key=lambda item: len(item[0]),
        )
        types = {path_text(path): type(node) for path, node in modules}
        self.roles: dict[Path, tuple[TPRole, str, Layer]] = {}
        self.splits: dict[str, tuple[tuple[int, AxisName, str], ...]] = {}
        self.whole: dict[str, AxisName] = {}
        used: set[int] = set()
        for path, node in modules:
            text = path_text(path)
            if any(path[: len(p)] == p for p in self.roles):
                continue  # a child of a module a role computes: its role (if any) is the role's
            if (found := role_of(text, rules)) is None:
                continue
            role, pattern, index = found
            if NNX.of(type(node)) not in role.kinds:
                raise kind_error(role, pattern, type(node), text, types, NNX)
            used.add(index)
            self._give(path, node, role, pattern, params)
        require_all_matched(rules, used, types, params, NNX)

    def _give(self, path: Path, node: nnx.Module, role: TPRole, pattern: str, params: list[str]) -> None:
        text = path_text(path)
        layer = layer_of(node, text)
        own = [p[len(text) + 1 :] for p in params if p.startswith(text + "/")]
        require_own_parameters(role, pattern, layer, type(node), own)
        self.roles[path] = (role, pattern, layer)
        add_placements(self.splits, text, role, layer, pattern, params)
        kept = (f"{text}/{name}" for name in role.kept_whole(layer))
        self.whole |= {path: role.axis for path in kept if path in params}
        for name, inner in role.inner().items():
            self._give((*path, name), getattr(node, name), inner, f"{text} (inside)", params)

    def check_sizes(self) -> None:
        """Per device: every role's axis is a mesh axis whose size divides what it splits."""
        for role, pattern, layer in self.roles.values():
            require_divides(role, pattern, layer)


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
    plan = RolePlan(model, compile_tp_rules(tp_rules, "fsdp_tp.nnx.tp_splits"), params)
    return {path: tuple((dim, axis) for dim, axis, _ in splits) for path, splits in plan.splits.items()}


def compute_roles(model: nnx.Module, plan: RolePlan) -> None:
    """Each module a role computes runs it from now on (its class swapped, in place)."""
    for path, node in nnx.iter_graph(model):
        if path in plan.roles:
            role, _, layer = plan.roles[path]
            swapped = computed(type(node), role, layer.path, layer.kernel_shape)  # type: ignore[arg-type]
            object.__setattr__(node, "__class__", swapped)

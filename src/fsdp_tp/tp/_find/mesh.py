"""Where ``tp_rules="auto"`` and ``find_tp_rules`` find a plan: the axis it splits over
(:data:`AUTO_AXIS`) and its size under the mesh, the expert axis where it holds a mixture's
experts, the abstract mesh a plan is checked on, and the model's call on the inputs the
finder is given, whose errors say how to pass them.

>>> dict(plan_mesh({"tensor": 4, "expert": None}).shape)   # (an axis without a size: left out)
{'tensor': 4}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import jax
from jax.sharding import AbstractMesh, AxisType

from ..._axes import TENSOR, bound_axis_names
from ..._batch import step_batch_axes
from ...errors import RuleError
from .._experts import EXPERT

__all__ = [
    "AUTO_AXIS",
    "auto_expert_size",
    "auto_size",
    "auto_sizes",
    "calling",
    "plan_mesh",
    "require_size",
]

AUTO_AXIS = TENSOR  # the mesh axis tp_rules="auto" splits over, in both front ends


def auto_expert_size() -> int | None:
    """The size of the ``expert`` axis ``tp_rules="auto"`` puts a mixture's experts on: where it
    is bound, larger than 1 and splits the step's batch (an axis that does not cannot hold
    experts: :class:`~fsdp_tp.tp.ExpertParallel`); else ``None`` (experts are einsums like any
    other)."""
    if EXPERT not in bound_axis_names() or jax.lax.axis_size(EXPERT) == 1:
        return None
    step = step_batch_axes()
    return jax.lax.axis_size(EXPERT) if step is None or EXPERT in step else None


def auto_sizes(where: str = 'tp_rules="auto"') -> tuple[str | None, int | None, int | None]:
    """``(tensor axis, its size, expert size)`` ``tp_rules="auto"`` finds its plan for, under
    the mesh: no tensor axis (``None``) where the mesh's expert axis holds the experts and the
    mesh has no :data:`AUTO_AXIS`; else :func:`auto_size`'s."""
    experts = auto_expert_size()
    if experts is not None and AUTO_AXIS not in bound_axis_names():
        return None, None, experts
    return AUTO_AXIS, auto_size(where), experts


def auto_size(where: str = 'tp_rules="auto"') -> int | None:
    """The size of :data:`AUTO_AXIS` where it is bound (under the mesh), else ``None``: the
    size ``tp_rules="auto"`` finds its plan for (``None``: outside any mesh). Under a mesh
    without it, a :class:`~fsdp_tp.errors.RuleError` (``where``: the caller): the plan's roles
    would name an axis, in a rule the user never wrote."""
    bound = bound_axis_names()
    if AUTO_AXIS in bound:
        return jax.lax.axis_size(AUTO_AXIS)
    if bound:
        raise RuleError(
            f"{where} splits over mesh axis {AUTO_AXIS!r}, which this mesh does not have (its axes: "
            f"{', '.join(sorted(map(str, bound)))}): add a {AUTO_AXIS!r} axis to the mesh (e.g. "
            f"fsdp_tp.make_mesh({{..., {AUTO_AXIS!r}: 2}})), or drop tp_rules='auto' for FSDP alone."
        )
    return None


@contextlib.contextmanager
def calling(name: str, args: tuple, kwargs: dict) -> Iterator[None]:
    """Within, an error of the model ``name``'s own call on the inputs a plan finder was given
    (``args``, ``kwargs``: a keyword argument it requires, a shape it does not take) is a
    :class:`~fsdp_tp.errors.RuleError` naming the inputs and how to pass them; the library's
    own errors pass as they are."""
    try:
        yield
    except (TypeError, ValueError) as err:
        if type(err).__module__.startswith("fsdp_tp"):
            raise
        shapes = jax.tree.map(lambda a: getattr(a, "shape", a), (args, kwargs))
        raise RuleError(
            f"the plan finder traces {name}'s call on the inputs it is given, and it fails on "
            f"positional {shapes[0]} and keyword {shapes[1]}: {type(err).__name__}: {err}. Pass "
            f"what the call takes, as the step passes it: the inputs positionally, with the shapes "
            f"the model trains on, and its keyword arguments by name after them "
            f"(find_tp_rules(model, x, train=False), then tp_rules=plan; shard_by_rules(..., "
            f"inputs=) passes positional inputs only)."
        ) from err


def plan_mesh(sizes: Mapping[str, int | None]) -> AbstractMesh:
    """The abstract mesh a plan finder checks its plan on: the axes of ``sizes`` given a size."""
    given = {axis: size for axis, size in sizes.items() if size is not None}
    return AbstractMesh(tuple(given.values()), tuple(given), axis_types=(AxisType.Auto,) * len(given))


def require_size(size: object, where: str) -> None:
    """``size=`` of a plan finder: a whole number of devices >= 1 (``None``: unchecked)."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise RuleError(
            f"{where}: size={size!r} is not an axis size: pass the number of devices on the axis "
            f"the plan splits over, a whole number >= 1 (e.g. size=4), or leave it out for an "
            f"unchecked plan."
        )

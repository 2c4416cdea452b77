"""``tp_rules="auto"`` for a Linen model: the plan found per call (:class:`AutoRules`), checked
where each device computes by initializing the transform with its rules (:func:`attempt_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

from .._tree import static_split
from ..tp._find.driver import FindCall, Sizes, find, warn_left_whole
from ..tp._front import compile_tp_rules
from ..tp.auto import Graph, TPPlan
from ._check import fields_of, traced_as
from ._traced import traced

__all__ = ["AutoRules", "attempt_of"]


def attempt_of(make: Callable, fields: dict, args: tuple, kwargs: dict, rngs: Sequence[str]):
    """``attempt(plan, graph)`` (a :class:`~fsdp_tp.tp._find.driver.FindCall`'s): the model laid out by
    ``make(plan.rules)`` initialized abstractly where it is called (under a mesh): its init
    checks the plan (against ``graph``, the unsharded call the plan was found from), and
    raises the refusal."""
    arrays, rebuild = static_split(args, kwargs)
    shaped = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    streams = {name: jax.random.key(0) for name in ("params", *rngs)}

    def attempt(plan: TPPlan, graph: Graph) -> None:
        model = make(plan.rules)(**fields, parent=None)

        def init(values):
            call_args, call_kwargs = rebuild(values)
            return model.init(streams, *call_args, **call_kwargs)

        with traced_as(graph):
            jax.make_jaxpr(init)(shaped)

    return attempt


class AutoRules:
    """``tp_rules="auto"``: the rules of the plan found for ``target`` with a call's module
    fields and input shapes, and the bound ``tensor`` axis's size, checked there against what
    each device computes (``make(rules)``: the transform with those rules); one trace per call."""

    def __init__(self, target: type[nn.Module], make: Callable[[tuple], type]):
        self.target, self.make = target, make
        self.found: dict[str, tuple] = {}
        self.plans: dict[int | None, TPPlan] = {}  # the last plan found for each tensor size

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        fields = fields_of(module, self.target)
        shaped = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, (args, kwargs)
        )
        caller = f"shard_by_rules({self.target.__name__})"
        sizes = Sizes.here(f"shard_by_rules({self.target.__name__}, tp_rules='auto')")
        key = repr((fields, shaped, sizes))
        if key not in self.found:
            plain, (shaped_args, shaped_kwargs) = self.target(**fields, parent=None), shaped
            trace = lambda: traced(plain, shaped_args, shaped_kwargs, ("dropout",))
            attempt = attempt_of(self.make, fields, args, kwargs, ("dropout",))
            plan = find(FindCall(caller, trace, attempt), sizes)
            self.found[key] = compile_tp_rules(plan.rules, "shard_by_rules(tp_rules='auto')")
            said = self.plans.get(sizes.size)  # (a call of other shapes finds the plan again: said once)
            if said is None or [p for p, _ in said.whole] != [p for p, _ in plan.whole]:
                warn_left_whole(plan, sizes.size, caller, sizes.axis, sizes.expert_size)
            self.plans[sizes.size] = plan
        return self.found[key]

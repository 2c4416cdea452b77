"""The Megatron plan of a Linen model, found from what it computes (:func:`find_tp_rules`), and
found per call for ``tp_rules="auto"`` (:class:`AutoRules`). For an axis size, the plan is
checked against what each device computes (:mod:`fsdp_tp.tp._check`): a region the check refuses
(attention that regroups a device's features by its own head count) is left whole, with the
check's reason.

>>> import jax.numpy as jnp, flax.linen as nn
>>> class MLP(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(8, name="down")(nn.gelu(nn.Dense(32, name="up")(x)))
>>> print(find_tp_rules(MLP(), jnp.ones((2, 8))))
tp_rules = [
    (r"^up$", ColumnParallel()),
    (r"^down$", RowParallel()),
]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta
from jax.sharding import AbstractMesh, AxisType

from .._trace import trace_per_device
from .._tree import module_path, static_split
from ..errors import RuleError
from ..tp._plan import calling, fitted, require_size
from ..tp._rules import compile_tp_rules
from ..tp.auto import Graph, TPPlan, auto_size, find_plan, warn_left_whole
from ..tp.roles import Layer
from ._check import fields_of, traced_as
from .tp_rules import LINEN, layer_of

__all__ = ["AutoRules", "find_tp_rules", "plan_of"]


def find_tp_rules(
    module: nn.Module,
    *args: Any,
    axis: str = "tensor",
    size: int | None = None,
    outputs_split: bool = False,
    rngs: Sequence[str] = ("dropout",),
    **kwargs: Any,
) -> TPPlan:
    """The tp rules Megatron's plan gives ``module`` called on ``args`` (arrays or
    ``jax.ShapeDtypeStruct``; ``kwargs`` passed to the call as well): traced once,
    abstractly, its ``nn.Dropout`` off (the library draws each device's block of a dropout
    mask, whatever the plan). ``size``: the ``axis`` size the plan is for (a layer whose sizes
    it does not divide is left whole, or keeps its kv heads whole; the plan is then checked
    against a device's trace on an abstract mesh of that size, and a region the check refuses
    is left whole with its reason); ``outputs_split``: the model's output may leave split on its
    last dim (logits for :func:`fsdp_tp.vocab_parallel_cross_entropy`); ``rngs``: the rng
    streams the model draws from besides ``params``. Returns a :class:`~fsdp_tp.tp.auto.TPPlan`:
    its ``rules`` go to :func:`fsdp_tp.shard_by_rules` as ``tp_rules=``, and ``print(plan)``
    shows them, and the layers left whole with the reason."""
    if not isinstance(module, nn.Module):
        got = f"the class {module.__name__}" if isinstance(module, type) else f"a {type(module).__name__}"
        fix = (
            "build it: find_tp_rules(Model(...), x)"
            if isinstance(module, type)
            else "an NNX model's plan is fsdp_tp.nnx.find_tp_rules'"
        )
        raise RuleError(
            f"fsdp_tp.linen.find_tp_rules takes a Linen module and its call's inputs; got {got}: {fix}."
        )
    require_size(size, f"find_tp_rules({type(module).__name__})")
    graph, layers = _traced(module, args, kwargs, rngs)
    plan = find_plan(graph, layers, axis, size, outputs_split)
    if size is None:
        return plan
    from .rule_transform import shard_by_rules  # (the transform imports this module)

    mesh = AbstractMesh((size,), (axis,), axis_types=(AxisType.Auto,))
    make = lambda rules: shard_by_rules(type(module), tp_rules=rules)
    attempt = _attempt(make, fields_of(module, type(module)), args, kwargs, rngs, graph)
    return fitted(plan, lambda p: trace_per_device(lambda: attempt(p), mesh, (), ()))


def plan_of(module: nn.Module, args: tuple, kwargs: dict, size: int) -> tuple[dict[str, Layer], TPPlan]:
    """``module``'s layers and the plan found from its call on ``args`` for an axis of ``size``
    (not checked: what a refusal compares the rules given with)."""
    struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a
    graph, layers = _traced(module, jax.tree.map(struct, args), kwargs, ("dropout",))
    return layers, find_plan(graph, layers, size=size)


def _traced(module: nn.Module, args: tuple, kwargs: dict, rngs: Sequence[str]) -> tuple[Graph, dict]:
    """``module``'s init computing its output, read as a graph, and its layers by path."""
    streams = {name: jax.random.key(0) for name in ("params", *rngs)}
    layers: dict[str, Layer] = {}

    def seen(next_fun, call_args, call_kwargs, context):
        found = context.module
        if isinstance(found, nn.Dropout) and context.method_name == "__call__":
            return call_args[0] if call_args else call_kwargs["inputs"]
        if context.method_name == "__call__" and LINEN.of(type(found)) is not None:
            path = module_path(found.path)
            if path not in layers:
                layers[path] = layer_of(found, call_args, call_kwargs)
        return next_fun(*call_args, **call_kwargs)

    def init(args, kwargs):  # the output and the parameters, from one trace
        out, variables = module.init_with_output(streams, *args, **kwargs)
        # a boxed parameter (nn.with_logical_partitioning, as flax's examples write every layer)
        # is its value: what the matmul reads, at the module's path
        return out, jax.tree.map(_unboxed, variables["params"], is_leaf=_is_box)

    with nn.intercept_methods(seen), calling(type(module).__name__, args, kwargs):
        graph = Graph.trace_init(init, args, kwargs)
    return graph, layers


def _is_box(x) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _unboxed(x):
    return x.unbox(apply_constraint=False) if isinstance(x, meta.Partitioned) else x


def _attempt(make: Callable, fields: dict, args: tuple, kwargs: dict, rngs: Sequence[str], graph: Graph):
    """``attempt(plan)``: the model laid out by ``make(plan.rules)`` initialized abstractly
    where it is called (under a mesh): its init checks the plan (against ``graph``, the
    unsharded call the plan was found from), and raises the refusal."""
    arrays, rebuild = static_split(args, kwargs)
    shaped = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    streams = {name: jax.random.key(0) for name in ("params", *rngs)}

    def attempt(plan: TPPlan) -> None:
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
        size = auto_size(f"shard_by_rules({self.target.__name__}, tp_rules='auto')")
        key = repr((fields, shaped, size))
        if key not in self.found:
            plain, (shaped_args, shaped_kwargs) = self.target(**fields, parent=None), shaped
            graph, layers = _traced(plain, shaped_args, shaped_kwargs, ("dropout",))
            plan = find_plan(graph, layers, size=size)
            if size is not None:
                plan = fitted(plan, _attempt(self.make, fields, args, kwargs, ("dropout",), graph))
            self.found[key] = compile_tp_rules(plan.rules, "shard_by_rules(tp_rules='auto')")
            said = self.plans.get(size)  # (a call of other shapes finds the plan again: said once)
            if said is None or [p for p, _ in said.whole] != [p for p, _ in plan.whole]:
                warn_left_whole(plan, size, f"shard_by_rules({self.target.__name__})")
            self.plans[size] = plan
        return self.found[key]

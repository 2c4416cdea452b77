"""A Linen model's call read as a :class:`~fsdp_tp._trace.graph.Graph`, with its layers by path
(:func:`traced`: what the plan finder reads, boxed parameters as their values), also on the
shapes of a call's arguments alone (:func:`traced_on_shapes`: what a refused plan's letters are
compared with).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
from flax.core import meta

from .._tree import module_path
from ..tp import Layer
from ..tp._find.driver import calling
from ..tp.auto import Graph
from .tp_rules import LINEN, layer_of

__all__ = ["traced", "traced_on_shapes"]


def traced_on_shapes(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Graph, dict[str, Layer]]:
    """:func:`traced` on the shapes of ``args`` alone (a device's inputs vary over the batch
    axes under check_vma, and the casts between them and the whole parameters hide the matmuls
    from the finder)."""
    struct = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a
    return traced(module, jax.tree.map(struct, args), kwargs, ("dropout",))


def traced(module: nn.Module, args: tuple, kwargs: dict, rngs: Sequence[str]) -> tuple[Graph, dict]:
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

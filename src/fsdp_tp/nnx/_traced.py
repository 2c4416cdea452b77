"""An NNX model's call read as a :class:`~fsdp_tp._trace.graph.Graph` (:func:`traced`, what the
plan finder reads), and models whose modules' calls name their paths (:func:`scoped`): NNX
records no module in a trace, so the finder's trace and the plan check's pair operations by
these names.
"""

from __future__ import annotations

import jax
from flax import nnx

from ..tp import Layer
from ..tp._find.driver import calling
from ..tp._front import Graph
from ._layers import NNX, layer_of, path_text
from ._swap import Swap

__all__ = ["MARK", "scoped", "traced"]

MARK = "nnx:"  # a module's name scope: its path, "." for "/" (which separates the stack's levels)


def scoped(model: nnx.Module) -> nnx.Module:
    """``model`` with every module's ``__call__`` under a name scope of its path."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            _scoped(node, MARK + ".".join(map(str, path)))
    return model


@Swap.kind("path scope")
def _scoped(cls: type, name: str) -> dict:
    """A module whose ``__call__`` runs under the name scope ``name``."""
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        with jax.named_scope(name):
            return original(self, *args, **kwargs)

    return {"__call__": __call__}


def traced(model: nnx.Module, args: tuple, kwargs: dict) -> tuple[Graph, dict[str, Layer]]:
    """``model``'s call on ``args`` read as a :class:`~fsdp_tp.tp.auto.Graph`, its parameters
    the inputs, and the layers a role could compute, by path: what a plan is found from."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    flat = {path_text(path): (path, variable) for path, variable in nnx.to_flat_state(params)}
    layers = {
        path_text(path): layer_of(node, path_text(path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and NNX.of(type(node)) is not None
    }

    def forward(values: dict, rest: nnx.State, args: tuple, kwargs: dict):
        state = nnx.from_flat_state([(flat[p][0], flat[p][1].replace(value)) for p, value in values.items()])
        built = scoped(nnx.merge(graphdef, state, rest))  # (named as the plan check's traces are)
        for _, node in nnx.iter_graph(built):
            if isinstance(node, nnx.Dropout | nnx.MultiHeadAttention):
                # The library draws each device's block of their masks (fsdp_tp.dropout): the
                # plan is the model's without them. Noise a model draws itself stays in.
                node.deterministic = True
        return built(*args, **kwargs)

    values = {p: variable.get_raw_value() for p, (_, variable) in flat.items()}
    with calling(type(model).__name__, args, kwargs):
        return Graph.trace(forward, values, rest, args, kwargs), layers

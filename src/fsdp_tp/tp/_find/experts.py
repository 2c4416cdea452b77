"""Where the plan finder puts a mixture's experts when the mesh has an expert axis: each einsum
layer that computes one kernel per expert (a kernel letter in its input and its output both,
:attr:`~fsdp_tp.tp._einsum.Equation.batched`) gets :class:`~fsdp_tp.tp.ExpertParallel`, and the
bank's last layer sends the tokens back (``returns=True``).

With a tensor axis too, each expert's hidden dim goes over it within (:func:`with_within`).

Which layer is last is read from the trace, not from a name: a layer whose result reaches
another expert layer's matmul through operations that keep every element where it is
(elementwise ops, a transpose, a reshape, a cast: a gate's ``silu(gate) * up``) passes its
buffers on; a layer whose result reaches none sends them back.

>>> import jax, jax.numpy as jnp
>>> from fsdp_tp.tp import Layer
>>> from fsdp_tp.tp.auto import Graph
>>> def experts(p, x):  # (G, E, C, D) buffers through gate, up and down
...     h = jax.nn.silu(jnp.einsum("GECD,EDH->GECH", x, p["gate"]["kernel"]))
...     h = h * jnp.einsum("GECD,EDH->GECH", x, p["up"]["kernel"])
...     return jnp.einsum("GECH,EHD->GECD", h, p["down"]["kernel"])
>>> params = {n: {"kernel": jnp.ones(s)} for n, s in
...           [("gate", (4, 8, 16)), ("up", (4, 8, 16)), ("down", (4, 16, 8))]}
>>> layers = {n: Layer("einsum", n, equation=e, kernel_shape=params[n]["kernel"].shape)
...           for n, e in [("gate", "GECD,EDH->GECH"), ("up", "GECD,EDH->GECH"), ("down", "GECH,EHD->GECD")]}
>>> expert_banks(Graph.trace(experts, params, jnp.ones((2, 4, 3, 8))), layers)
{'gate': False, 'up': False, 'down': True}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..._trace.graph import Graph, kernel_operand, kernels_of
from ..._trace.relations import Node
from ...errors import IndivisibleShapeError, RuleError
from .._einsum import Equation
from .._experts import ExpertParallel
from .._role import Layer, TPRole
from .plan import ancestors

__all__ = ["expert_banks", "expert_roles", "raw_banks", "with_within"]

_MATMUL = ("dot_general",)


def _expert_layers(layers: Mapping[str, Layer]) -> set[str]:
    return {
        path
        for path, layer in layers.items()
        if layer.kind == "einsum" and Equation.parse(layer.equation, path).batched
    }


def _matmuls_of(graph: Graph, experts: set[str]) -> dict[int, str]:
    """``{node index: expert layer}`` of each matmul reading an expert layer's kernel."""
    kernels, found = kernels_of(graph), {}
    for index, node in enumerate(graph.nodes):
        if node.prim in _MATMUL and (kernel := kernel_operand(node, kernels)) is not None:
            module = graph.params[kernels[kernel]].rpartition("/")[0]
            if module in experts:
                found[index] = module
    return found


def _passes_on(graph: Graph, start: int, module: str, matmuls: dict[int, str]) -> bool:
    """Whether the result of matmul ``start`` reaches another expert layer's matmul through
    operations that keep its elements in place."""
    size = math.prod(graph.shapes[graph.nodes[start].outs[0]])
    seen, values = set(), [graph.nodes[start].outs[0]]
    while values:
        value = values.pop()
        for user in graph.users.get(value, []):
            if matmuls.get(user, module) != module:
                return True
            node = graph.nodes[user]
            if user in seen or node.prim in _MATMUL or len(node.outs) != 1:
                continue
            seen.add(user)
            if math.prod(graph.shapes[node.outs[0]]) == size:
                values.append(node.outs[0])
    return False


def expert_banks(graph: Graph, layers: Mapping[str, Layer]) -> dict[str, bool]:
    """``{path: returns}``: each expert einsum layer of ``layers`` the traced model ``graph``
    reads, in the model's order, with whether it sends the tokens back (no other expert layer
    reads its result)."""
    matmuls = _matmuls_of(graph, _expert_layers(layers))
    banks: dict[str, bool] = {}
    for index, module in matmuls.items():
        banks[module] = banks.get(module, True) and not _passes_on(graph, index, module, matmuls)
    return banks


def expert_roles(
    graph: Graph, layers: Mapping[str, Layer], axis: str, size: int, reasons: dict[str, str]
) -> dict[str, ExpertParallel]:
    """Each expert layer's :class:`ExpertParallel` over ``axis``; one whose experts ``size``
    does not divide is left to the other roles, its reason kept."""
    found: dict[str, ExpertParallel] = {}
    for path, returns in expert_banks(graph, layers).items():
        role = ExpertParallel(axis, returns=returns)
        try:
            role.require_divides(layers[path], size, path, lambda _: "")
        except IndivisibleShapeError as err:
            reasons[path] = str(err).split(";")[0]
            continue
        found[path] = role
    return found


def raw_banks(
    graph: Graph, layers: Mapping[str, Layer], axis: str, size: int, reasons: dict[str, str]
) -> dict[str, ExpertParallel]:
    """Each module of raw expert kernels no role's kind computes (``(E, d, h)`` parameters its own
    einsums read): a parameter every matmul reading it batches over one dim of it, the same
    each time (the experts' ``e`` of ``'gecd,edh->gech'``), is an expert kernel; the module's
    other parameters (a router its own call reads) stay whole. Its ``ExpertParallel(dims=...)``
    over ``axis``, where ``size`` divides the experts; else its reason is kept."""
    kernels, made = kernels_of(graph), {out: node for node in graph.nodes for out in node.outs}
    reads: dict[str, dict[str, set[int | None]]] = {}  # (None: a read batched over no dim of it)
    for node in graph.nodes:
        if node.prim not in _MATMUL or (kernel := kernel_operand(node, kernels)) is None:
            continue
        param = kernels[kernel]
        module, _, name = graph.params[param].rpartition("/")
        if not module or any(p in layers for p in ancestors(module)):
            continue
        _, (lb, rb) = node.params["dimension_numbers"]
        dims = lb if kernel == node.ins[0] else rb
        at = _param_dim(made, kernel, dims[0], param) if len(dims) == 1 else None
        reads.setdefault(module, {}).setdefault(name, set()).add(
            None if at is None else at - len(graph.shapes[param])
        )
    values = {path: value for value, path in graph.params.items()}
    found: dict[str, ExpertParallel] = {}
    for module, names in reads.items():
        dims = {name: next(iter(at)) for name, at in names.items() if len(at) == 1 and None not in at}
        if not dims or len(dims) < sum(None not in at for at in names.values()):
            continue  # (no expert kernel, or one read over two dims: no experts dim to split)
        experts = {graph.shapes[values[f"{module}/{name}"]][dim] for name, dim in dims.items()}
        if any(e % size for e in experts):
            said = ", ".join(map(str, sorted(experts)))
            reasons[module] = (
                f"ExpertParallel would split its {said} experts, which {axis!r} of {size} does not divide"
            )
            continue
        found[module] = ExpertParallel(axis, dims=dims)
    return found


def _param_dim(made: Mapping[int, Node], value: int, dim: int, param: int) -> int | None:
    """The dim of ``param`` that ``value``'s ``dim`` is, back through the layout operations
    that made ``value`` from it (a transpose jnp.einsum put before its matmul)."""
    while value != param:
        node = made.get(value)
        if node is None or not node.ins or node.ins[0] is None:
            return None
        source = node.ins[0]
        group = next((g for g in node.same if (value, dim) in g), [])
        dims = [d for v, d in group if v == source]
        if len(dims) != 1:
            return None
        value, dim = source, dims[0]
    return dim


def with_within(bank: ExpertParallel, found: TPRole | None) -> TPRole:
    """An expert layer's role: its :class:`ExpertParallel`, with the column or row role the
    tensor axis gives its einsum (each expert's hidden dim) inside, where it found one."""
    try:
        return dataclasses.replace(bank, within=found) if found is not None else bank
    except RuleError:  # (a split the experts' devices cannot take: the experts alone)
        return bank

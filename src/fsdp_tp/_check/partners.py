"""The layers a refused layer is split together with: what "leave it whole" must name.

A plan splits a column layer's output features and sums them back in the row layer that reads
them; the layers between them compute on a device's block. Left whole alone, a column layer
hands whole features to layers that expect blocks (its sibling projections' heads, the row
layer's split input), and the plan is refused again there. So a refusal's "leave it whole"
names the region: from the refused layer forward to the first layers that sum what it split
(a role whose name says ``Row``), and back from those to every layer with a role whose output
reaches them (q's siblings k and v).

Read off the unsharded model's trace (:class:`~fsdp_tp._trace.graph.Graph`), its operations named
as the plan check names them (``named(name stack) -> (module, role as written)``).

>>> _in_order(["out", "k", "q"], {"q": 0, "k": 1, "out": 2})
['q', 'k', 'out']
"""

from __future__ import annotations

from collections.abc import Callable

from .._trace.graph import Graph, kernel_operand, kernels_of
from .._trace.sites import scope_of

__all__ = ["partners"]

_MATMULS = ("dot_general", "conv_general_dilated")


def partners(graph: Graph, module: str, named: Callable[[str], tuple[str, str]]) -> list[str]:
    """``module`` and the layers with roles split with it (module paths in the model's order),
    or ``[module]`` where no layer that sums what it splits is reached."""
    kernels, order = kernels_of(graph), dict[str, int]()
    owner: dict[int, str] = {}  # a matmul's node index -> the module whose kernel it reads
    for index, node in enumerate(graph.nodes):
        if node.prim in _MATMULS and (kernel := kernel_operand(node, kernels)) is not None:
            named_as, role = named(scope_of(node))
            owner[index] = named_as if _ruled(role) else graph.params[kernels[kernel]].rpartition("/")[0]
            order.setdefault(owner[index], index)
    rows = _rows_reached(graph, owner, module, named)
    if not rows:
        return [module]
    found = set(rows) | {module}
    for index, row in owner.items():
        if row in rows:
            found |= _columns_feeding(graph, kernels, owner, index, named)
    return _in_order(found, order)


def _rows_reached(graph: Graph, owner: dict[int, str], module: str, named) -> set[str]:
    """The modules of the first matmuls with a row role that ``module``'s outputs reach."""
    start = [v for i, m in owner.items() if m == module for v in graph.nodes[i].outs]
    seen, rows, todo = set(start), set(), list(start)
    while todo:
        for index in graph.users.get(todo.pop(), ()):
            node = graph.nodes[index]
            if index in owner and owner[index] != module and "Row" in _role(named, node):
                rows.add(owner[index])
                continue  # (the sum: nothing past it is split by this region)
            for value in node.outs:
                if value not in seen:
                    seen.add(value)
                    todo.append(value)
    return rows


def _columns_feeding(
    graph: Graph, kernels: dict[int, int], owner: dict[int, str], row: int, named
) -> set[str]:
    """The modules with roles whose matmuls' outputs reach the matmul ``row`` (back to each)."""
    todo = [v for v in graph.nodes[row].ins if v is not None and v not in kernels]
    seen, found = set(todo), set()
    while todo:
        made = graph.producer.get(todo.pop())
        if made is None:
            continue
        if made in owner and _role(named, graph.nodes[made]):
            found.add(owner[made])
            continue
        for value in graph.nodes[made].ins:
            if value is not None and value not in seen and value not in kernels:
                seen.add(value)
                todo.append(value)
    return found


def _role(named, node) -> str:
    """The node's module's role as written, ``""`` where the plan gives it none."""
    role = named(scope_of(node))[1]
    return role if _ruled(role) else ""


def _ruled(role: str) -> bool:
    return not role.startswith("the ")  # ("the tp rules": no rule names the module)


def _in_order(modules, order: dict[str, int]) -> list[str]:
    return sorted(modules, key=lambda m: order.get(m, len(order)))

"""An expert layer's output sent back to the tokens' devices and straight back to the
experts' (``ExpertParallel(returns=True)`` on gate and up as well as down): the same numbers
at an all_to_all each way more than the bank needs, refused by the plan check
(:func:`~fsdp_tp._check.driver.check_plan`) in a device's trace, naming the layer that alone
should return.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
>>> def bank(x):  # gate's output back to the tokens' devices, then straight back to the experts'
...     back = jax.lax.all_to_all(x, "expert", 0, 1, tiled=True)
...     with jax.named_scope("down"):
...         return jax.lax.all_to_all(jax.nn.gelu(back), "expert", 1, 0, tiled=True)
>>> mesh = AbstractMesh((4,), ("expert",), axis_types=(AxisType.Auto,))
>>> routed = jax.shard_map(bank, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
>>> graph = Graph.trace(lambda p, x: routed(x), {}, jnp.ones((16, 16)))
>>> require_no_round_trip(graph, "demo", lambda scope: (scope.split("/")[-1] or "gate", ""))
Traceback (most recent call last):
...
fsdp_tp.errors.RuleError: demo: gate return their outputs to the tokens' devices ...
"""

from __future__ import annotations

from .._trace.graph import Graph
from .._trace.relations import ELEMENTWISE
from .._trace.sites import scope_of
from ..errors import RuleError
from .refusals import Named, blaming

__all__ = ["require_no_round_trip"]

# What moves no row between devices: a value's path from one all_to_all to another through these
# alone computes nothing the experts' devices could not (their buffers are the same rows).
_PASSING = ELEMENTWISE | {
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "expand_dims",
    "custom_vjp_call",
}


def require_no_round_trip(local: Graph, where: str, named: Named) -> None:
    """Refuses an expert layer's returned output that reaches another expert layer's dispatch
    through elementwise operations alone (``ExpertParallel(returns=True)`` on gate and up as
    well as down): equal numbers, an all_to_all each way more than the bank needs, each."""
    trips: dict[str, str] = {}  # the layer that returns -> the one that takes it back
    for start in (n for n in local.nodes if n.prim == "all_to_all"):
        seen, frontier = set(), list(start.outs)
        while frontier:
            for index in local.users.get(frontier.pop(), ()):
                node = local.nodes[index]
                if index in seen:
                    continue
                seen.add(index)
                if node.prim == "all_to_all" and node.params.get("axis_name") == start.params.get(
                    "axis_name"
                ):
                    trips.setdefault(named(scope_of(start))[0], named(scope_of(node))[0])
                elif node.prim in _PASSING:
                    frontier += node.outs
    if not trips:
        return
    sent, taken = ", ".join(trips), ", ".join(dict.fromkeys(trips.values()))
    raise blaming(
        RuleError(
            f"{where}: {sent} return their outputs to the tokens' devices (ExpertParallel(returns=True)), "
            f"and {taken} {'send' if len(set(trips.values())) > 1 else 'sends'} them straight "
            f"back to the experts' devices: an all_to_all each way more "
            f"than the expert bank needs (one in, one out), for each, with the same numbers. Fix: "
            f"returns=True on the bank's last layer alone, the one whose output the combine reads "
            f"({taken}); ExpertParallel() on {sent}."
        ),
        next(iter(trips)),
        f"the plan check: {sent} return their outputs and {taken} takes them back",
    )

"""A traced computation as the plan finder reads it: one flat list of operations (every
nested ``jit``, custom derivative and ``remat`` inlined, a ``scan``'s body read once) over
numbered values, each operation saying which dims of its operands and results are the same
positions (:class:`~fsdp_tp._trace.relations.Node`'s ``same``) and which dims it mixes
(``mixes``; :mod:`fsdp_tp._trace.relations` knows JAX's primitives).

A split of one dim of a value is possible only if every operation it reaches keeps that
dim's positions apart: an elementwise op, a transpose or a reshape that keeps the dim
major in its group, a matmul's batch dims, a reduction over other dims. The finder
(:mod:`fsdp_tp.tp.auto`) walks these relations; this module reads the jaxpr, and says which
values are parameters moved about (:func:`kernels_of`: a matmul's kernel) and which dims a
matmul contracts (:func:`contracted_pairs`).

>>> import jax, jax.numpy as jnp
>>> graph = Graph.trace(lambda p, x: jnp.tanh(x @ p["w"]).sum(-1), {"w": jnp.ones((4, 8))}, jnp.ones((2, 4)))
>>> [node.prim for node in graph.nodes], graph.params
(['dot_general', 'tanh', 'reduce_sum'], {0: 'w'})
>>> graph.nodes[2].mixes  # the sum mixes the features: dim 1 of value 3, the tanh's result
{(3, 1): 'reduce_sum over dim 1 of [2,8]'}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore

from .._tree import module_path
from .relations import Node, relate

__all__ = ["Graph", "Node", "contracted_pairs", "kernel_operand", "kernels_of"]

# Operations that only move a parameter's values about: a kernel read through them is still
# the parameter (a cast to the compute dtype, a reshape to heads, a scan's slice of a stack).
_LAYOUT = frozenset(
    "convert_element_type reshape transpose squeeze slice scan_slice copy copy_p sharding_constraint".split()
)


class Graph:
    """The flat operations of ``fn(params, *args)`` traced once (abstractly: no device work).
    ``params``: ``{value id: parameter path}``; ``inputs``: the other arguments' ids;
    ``outputs``: the results' ids; ``shapes``: every value's shape."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.params: dict[int, str] = {}
        self.inputs: list[int] = []
        self.constants: set[int] = set()  # (values the model holds: no role slices them)
        self.outputs: list[int] = []
        self.users: dict[int, list[int]] = {}
        self.producer: dict[int, int] = {}

    @classmethod
    def trace(cls, fn: Callable, params: Any, *args: Any) -> Graph:
        """``fn(params, *args)``: ``params`` a pytree of arrays (or ``jax.ShapeDtypeStruct``),
        whose paths name the parameters as the rules do (``block_0/mlp/up/kernel``)."""
        return cls.read(jax.make_jaxpr(fn)(params, *args), params)

    @classmethod
    def read(cls, closed, params: Any) -> Graph:
        """The graph of ``closed``, a jaxpr traced of ``fn(params, ...)`` (what :meth:`trace`
        reads): a caller that runs the jaxpr too traces the function once."""
        graph = cls()
        named = _paths(params)
        env: dict[Any, int] = {}
        for i, var in enumerate(closed.jaxpr.invars):
            env[var] = graph._new(var.aval.shape)
            if i < len(named):
                graph.params[env[var]] = named[i]
            else:
                graph.inputs.append(env[var])
        graph._read(closed, env, len(closed.jaxpr.outvars))
        return graph

    @classmethod
    def trace_init(cls, fn: Callable, *args: Any) -> Graph:
        """``fn(*args) -> (output, params)``: a model's init that also computes its output
        (Linen's ``init_with_output``), one trace for both: its parameters are the values the
        initializers make, which the output reads."""
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        graph = cls()
        env = {var: graph._new(var.aval.shape) for var in closed.jaxpr.invars}
        graph.inputs = list(env.values())
        outputs = len(jax.tree.leaves(shapes[0]))
        graph._read(closed, env, outputs)
        for var, path in zip(closed.jaxpr.outvars[outputs:], _paths(shapes[1]), strict=True):
            if not isinstance(var, jcore.Literal):
                graph.params[env[var]] = path
        return graph

    def _read(self, closed, env: dict, outputs: int) -> None:
        """The jaxpr's operations, its first ``outputs`` results the model's output."""
        for var in closed.jaxpr.constvars:
            env[var] = self._constant(var.aval.shape)
        self._inline(closed.jaxpr, env)
        self.outputs = [env[v] for v in closed.jaxpr.outvars[:outputs] if not isinstance(v, jcore.Literal)]
        for index, node in enumerate(self.nodes):
            for value in node.ins:
                if value is not None:
                    self.users.setdefault(value, []).append(index)
            for value in node.outs:
                self.producer[value] = index

    # -- reading the jaxpr -----------------------------------------------------------------

    def _new(self, shape) -> int:
        self.shapes[len(self.shapes)] = tuple(shape)
        return len(self.shapes) - 1

    def _constant(self, shape) -> int:
        self.constants.add(value := self._new(shape))
        return value

    @staticmethod
    def _id(env: dict, var) -> int | None:
        return None if isinstance(var, jcore.Literal) else env[var]

    def _inline(self, jaxpr, env: dict, callers: tuple = ()) -> None:
        for eqn in jaxpr.eqns:
            ins = [self._id(env, v) for v in eqn.invars]
            name = eqn.primitive.name
            if name == "scan":
                self._scan(eqn, self._values(eqn, ins), env, callers)
                continue
            inner = _call_body(eqn)
            if inner is not None:  # a jit, a custom derivative, a remat: its body, inline
                body = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
                scope = {v: self._constant(v.aval.shape) for v in body.constvars}
                scope |= dict(zip(body.invars, self._values(eqn, ins), strict=True))
                self._inline(body, scope, (eqn.source_info, *callers))
                for outer, v in zip(eqn.outvars, body.outvars, strict=True):
                    literal = isinstance(v, jcore.Literal)  # (a constant result: a value of its own)
                    env[outer] = self._constant(outer.aval.shape) if literal else scope[v]
                continue
            outs = [self._new(v.aval.shape) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs, strict=True))
            self._add(Node(name, ins, outs, dict(eqn.params), source=eqn.source_info, callers=callers))

    def _values(self, eqn, ins: list[int | None]) -> list[int]:
        """An operation's operands as values, a literal as a constant of its own (a body's input)."""
        return [
            self._constant(v.aval.shape) if i is None else i for i, v in zip(ins, eqn.invars, strict=True)
        ]

    def _scan(self, eqn, ins: list[int], env: dict, callers: tuple) -> None:
        """A scan's body read once: its consts are the outer values, each step's slice of an
        ``xs`` a value one dim smaller (dims matched past the scanned dim), its ``ys`` stacked
        likewise; the carry crosses steps, so it takes no split (a ``carry`` node, all dims mixed)."""
        body = eqn.params["jaxpr"].jaxpr
        consts, carry = _scan_counts(eqn.params)
        scope: dict[Any, int] = {v: self._constant(v.aval.shape) for v in body.constvars}
        for i, var in enumerate(body.invars):
            if i < consts:
                scope[var] = ins[i]
                continue
            scope[var] = self._new(var.aval.shape)
            kind = "carry" if i < consts + carry else "scan_slice"
            self._add(Node(kind, [ins[i]], [scope[var]], {}))
        self._inline(body, scope, (eqn.source_info, *callers))  # (the scan's: a backward's, say)
        for j, (outer, var) in enumerate(zip(eqn.outvars, body.outvars, strict=True)):
            env[outer] = self._new(outer.aval.shape)
            self._add(Node("carry" if j < carry else "scan_stack", [self._id(scope, var)], [env[outer]], {}))

    def _add(self, node: Node) -> None:
        relate(node, self.shapes)
        self.nodes.append(node)


def _scan_counts(params: dict) -> tuple[int, int]:
    """A scan's consts and carry counts: jax 0.10 names them, 0.12 gives its operands as a
    flat tree of three (``ft_in``: consts, carry, xs; each ``len`` its leaves)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _paths(tree) -> list[str]:
    return [
        module_path(tuple(_key(k) for k in path)) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _key(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _call_body(eqn):
    """The one body of a call-like operation whose operands and results are its body's
    (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``), else ``None``."""
    bodies = [p for p in eqn.params.values() if isinstance(p, jcore.Jaxpr | jcore.ClosedJaxpr)]
    if len(bodies) != 1:
        return None
    body = bodies[0].jaxpr if isinstance(bodies[0], jcore.ClosedJaxpr) else bodies[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return bodies[0]


def kernels_of(graph: Graph) -> dict[int, int]:
    """``{value: the parameter it is}`` for every value that is a parameter moved about (or,
    in a traced init, a scan step's slice of a parameter it stacks)."""
    kernels = {v: v for v in graph.params}
    for node in reversed(graph.nodes):
        if node.prim == "scan_stack" and node.outs[0] in kernels and node.ins[0] is not None:
            kernels[node.ins[0]] = kernels[node.outs[0]]
    for node in graph.nodes:
        if node.prim in _LAYOUT and node.ins[0] in kernels:
            kernels[node.outs[0]] = kernels[node.ins[0]]
    return kernels


def kernel_operand(node: Node, kernels: dict[int, int]) -> int | None:
    """The operand of a matmul that is a parameter (its kernel), when exactly one is."""
    a, b = node.ins[0], node.ins[1]
    if (a in kernels) == (b in kernels):
        return None
    return a if a in kernels else b


def contracted_pairs(node: Node) -> dict[tuple[int, int], tuple[int, int]]:
    """The pairs of dims a matmul contracts, each way."""
    if node.prim == "conv_general_dilated":
        x, k = node.params["contracted"]
        return {x: k, k: x}
    (lc, rc), _ = node.params["dimension_numbers"]
    a, b = node.ins[0], node.ins[1]
    assert a is not None and b is not None  # (a kernel's matmul: no literal operand)
    pairs: dict[tuple[int, int], tuple[int, int]] = {}
    for i, j in zip(lc, rc, strict=True):
        pairs[(a, i)], pairs[(b, j)] = (b, j), (a, i)
    return pairs

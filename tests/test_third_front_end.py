"""Issue 83: a third front end costs the lines of its adapter, nothing in the core.

A front end for plain functions of a parameter dict (no Flax), written here as a user would:
a table of its layer classes and four methods (a layer as a role sees it, its method on the
local sizes, a layer's call under its rule named by its path, and the trace of a call). The
core's roles compute its column/row pair (``compute``) and the core's driver checks its plan
(``check_call``): equal to the unsharded function, and a norm between the pair refused at
its line, as for Linen and NNX.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._check.driver import PlanCall, check_call, own_trace, switched_off
from fsdp_tp._trace.graph import Graph
from fsdp_tp.errors import RuleError
from fsdp_tp.tp import ColumnParallel, Layer, RowParallel
from fsdp_tp.tp._front import FrontEnd, Kinds, compute
from tests.refusals import named_fix

SIZES = {"up": 32, "down": 8}  # each layer's output features, as the unsharded model has them


@dataclasses.dataclass
class Dense:
    """The other library's layer: its size and its kernel (this device's block in the step)."""

    features: int
    kernel: jax.Array

    def __call__(self, x):
        return x @ self.kernel


class Plain:
    """The adapter: the layer classes per kind, and four methods."""

    kinds = Kinds("plain", {"dense": (Dense,)})

    def __init__(self, rules: dict):
        self.rules = rules  # {layer path: role}

    def layer_of(self, module, path, args, kwargs):
        return Layer("dense", path, features=(module.features,), in_size=args[0].shape[-1])

    def with_local(self, module, method, role, layer, local, args, kwargs):
        sized = {"features": local.features[0]} if local.features else {}  # (a row layer's stay)
        return getattr(dataclasses.replace(module, **sized), method)

    def call(self, path: str, kernel, x, sharded: bool):
        """The layer at ``path`` on ``x``, under its rule where ``sharded``, named by its path."""
        with jax.named_scope(path):
            dense, role = Dense(SIZES[path], kernel), self.rules.get(path) if sharded else None
            if role is None:
                return dense(x)
            return compute(self, role, dense, "__call__", self.layer_of(dense, path, (x,), {}), (x,), {})

    def named(self, scope: str) -> tuple[str, str]:
        path = scope.split("/")[0]
        role = self.rules.get(path)
        return (path, f"{type(role).__name__}() (tp rule {path!r})") if role else (path, "the tp rules")


def mlp(front, p, x, sharded):
    return front.call("down", p["down"], jax.nn.gelu(front.call("up", p["up"], x, sharded)), sharded)


def normed_mlp(front, p, x, sharded):
    h = front.call("up", p["up"], x, sharded)
    h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True))  # refused: a mean over split features
    return front.call("down", p["down"], h, sharded)


RULES = {"up": ColumnParallel(), "down": RowParallel()}


def _run(model, rules: dict):
    """``model`` split over tensor 4 by ``rules``, its plan checked by the core's driver first."""
    front = Plain(rules)
    params = {
        "up": jax.random.normal(jax.random.key(0), (8, 32)),
        "down": jax.random.normal(jax.random.key(1), (32, 8)),
    }
    x = jax.random.normal(jax.random.key(2), (4, 8))
    whole = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    def step(p, x):
        trace = lambda params, sharded: Graph.trace(lambda p, x: model(front, p, x, sharded), params, x)
        with own_trace():
            local, unsharded = trace(p, True), trace(whole, False)
        call = PlanCall(
            roles=tuple(rules.values()),
            written=f"the tp rules {sorted(rules)}",
            where="plain",
            same="x",
            local=lambda: local,
            unsharded=lambda whole=None: unsharded,
            named=front.named,
        )
        check_call(call, set())
        return model(front, p, x, True)

    split = {"up": P(None, "tensor"), "down": P("tensor", None)}  # (what the roles split; else whole)
    specs = {path: split[path] if path in rules else P() for path in split}
    mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
    out = jax.shard_map(step, mesh=mesh, in_specs=(specs, P()), out_specs=P())(params, x)
    return out, model(Plain({}), params, x, False)


def test_a_third_front_end_is_its_adapter_and_the_core_computes_and_checks_it():
    assert isinstance(Plain(RULES), FrontEnd) and len(inspect.getsourcelines(Plain)[0]) < 30
    out, unsharded = _run(mlp, RULES)
    np.testing.assert_allclose(out, unsharded, rtol=1e-5, atol=1e-5)
    line = next(i for i, text in enumerate(inspect.getsourcelines(normed_mlp)[0]) if "# refused" in text)
    where = inspect.getsourcelines(normed_mlp)[1] + line
    said = rf"^plain: ColumnParallel\(\) \(tp rule 'up'\) on up splits .*/test_third_front_end\.py:{where} "
    with pytest.raises(RuleError, match=said) as refused:
        _run(normed_mlp, RULES)
    named_fix(refused, "leave up whole together with down, the layers split with it (drop their tp rules)")
    out, unsharded = _run(normed_mlp, {})
    np.testing.assert_allclose(out, unsharded, rtol=1e-5, atol=1e-5)
    # (negative control) unchecked, the same plan computes another function
    with switched_off():
        out, unsharded = _run(normed_mlp, RULES)
    assert not np.allclose(out, unsharded, rtol=1e-3, atol=1e-3)

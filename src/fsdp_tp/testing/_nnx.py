"""An NNX model as the equivalence check calls a model (Linen's face: ``init(rng, x)`` and
``apply({"params": p}, x)``): laid out by :func:`fsdp_tp.nnx.shard_by_rules`, per device
(:class:`NNXSharded`), or unsharded (:class:`NNXTwin`), both built by the same constructor.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> twin = NNXTwin(lambda rngs: nnx.Linear(4, 2, rngs=rngs))
>>> params = twin.init(jax.random.key(0))["params"]
>>> sorted(params), twin.apply({"params": params}, jnp.ones((3, 4))).shape
(['bias', 'kernel'], (3, 2))
"""

from __future__ import annotations

from flax import nnx

from ..nnx import shard_by_rules
from ..nnx._constructor import built

__all__ = ["NNXSharded", "NNXTwin"]


class NNXSharded:
    """``make``'s model laid out by ``fsdp_tp.nnx.shard_by_rules(make, rules, **options)``, per
    device: ``init`` its blocks, ``apply`` the model merged from them."""

    def __init__(self, make, rules=(), **options):
        self.sharded = shard_by_rules(make, rules, **options)

    def init(self, rng, *_inputs):
        return {"params": self.sharded.init(rng)[0]}

    def apply(self, variables, x, **call):
        return self.sharded.merge(variables["params"])(x, **call)


class NNXTwin:
    """``make``'s model, unsharded: ``init`` its parameters from ``nnx.Rngs(rng)`` as a pure
    dict, ``apply`` the model with them."""

    def __init__(self, make):
        self.make = make
        self.graphdef, self.abstract = nnx.split(nnx.eval_shape(lambda: built(make, 0)))

    def init(self, rng, *_inputs):
        return {"params": _pure(nnx.state(built(self.make, rng), nnx.Param))}

    def apply(self, variables, x, **call):
        by_path = {path: leaf for path, leaf in _flat(variables["params"])}
        state = nnx.from_flat_state(
            [(path, v.copy(by_path[path])) for path, v in nnx.to_flat_state(self.abstract)]
        )
        return nnx.merge(self.graphdef, state)(x, **call)


def _pure(state) -> dict:
    out: dict = {}
    for path, variable in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = variable.get_raw_value()
    return out


def _flat(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, (*prefix, key))
        else:
            yield (*prefix, key), value

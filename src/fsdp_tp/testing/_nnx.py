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

import jax
from flax import nnx

from ..nnx import shard_by_rules
from ..nnx._constructor import built
from ..nnx._state import model_state_of, split_model
from ._arguments import called

__all__ = ["NNXSharded", "NNXTwin", "initial_state"]


class NNXSharded:
    """``make``'s model laid out by ``fsdp_tp.nnx.shard_by_rules(make, rules, **options)``, per
    device: ``init`` its blocks, ``apply`` the model merged from them and from the Variables
    other than parameters that ``make(nnx.Rngs(seed))`` holds (its own rngs: every call starts
    from the same draws, as a stateless step's does, and the twin's; ``model_state``: those
    Variables where the caller has them, :func:`initial_state`'s)."""

    def __init__(self, make, rules=(), *, seed: int = 0, model_state: dict | None = None, **options):
        self.sharded = shard_by_rules(make, rules, **options)
        self.model_state = initial_state(make, seed) if model_state is None else model_state

    def init(self, rng, *_inputs, **_keywords):
        return {"params": self.sharded.init(rng)[0]}

    def apply(self, variables, x, **call):
        return called(self.sharded.merge(variables["params"], self.model_state), x, **call)


class NNXTwin:
    """``make``'s model, unsharded: ``init`` its parameters from ``nnx.Rngs(rng)`` as a pure
    dict, ``apply`` the model with them and with the other Variables ``make(nnx.Rngs(seed))``
    holds (as :class:`NNXSharded`'s, ``model_state`` too)."""

    def __init__(self, make, *, seed: int = 0, model_state: dict | None = None):
        self.make = make
        self.graphdef, self.abstract = nnx.split(nnx.eval_shape(lambda: built(make, 0)))
        self.model_state = initial_state(make, seed) if model_state is None else model_state

    def init(self, rng, *_inputs, **_keywords):
        return {"params": _pure(nnx.state(built(self.make, rng), nnx.Param))}

    def apply(self, variables, x, **call):
        by_path = dict(_flat(variables["params"]))
        for name, tree in self.model_state.items():
            by_path.update(((name, *path), leaf) for path, leaf in _flat(tree))
        state = nnx.from_flat_state(
            [(path, v.copy(by_path[_key(path, v)])) for path, v in nnx.to_flat_state(self.abstract)]
        )
        return called(nnx.merge(self.graphdef, state), x, **call)


def initial_state(make, seed: int) -> dict:
    """The Variables other than parameters of ``make(nnx.Rngs(seed))`` (rng keys and counts,
    BatchNorm statistics), by type name, as :func:`~fsdp_tp.nnx._state.model_state_of` lays
    them out: empty for a model of parameters alone. One jitted build (its parameters unused)."""
    abstract = split_model(nnx.eval_shape(lambda: built(make, seed)))[2]
    if not nnx.to_flat_state(abstract):
        return {}
    return jax.jit(lambda: model_state_of(split_model(built(make, seed))[2]))()


def _key(path: tuple, variable) -> tuple:
    """A Variable's key in the apply's flat tree: a parameter's path, another's type and path."""
    return path if isinstance(variable, nnx.Param) else (type(variable).__name__, *path)


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

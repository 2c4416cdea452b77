""":func:`~fsdp_tp.testing.check_sharded`'s arguments checked before anything is built: each
mistake one line naming the argument, what was given and what works (it ended in a raw
``IndexError``, ``KeyError`` or ``'...' object is not callable`` deep in the harness); and the
inputs of a model that takes several (:class:`Inputs`).

>>> import optax
>>> require_arguments(batch=(1, 2), mesh={"data": 8}, steps=0, optimizers={}, rngs=None, batch_axes=None)
Traceback (most recent call last):
...
ValueError: fsdp_tp.testing.check_sharded: steps=0; the check takes at least one step: steps=1 ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .._axes import CONTEXT
from .._batch import DEFAULT_BATCH_AXES

__all__ = ["Inputs", "called", "require_arguments", "require_model"]

_CALLER = "fsdp_tp.testing.check_sharded"
_FACTORY = "{'sgd': lambda: optax.sgd(0.1)}"


@jax.tree_util.register_pytree_node_class
class Inputs:
    """The inputs of a model that takes several, as a batch's inputs: with
    ``Inputs(tokens, positions, mask=mask)`` the check calls ``model(tokens, positions,
    mask=mask)`` (Linen: ``apply(variables, tokens, positions, mask=mask)``); each array is a
    leaf of the batch, split as every leaf is (its rows; under a ``context`` axis its dim 1).

    >>> import jax.numpy as jnp
    >>> inputs = Inputs(jnp.ones((2, 4)), scale=jnp.full((2, 4), 3.0))
    >>> called(lambda x, scale: x * scale, inputs).sum().item()
    24.0
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def tree_flatten(self):
        names = tuple(sorted(self.kwargs))
        return (self.args, tuple(self.kwargs[n] for n in names)), names

    @classmethod
    def tree_unflatten(cls, names, children):
        args, values = children
        return cls(*args, **dict(zip(names, values, strict=True)))

    def __repr__(self) -> str:
        shown = [*(repr(getattr(a, "shape", a)) for a in self.args)]
        shown += [f"{k}={getattr(v, 'shape', v)!r}" for k, v in self.kwargs.items()]
        return f"Inputs({', '.join(shown)})"


def called(fn, inputs: Any, *before: Any, **extra: Any) -> Any:
    """``fn(*before, inputs, **extra)``, or, for :class:`Inputs`, ``fn(*before, *args,
    **kwargs, **extra)``."""
    if isinstance(inputs, Inputs):
        return fn(*before, *inputs.args, **inputs.kwargs, **extra)
    return fn(*before, inputs, **extra)


def require_model(model: Any) -> None:
    """A Linen class where an instance is taken: named, with the instance that works."""
    # (by its classes' modules: this module imports no flax.linen)
    if isinstance(model, type) and any(c.__module__.startswith("flax.linen") for c in model.__mro__):
        raise TypeError(
            f"{_CALLER}: model is the Linen class {model.__name__}; pass an instance with its fields, "
            f"{model.__name__}(...) (an NNX model is passed as its constructor, a Linen one as a module)."
        )


def require_arguments(
    *, batch: Any, mesh: Mesh | Mapping[str, int], steps: Any, optimizers: Any, rngs: Any, batch_axes: Any
) -> None:
    """Raises ``TypeError`` or ``ValueError`` for the first argument of these that cannot work."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        got = f"{len(batch)} values" if isinstance(batch, tuple | list) else _short(batch)
        raise TypeError(
            f"{_CALLER}: batch is (inputs, targets), the model's inputs and what loss(outputs, targets) "
            f"reads; got {got}: pass batch=(x, y)."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{_CALLER}: steps={steps!r}; the check takes at least one step: steps=1 or more.")
    _require_optimizers(optimizers)
    _require_rngs(rngs)
    _require_batch_axes(mesh, batch_axes)


def _require_optimizers(optimizers: Any) -> None:
    if not isinstance(optimizers, Mapping):  # (empty: init, outputs and gradients alone)
        raise TypeError(
            f"{_CALLER}: optimizers is a mapping of names to functions that make an optax transform; got "
            f"{_short(optimizers)}: pass e.g. optimizers={_FACTORY}."
        )
    for name, make in optimizers.items():
        if _is_transform(make):
            raise TypeError(
                f"{_CALLER}: optimizers[{name!r}] is an optax transform; give the function that makes "
                f"it (each side builds its own): optimizers={{{name!r}: lambda: <the transform>}}, e.g. "
                f"{_FACTORY}."
            )
        if not callable(make) or not _is_transform(made := make()):
            got = _short(make) if not callable(make) else f"a function returning {_short(made)}"
            raise TypeError(
                f"{_CALLER}: optimizers[{name!r}] is {got}; give a function that makes an optax "
                f"transform, e.g. {_FACTORY}."
            )


def _require_rngs(rngs: Any) -> None:
    if rngs is None:
        return
    bad = not isinstance(rngs, Mapping) or not all(
        isinstance(k, str) and hasattr(v, "dtype") for k, v in rngs.items()
    )
    if bad:
        raise TypeError(
            f"{_CALLER}: rngs is a mapping of stream names to keys, the streams the model draws from at its "
            f"call; got {_short(rngs)}: pass e.g. rngs={{'dropout': jax.random.key(0)}}."
        )


def _require_batch_axes(mesh: Mesh | Mapping[str, int], batch_axes: Any) -> None:
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh) if isinstance(mesh, Mapping) else None
    if shape is None:
        raise TypeError(
            f"{_CALLER}: mesh is a jax Mesh or axis sizes; got {_short(mesh)}: pass e.g. "
            f"mesh={{'data': 2, 'tensor': 4}}."
        )
    if batch_axes is None:
        if not any(axis in shape for axis in (*DEFAULT_BATCH_AXES, CONTEXT)):  # (context: the tokens)
            raise ValueError(
                f"{_CALLER}: the mesh {shape} has no axis the batch splits over "
                f"({' or '.join(DEFAULT_BATCH_AXES)}, the defaults): name one, batch_axes=(axis,), or add "
                f"a data axis of one device: mesh={ {'data': 1, **shape} }."
            )
        return
    names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    if missing := [axis for axis in names if axis not in shape]:
        raise ValueError(
            f"{_CALLER}: batch_axes={batch_axes!r} names {missing}, which the mesh {shape} does not have; "
            f"name axes of the mesh, e.g. batch_axes={tuple(a for a in shape if a != 'tensor')[:1]!r}."
        )


def _is_transform(value: Any) -> bool:
    return callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))


def _short(value: Any) -> str:
    """``value`` in a few words, on one line (an array by its shape and dtype)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(np.shape(value))} and dtype {value.dtype}"
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60]}{'...' * (len(text) > 60)}"

"""Fully sharded data parallelism as a Flax module transform.

At init every device computes the full parameter from the same rng and keeps
its slice (so the gathered init equals the unsharded init, bit for bit); for
compute, each slice is all-gathered, and the gradient comes back
reduce-scattered as the mean over the batch shards.
"""

from __future__ import annotations

import contextvars
import functools
import warnings

import flax.linen as nn
import jax
import numpy as np

from ._axes import axes_named, local_slice, require_axes, varying_axes
from ._types import AxisName, AxisNames, PyTree
from .collectives import gather_array_with_mean_grads
from .errors import ReplicatedParameterWarning

__all__ = ["gather_params", "keep_module_name", "shard_module_params", "shard_params"]

_Names = tuple  # one entry per dim: None, an axis name, or a tuple of axis names
_reported: set[tuple] = set()


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def _unbox(leaf) -> tuple[jax.Array, _Names]:
    if _is_box(leaf):
        return leaf.value, tuple(leaf.names)
    return leaf, (None,) * np.ndim(leaf)


def _shard_dim(shape: tuple[int, ...], names: _Names, axis_size: int) -> int | None:
    """The dim to split: the largest one that is unsplit and divisible; ties go to the later dim."""
    candidates = [
        i for i, (n, name) in enumerate(zip(shape, names, strict=True)) if name is None and n % axis_size == 0
    ]
    return max(candidates, key=lambda i: (shape[i], i), default=None)


def _report_replicated(path: str, shape, dtype, axis_name: AxisName, axis_size: int) -> None:
    key = (path, tuple(shape), axis_name, axis_size)
    if key in _reported:
        return
    _reported.add(key)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    warnings.warn(
        ReplicatedParameterWarning(
            f"shard_params: parameter {path} of shape {tuple(shape)} has no unsplit dim divisible by "
            f"mesh axis {axis_name!r} (size {axis_size}); it stays replicated ({nbytes} bytes on every "
            f"device). Pad a dim to a multiple of {axis_size}, or raise min_weight_size above "
            f"{int(np.prod(shape))} to keep it replicated without this warning."
        ),
        stacklevel=2,
    )


def shard_params(params: PyTree, axis_name: AxisName, min_weight_size: int = 2**18) -> PyTree:
    """Keeps this device's slice of every parameter larger than ``min_weight_size``.

    Call inside ``jax.shard_map``, on full parameters identical across ``axis_name``.
    Each large leaf becomes an ``nn.Partitioned`` local shard split along its
    largest unsplit dim that the axis size divides; splits over other axes are
    kept. A leaf with no such dim stays replicated, and a
    :class:`~fsdp_tp.errors.ReplicatedParameterWarning` names it once.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def local_view(params):
    ...     shard = shard_params(params, "fsdp", min_weight_size=0)["w"]
    ...     return shard.value
    >>> f = jax.shard_map(local_view, mesh=mesh, in_specs=P(), out_specs=P("fsdp"))
    >>> w = jnp.arange(32.0).reshape(16, 2)   # dim 0 (16) is the largest divisible dim
    >>> f({"w": w})[2:4].tolist()             # device 1 holds rows 2 and 3
    [[4.0, 5.0], [6.0, 7.0]]
    """
    (axis_name,) = require_axes(axis_name, "shard_params")
    size = jax.lax.axis_size(axis_name)

    def shard_leaf(path, leaf):
        value, names = _unbox(leaf)
        if axis_name in axes_named(names) or np.size(value) <= min_weight_size:
            return leaf
        dim = _shard_dim(np.shape(value), names, size)
        if dim is None:
            _report_replicated(
                jax.tree_util.keystr(path, simple=True, separator="/"),
                np.shape(value),
                value.dtype,
                axis_name,
                size,
            )
            return leaf
        local = local_slice(value, dim, axis_name)
        new_names = (*names[:dim], axis_name, *names[dim + 1 :])
        if _is_box(leaf):
            return leaf.replace(value=local, names=new_names)
        return nn.Partitioned(local, new_names)

    return jax.tree_util.tree_map_with_path(shard_leaf, params, is_leaf=_is_box)


def _gather_leaf(leaf, axis_name: AxisName, vary_over: frozenset, gather=gather_array_with_mean_grads):
    if not _is_box(leaf) or axis_name not in axes_named(leaf.names):
        return leaf
    names = tuple(leaf.names)
    dim = next(
        i
        for i, entry in enumerate(names)
        if axis_name == entry or (isinstance(entry, tuple) and axis_name in entry)
    )
    entry = names[dim]
    if isinstance(entry, tuple):
        # A dim split over (a, b) holds a contiguous block per (a, b) pair only
        # when b is gathered first; gathering a first would interleave blocks.
        if entry[-1] != axis_name:
            raise ValueError(
                f"gather_params: dim {dim} is split over {entry}; axis {axis_name!r} can only be "
                f"gathered after {entry[entry.index(axis_name) + 1 :]} (the minor axes first)."
            )
        rest = entry[:-1]
        remaining = rest if len(rest) > 1 else (rest[0] if rest else None)
    else:
        remaining = None
    shard = leaf.value
    if extra := tuple(sorted(vary_over - varying_axes(shard) - {axis_name}, key=str)):
        # Meet the inputs' vma on the shard, before the gather: JAX's transpose
        # of this pcast then psums the shard-sized gradient after the
        # reduce-scatter, instead of the full gradient before it.
        shard = jax.lax.pcast(shard, extra, to="varying")
    value = gather(shard, dim, axis_name)
    new_names = (*names[:dim], remaining, *names[dim + 1 :])
    if all(name is None for name in new_names):
        return value
    return leaf.replace(value=value, names=new_names)


def gather_params(params: PyTree, axis_name: AxisName, vary_over: AxisNames = ()) -> PyTree:
    """All-gathers every leaf split over ``axis_name``; the inverse of :func:`shard_params`.

    Splits over other axes stay boxed, a leaf left with no split is unboxed.
    The backward pass reduce-scatters the mean gradient
    (:func:`~fsdp_tp.collectives.gather_array_with_mean_grads`).

    ``vary_over`` (used with ``check_vma=True``): the axes the gathered values
    will meet device-varying data on, e.g. ``"data"``. Naming them moves JAX's
    implicit gradient psum over those axes from the full gradient to the
    shard; :func:`shard_module_params` fills it from its inputs' types.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> def roundtrip(params):
    ...     return gather_params(shard_params(params, "fsdp", min_weight_size=0), "fsdp")
    >>> w = jnp.arange(16.0).reshape(8, 2)
    >>> f = jax.shard_map(roundtrip, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    >>> bool((f({"w": w})["w"] == w).all())
    True
    """
    (axis_name,) = require_axes(axis_name, "gather_params")
    vary = frozenset(require_axes(vary_over, "gather_params") if vary_over else ())
    return jax.tree.map(
        functools.partial(_gather_leaf, axis_name=axis_name, vary_over=vary), params, is_leaf=_is_box
    )


def shard_module_params(target, axis_name: AxisName = "fsdp", min_weight_size: int = 2**18):
    """Wraps a Flax module class so its parameters live sharded over ``axis_name``.

    The result is a module class with ``target``'s arguments and name, so the
    parameter tree (paths, global shapes, dtypes) and the init are those of
    ``target`` on every mesh.

    Init keeps each device's slice (:func:`shard_params`); every call gathers
    them for compute (:func:`gather_params`). Composes with ``nn.remat`` and
    ``nn.scan``, and with itself for several axes.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 8})
    >>> Dense = shard_module_params(nn.Dense, axis_name="fsdp", min_weight_size=0)
    >>> init = jax.shard_map(lambda x: Dense(16).init(jax.random.key(0), x), mesh=mesh,
    ...                      in_specs=P("fsdp"), out_specs=P(), check_vma=False)
    >>> local = jax.eval_shape(init, jnp.ones((8, 4)))["params"]
    >>> local["kernel"].value.shape, local["kernel"].names   # per device: 16 / 8 columns
    ((4, 2), (None, 'fsdp'))
    """
    if isinstance(target, nn.Module):
        # An instance has already claimed its name in its parent, so it cannot
        # be re-created as the wrapped class under that name.
        cls = type(target).__name__
        raise TypeError(
            f"shard_module_params: got a {cls} instance ({target.name or 'unnamed'}); pass the class "
            f"and build the layer from the result: shard_module_params({cls}, axis_name="
            f"{axis_name!r})(...{cls} arguments...)."
        )
    return map_params(
        target,
        trans_in=lambda params: gather_params(params, axis_name, input_varying()),
        trans_out=functools.partial(shard_params, axis_name=axis_name, min_weight_size=min_weight_size),
    )


def map_params(target, trans_in, trans_out):
    """``nn.map_variables`` over ``"params"`` that keeps ``target``'s name and tells the
    transforms, while they run, the axes the call's inputs vary over
    (:func:`input_varying`) and the module's path (:func:`module_path`)."""
    mapped = nn.map_variables(
        target, trans_in_fn=trans_in, trans_out_fn=trans_out, mapped_collections="params", mutable=True
    )

    class Sharded(mapped):  # type: ignore[valid-type, misc]
        # nowrap: a wrapped method would run the module's setup() here, outside the
        # lifted scope, on the stored shards; the mapped __call__ runs it inside.
        @nn.nowrap
        def __call__(self, *args, **kwargs):
            # The axes the inputs vary over are where JAX would pcast the
            # gathered params anyway; gather_params does it on the shards.
            tokens = (
                _INPUT_VARYING.set(_varying_over_inputs((args, kwargs))),
                _MODULE_PATH.set("/".join(map(str, self.path))),
            )
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _MODULE_PATH.reset(tokens[1])
                _INPUT_VARYING.reset(tokens[0])

    return keep_module_name(Sharded, target)


_INPUT_VARYING: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "fsdp_tp_input_varying", default=frozenset()
)
_MODULE_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("fsdp_tp_module_path", default="")


def input_varying() -> frozenset:
    """Inside a :func:`map_params` transform: the axes the module's inputs vary over."""
    return _INPUT_VARYING.get()


def module_path() -> str:
    """Inside a :func:`map_params` transform: the wrapped module's path, ``"a/b"`` (root: ``""``)."""
    return _MODULE_PATH.get()


def _varying_over_inputs(tree) -> frozenset:
    axes: frozenset = frozenset()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array | jax.core.Tracer):
            axes |= varying_axes(leaf)
    return axes


def keep_module_name(mapped, target):
    """Gives a transformed module class its target's name.

    Flax auto-names submodules ``f"{type(module).__name__}_{i}"`` and derives
    their init rngs from those names; ``nn.map_variables`` returns a class
    named ``Map_variablesDense``, which would change both the parameter paths
    and the init (DESIGN.md invariants 1 and 2).
    """
    if isinstance(mapped, type):
        mapped.__name__ = target.__name__
        mapped.__qualname__ = target.__qualname__
    return mapped

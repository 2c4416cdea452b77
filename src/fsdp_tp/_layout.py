"""The layout core: does a ``PartitionSpec`` fit an array on a mesh, and this device's block of it.

Every check of a spec against a shape in the library comes here, so each mistake has one
error class and one wording, naming the path, the dim, the sizes, the axis and the fix:

- a spec with more entries than the array has dims, a mesh axis the mesh lacks, or one
  axis on two dims: :class:`~fsdp_tp.errors.SpecError`;
- a dim the axes do not divide: :class:`~fsdp_tp.errors.IndivisibleShapeError`.

A check over many leaves reports every failing leaf at once, as ``jax.shard_map`` does.

>>> from jax.sharding import PartitionSpec as P
>>> try:
...     check_fit([("w", (8, 6), P("fsdp", "tensor")), ("b", (6,), P("model"))], {"fsdp": 2, "tensor": 4})
... except IndivisibleShapeError as err:
...     print(err)
2 arrays do not fit their specs:
  w: dim 1 (size 6) of shape (8, 6) is not divisible by mesh axis 'tensor' (size 4); make it a multiple
     of 4 or change the spec.
  b: spec P('model',) names mesh axis 'model', but the mesh has axes {'fsdp': 2, 'tensor': 4}; use one of
     those names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import jax
from flax.core.meta import Partitioned
from jax.sharding import PartitionSpec

from ._axes import entry_axes, entry_of, local_slice
from ._types import AxisName
from .errors import IndivisibleShapeError, SpecError

__all__ = [
    "axis_text",
    "block_of",
    "check_fit",
    "fit_problems",
    "fsdp_dim",
    "fsdp_entry",
    "indivisible",
    "not_divisible",
    "require_divisible",
    "sliced_init",
]


def not_divisible(
    where: str, what: str, size: int, by: str, parts: int, fix: str, shape: tuple | None = None
) -> IndivisibleShapeError:
    """The one wording of "this does not divide", for every check in the library: ``what``
    (``"dim 1"`` of an array of ``shape``, ``"num_heads"``) of ``size`` by ``by`` (a mesh axis,
    ``"num_microbatches"``) of ``parts``; ``fix`` says what else to change.

    >>> print(not_divisible("Block_0/attn", "num_heads", 6, "mesh axis 'tensor'", 4, "use a smaller axis"))
    Block_0/attn: num_heads (size 6) is not divisible by mesh axis 'tensor' (size 4); make it a ...
    """
    of_shape = "" if shape is None else f" of shape {tuple(shape)}"
    return IndivisibleShapeError(
        f"{where}: {what} (size {size}){of_shape} is not divisible by {by} (size {parts}); make it a "
        f"multiple of {parts} or {fix}."
    )


def require_divisible(
    where: str, what: str, size: int, by: str, parts: int, fix: str, shape: tuple | None = None
) -> None:
    """Raises :func:`not_divisible`'s error unless ``parts`` divides ``size``."""
    if parts < 1 or size % parts:
        raise not_divisible(where, what, size, by, parts, fix, shape)


def axis_text(axes: AxisName | tuple) -> str:
    """``"mesh axis 'tensor'"`` or ``"mesh axes ('fsdp', 'tensor')"``: how errors name axes."""
    axes = axes if isinstance(axes, tuple) else (axes,)
    return f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"


def indivisible(
    where: str, dim: int, shape: tuple, axes: tuple, parts: int, fix: str
) -> IndivisibleShapeError:
    """:func:`not_divisible` for dim ``dim`` of an array of ``shape``."""
    return not_divisible(where, f"dim {dim}", shape[dim], axis_text(tuple(axes)), parts, fix, shape)


def fit_problems(
    where: str, shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: Mapping, fix: str = "change the spec"
) -> list[ValueError]:
    """Every reason ``spec`` cannot lay out an array of ``shape`` on a mesh of ``axis_sizes``
    (empty: it fits). ``fix`` ends the divisibility message (``"change the rule"``, ...)."""
    shape = tuple(shape)
    if len(spec) > len(shape):
        return [
            SpecError(
                f"{where}: spec {spec} names {len(spec)} dims, but the array has shape {shape} "
                f"({len(shape)} dims); give at most {len(shape)} entries."
            )
        ]
    problems: list[ValueError] = []
    seen: dict = {}
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        unknown = [axis for axis in axes if axis not in axis_sizes]
        if unknown:
            problems.append(
                SpecError(
                    f"{where}: spec {spec} names mesh axis {unknown[0]!r}, but the mesh has axes "
                    f"{dict(axis_sizes)}; use one of those names."
                )
            )
            continue
        for axis in axes:
            if axis in seen:
                problems.append(
                    SpecError(
                        f"{where}: spec {spec} uses mesh axis {axis!r} on dims {seen[axis]} and {dim}; an "
                        f"axis can split one dim of an array. Split the other dim over another axis."
                    )
                )
            seen[axis] = dim
        parts = math.prod(axis_sizes[axis] for axis in axes)
        if shape[dim] % parts:
            problems.append(indivisible(where, dim, shape, axes, parts, fix))
    return problems


def check_fit(
    items: Iterable[tuple[str, tuple[int, ...], PartitionSpec]],
    axis_sizes: Mapping,
    fix: str = "change the spec",
) -> None:
    """Raises if any ``(where, shape, spec)`` does not fit, listing every failing one.

    The error's class is the first problem's; the message lists them all.
    """
    problems = [p for where, shape, spec in items for p in fit_problems(where, shape, spec, axis_sizes, fix)]
    if len(problems) == 1:
        raise problems[0]
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise type(problems[0])(f"{len(problems)} arrays do not fit their specs:\n{lines}")


def fsdp_dim(shape: tuple[int, ...], names: tuple, axis_size: int) -> int | None:
    """The dim FSDP splits when no rule says, in a layer's local ``shape`` (its dims split as
    ``names``): the largest one that is unsplit (``names[i]`` is ``None``) and divisible by
    ``axis_size``; ties go to the later dim. Where no unsplit dim divides, the largest dim a
    layer splits whose block does (a column layer's bias): FSDP splits that block further,
    the dim then over the layer's axes and FSDP's (:func:`fsdp_entry`). Both front ends lay
    out a model by it (Linen's ``shard_module_params``, the NNX GPT's storage rules).

    >>> fsdp_dim((512, 2048), (None, None), 8), fsdp_dim((512, 2048), (None, "tensor"), 8)
    (1, 0)
    >>> fsdp_dim((4096,), ("tensor",), 8), fsdp_dim((6,), ("tensor",), 8)
    (0, None)
    """
    divisible = [i for i, n in enumerate(shape) if n % axis_size == 0]
    unsplit = [i for i in divisible if names[i] is None]
    return max(unsplit or divisible, key=lambda i: (shape[i], i), default=None)


def fsdp_entry(names: tuple, dim: int, axis: AxisName) -> AxisName | tuple:
    """The spec entry of ``dim`` once FSDP splits it over ``axis``: the axis alone on an
    unsplit dim, after the layer's axes on a dim a layer splits (its block split further).

    >>> fsdp_entry((None, "tensor"), 0, "fsdp"), fsdp_entry((None, "tensor"), 1, "fsdp")
    ('fsdp', ('tensor', 'fsdp'))
    """
    return entry_of((*entry_axes(names[dim]), axis))


def block_of(value: jax.Array, spec: PartitionSpec) -> jax.Array:
    """This device's block of a full ``value`` laid out by ``spec`` (inside ``jax.shard_map``;
    a dim over several axes is split major axis first, as ``NamedSharding`` does).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh = make_mesh({"fsdp": 2, "tensor": 4})
    >>> f = jax.shard_map(lambda w: block_of(w, P(None, ("fsdp", "tensor"))), mesh=mesh, in_specs=P(),
    ...                   out_specs=P(None, ("fsdp", "tensor")))
    >>> w = jnp.arange(16.0).reshape(2, 8)
    >>> bool((f(w) == w).all())   # the blocks put back together are the value
    True
    """
    if any(entry_axes(entry) for entry in spec):
        # The full value is computed as the unsplit program computes it, then sliced: left
        # free, XLA narrows the computation to the block and may contract or vectorize its
        # float ops otherwise (jax 0.12: a row-split kernel's init 1 ulp off in 4 of 64).
        value = jax.lax.optimization_barrier(value)
    for dim, entry in enumerate(spec):
        if entry_axes(entry):
            value = local_slice(value, dim, entry)
    return value


def sliced_init(init_fn: Callable, spec_of: Callable[[tuple, tuple], PartitionSpec]) -> Callable:
    """An initializer that computes the full parameter (the unsplit layer's rng, so the gathered
    init is the unsplit init bit for bit) and keeps this device's block, boxed.

    ``spec_of(shape, names)`` gives the spec of the full value from its shape and the box
    names it already has (``None`` per dim when it has none); the result's names merge both.
    """

    def init(key, *args, **kwargs):
        value = init_fn(key, *args, **kwargs)
        names = tuple(value.names) if isinstance(value, Partitioned) else None
        value = value.value if isinstance(value, Partitioned) else value
        names = names or (None,) * value.ndim
        spec = spec_of(value.shape, names)
        merged = tuple(entry if entry is not None else name for entry, name in zip(spec, names, strict=False))
        merged += names[len(merged) :]
        return Partitioned(block_of(value, spec), merged)

    return init

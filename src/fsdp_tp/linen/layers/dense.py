"""Column- and row-parallel dense layers with ``nn.Dense``'s parameter tree.

Each layer creates its parameters through an initializer that computes the
full parameter from the layer's own rng and keeps this device's slice, so the
global tree, shapes, dtypes and the init equal ``nn.Dense``'s, on any mesh, and
unsharded ``nn.Dense`` params load unchanged.

Megatron is stated once, in :mod:`fsdp_tp.tp`: each layer is its role
(:class:`~fsdp_tp.tp.ColumnParallel`, :class:`~fsdp_tp.tp.RowParallel`) applied to
an ``nn.Dense`` of this device's slice, as a tp rule applies it to a model's own
``nn.Dense`` or ``nnx.Linear``. The role says which dim is split (``splits``) and
computes the call (*f* or the sequence gather, the ring, the row sum, the bias once,
what dropout reads); the layer holds only its parameters and the matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..._axes import TENSOR, require_axes
from ..._layout import check_fit, sliced_init
from ..._renamed import DEPRECATED, RenamedFields
from ..._tree import module_path
from ...collective_matmul import RingChunks, require_mode
from ...errors import warn
from ...tp import ColumnParallel, Layer, RowParallel, TPRole
from .._gather import param_boxed

__all__ = ["ColumnParallelDense", "RowParallelDense", "apply_chunked", "split_names", "split_param"]

_Init = Callable[..., jax.Array]


def split_param(
    module: nn.Module, name: str, init_fn: _Init, shape: tuple[int, ...], dtype: Any, names: tuple
) -> jax.Array:
    """Creates parameter ``name`` of global ``shape`` split as ``names`` says; returns the local slice.

    ``names[i]`` is the mesh axis dim ``i`` is split over, or ``None``. The full parameter is
    initialized (same rng as an unsplit layer) and sliced, so the gathered init equals the
    unsplit init bit for bit. Stored boxed as ``nn.Partitioned``; read without unboxing, since
    unboxing inside ``shard_map`` applies a sharding constraint on manual axes."""
    spec = PartitionSpec(*names)
    axes = require_axes([axis for axis in names if axis is not None], type(module).__name__)
    sizes = {axis: jax.lax.axis_size(axis) for axis in axes}
    check_fit([(module_path(module.path, name), shape, spec)], sizes, "use a smaller mesh axis")
    init = sliced_init(init_fn, lambda _shape, _names: spec)
    boxed = param_boxed(module, name, lambda: module.param(name, init, shape, dtype, unbox=False))
    return boxed.value if isinstance(boxed, nn.Partitioned) else boxed


def apply_chunked(x: jax.Array | RingChunks, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``fn(x)``; on ring chunks, ``fn`` of each chunk as it arrives, placed in sequence order."""
    return x.map(fn) if isinstance(x, RingChunks) else fn(x)


def _matmul(x, kernel, precision):
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


class _ParallelDense(RenamedFields, nn.Module):
    """``nn.Dense``'s arguments plus the mesh axis the kernel is split over."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: _Init = nn.linear.default_kernel_init
    bias_init: _Init = nn.initializers.zeros_init()
    axis: str = TENSOR
    # None: plain collectives; "unidirectional" / "bidirectional": the sequence-parallel
    # all-gather / reduce-scatter as a ppermute ring overlapped with per-chunk matmuls.
    collective_matmul: str | None = None
    axis_name: Any = DEPRECATED  # 0.2's name of `axis`

    def _layer(self, in_size: int) -> Layer:
        """This layer as its role sees it (the roles' ``"dense"`` kind, as an ``nn.Dense``
        under tp rules is)."""
        path = module_path(self.path) or type(self).__name__  # (errors name a top-level layer by class)
        return Layer(
            kind="dense",
            path=path,
            features=(self.features,),
            in_size=in_size,
            use_bias=self.use_bias,
            dtype=self.dtype,
            norms_summed=True,  # (a model of these layers sums its norms' gradients: _norm)
        )

    def _params(self, role: TPRole, layer: Layer, kernel_shape: tuple[int, int]):
        """The kernel and bias (or None), each this device's slice of the dim ``role`` splits."""
        splits = role.splits(layer)
        kernel = split_param(
            self,
            "kernel",
            self.kernel_init,
            kernel_shape,
            self.param_dtype,
            split_names(splits, "kernel", 2, self.axis),
        )
        if not self.use_bias:
            return kernel, None
        names = split_names(splits, "bias", 1, self.axis)
        return kernel, split_param(self, "bias", self.bias_init, (self.features,), self.param_dtype, names)


def split_names(splits: dict[str, int], name: str, ndim: int, axis: str) -> tuple[str | None, ...]:
    """The mesh axis of each dim of parameter ``name`` (``ndim`` dims): ``axis`` on the dim a
    role's ``splits`` names (counted from the end), None elsewhere.

    >>> split_names({"kernel": -1, "bias": -1}, "kernel", 2, "tensor")
    (None, 'tensor')
    >>> split_names({"kernel": -2}, "bias", 1, "tensor")   # a row layer's bias: whole
    (None,)
    """
    names: list[str | None] = [None] * ndim
    if name in splits:
        names[splits[name]] = axis
    return tuple(names)


class ColumnParallelDense(_ParallelDense):
    """``nn.Dense`` with the kernel split on its output dim over ``axis``.

    Input: the same on every device of the axis. Output: this device's slice of
    the features (last dim), or all of them with ``gather_output=True``.
    Backward: the input's gradient is summed over the axis (Megatron's *f*).

    Sequence parallelism: with ``sequence_dim`` set, the input is this
    device's slice of that dim, and the layer all-gathers it (the gather's
    backward reduce-scatters the gradient, so *f* is not applied). (0.1's
    ``prepared=True``, the input already through *f*, is deprecated and goes in
    0.3.0: several layers that share one *f* are one module with its role, as
    :class:`~fsdp_tp.linen.layers.AttentionBlock`'s q, k and v under
    :class:`~fsdp_tp.tp.HeadParallel`.)

    ``collective_matmul`` (sequence-parallel mode only; elsewhere the layer has
    no forward collective): the all-gather becomes a ``ppermute`` ring, each
    arriving chunk multiplied at once (see
    :mod:`~fsdp_tp.collective_matmul`). Same results.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh, x = make_mesh({"data": 2, "tensor": 4}), jnp.ones((2, 16))
    >>> layer = ColumnParallelDense(32, axis="tensor")
    >>> def run(x):
    ...     params = layer.init(jax.random.key(0), x)
    ...     return layer.apply(params, x)
    >>> out = jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(None, "tensor"))(x)
    >>> ref = nn.Dense(32).apply(nn.Dense(32).init(jax.random.key(0), x), x)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-6))   # the slices put together = nn.Dense
    ((2, 32), True)
    """

    gather_output: bool = False
    sequence_dim: int | None = None
    sequence_axis: Any = DEPRECATED  # 0.2's name of `sequence_dim`

    @nn.compact
    def __call__(self, x: jax.Array | RingChunks, prepared: bool = False) -> jax.Array:
        require_mode(self.collective_matmul, type(self).__name__)
        if prepared:
            warn(DeprecationWarning(_PREPARED))
        role = (_Prepared if prepared else ColumnParallel)(
            self.axis,
            gather_output=self.gather_output,
            sequence_dim=self.sequence_dim,
            collective_matmul=self.collective_matmul,
        )
        layer = self._layer(x.shape[-1])
        kernel, bias = self._params(role, layer, (x.shape[-1], self.features))

        def dense(chunk):
            chunk, k, b = nn.dtypes.promote_dtype(chunk, kernel, bias, dtype=self.dtype)
            y = _matmul(chunk, k, self.precision)
            return y if b is None else y + b

        return role.around("__call__", dense, layer, (x,), {})


_PREPARED = (
    "ColumnParallelDense(...)(x, prepared=True) is deprecated and goes in fsdp_tp 0.3.0: layers that "
    "share one f are one module with its role (fsdp_tp.tp.HeadParallel: AttentionBlock's q, k, v)."
)


@dataclasses.dataclass(frozen=True)
class _Prepared(ColumnParallel):
    """0.1's ``prepared=True``: the column's call on an input that already passed *f*."""

    def _copied(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs


class RowParallelDense(_ParallelDense):
    """``nn.Dense`` with the kernel split on its input dim over ``axis``.

    Input: this device's slice of the last dim (e.g. a column-parallel output).
    Output: the full result, the same on every device of the axis; the partial
    products are summed (Megatron's *g*) and the bias is added once, after.
    With ``sequence_dim`` set (sequence parallelism) they are reduce-scattered
    along that dim instead: each device leaves with its slice of the sequence.

    ``collective_matmul``: the reduce-scatter becomes a ``ppermute`` ring fused
    with the matmul; without sequence parallelism the all-reduce becomes that
    ring along the dim before the features, then an all-gather. Same results.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> mesh, x = make_mesh({"data": 2, "tensor": 4}), jnp.arange(32.0).reshape(2, 16) / 32
    >>> layer = RowParallelDense(8, axis="tensor")
    >>> def run(x_slice):   # each device gets 4 of the 16 input features
    ...     params = layer.init(jax.random.key(0), x_slice)
    ...     return layer.apply(params, x_slice)
    >>> out = jax.shard_map(run, mesh=mesh, in_specs=P(None, "tensor"), out_specs=P())(x)
    >>> ref = nn.Dense(8).apply(nn.Dense(8).init(jax.random.key(0), x), x)
    >>> bool(jnp.allclose(out, ref, atol=1e-6))
    True
    """

    sequence_dim: int | None = None
    sequence_axis: Any = DEPRECATED  # 0.2's name of `sequence_dim`

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        require_mode(self.collective_matmul, type(self).__name__)
        require_axes(self.axis, type(self).__name__)
        role = RowParallel(
            self.axis, sequence_dim=self.sequence_dim, collective_matmul=self.collective_matmul
        )
        layer = self._layer(x.shape[-1] * jax.lax.axis_size(self.axis))
        kernel, bias = self._params(role, layer, (layer.in_size, self.features))

        def partial_products(rows):
            rows, k = nn.dtypes.promote_dtype(rows, kernel, dtype=self.dtype)
            return _matmul(rows, k, self.precision)

        return role.around(
            "__call__", partial_products, dataclasses.replace(layer, bias=lambda: bias), (x,), {}
        )

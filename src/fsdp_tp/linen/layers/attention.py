"""Multi-head attention with heads split over a mesh axis (grouped-query included)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..._aliases import aliases_of
from ..._axes import TENSOR, require_axes
from ..._layout import require_divisible
from ..._renamed import DEPRECATED, RenamedFields
from ..._tree import module_path

# Re-exported from where they live, the framework-free fsdp_tp.attention.
from ...attention import attend as _attend
from ...tp import HeadParallel, Layer
from .dense import RowParallelDense, apply_chunked, split_param

__all__ = ["AttentionBlock"]

__getattr__ = aliases_of(__name__)  # 0.1 read attention's functions here (fsdp_tp._aliases)


class _Projection(nn.Module):
    """Query, key or value on this device, in the (heads, head_dim) layout
    :class:`~fsdp_tp.tp.HeadParallel` states it in: the columns of this device's heads
    (``split``), or the block of kv heads its query heads read of a kernel kept whole
    (``read``, the role's :meth:`~fsdp_tp.tp.TPRole.local` read), computed on the input the
    role prepared (*f* once for q, k and v, or each ring chunk as it arrives)."""

    features: int
    head_dim: int
    use_bias: bool
    param_dtype: Any
    axis: str
    split: bool
    read: Any = None  # HeadParallel's read of a kv kernel and bias kept whole (one function), or None
    dtype: Any = None

    def _param(self, name: str, init, shape: tuple[int, ...]) -> jax.Array:
        names = (*(None,) * (len(shape) - 1), self.axis if self.split else None)
        value = split_param(self, name, init, shape, self.param_dtype, names)
        if self.read is None:
            return value
        heads = value.reshape(*value.shape[:-1], -1, self.head_dim)  # (..., kv heads, head_dim)
        return self.read(heads).reshape(*value.shape[:-1], -1)

    @nn.compact
    def __call__(self, x):
        kernel = self._param("kernel", nn.linear.default_kernel_init, (x.shape[-1], self.features))
        bias = self._param("bias", nn.initializers.zeros_init(), (self.features,)) if self.use_bias else None

        def project(chunk):
            chunk, k, b = nn.dtypes.promote_dtype(chunk, kernel, bias, dtype=self.dtype)
            return chunk @ k if b is None else chunk @ k + b

        return apply_chunked(x, project)


class AttentionBlock(RenamedFields, nn.Module):
    """Multi-head (or grouped-query) self-attention, heads split over ``axis``.

    ``query``/``key``/``value`` are column-parallel (whole heads per device),
    ``out`` is row-parallel: one all-reduce forward and one backward. With
    ``num_kv_heads`` smaller than the axis size (it must divide it), k and v
    stay whole on every device. ``axis=None`` is the unsharded twin,
    with the same parameter tree: ``query``, ``key``, ``value``, ``out``, each
    an ``nn.Dense``.

    ``use_bias`` gives ``query``, ``value`` and ``out`` a bias, never ``key``:
    softmax ignores a shift shared by all logits of a query, so a key bias has
    an identically zero gradient, and Adam would turn its rounding noise into
    lr-sized drift.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> block = AttentionBlock(num_heads=8, num_kv_heads=2, head_dim=4)
    >>> _, specs = init_sharded(lambda r, x: block.init(r, x)["params"], mesh, (P(), P()),
    ...                         jax.random.key(0), jnp.ones((2, 5, 16)))
    >>> specs["query"]["kernel"], specs["key"]["kernel"], specs["out"]["kernel"]
    (P(None, 'tensor'), P(None, None), P('tensor', None))
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = False
    causal: bool = True
    dtype: Any = None  # the computation's dtype (bf16 compute on f32 params: jnp.bfloat16)
    param_dtype: Any = jnp.float32
    axis: str | None = TENSOR
    sequence_dim: int | None = None  # input and output split along this dim (the sequence) over axis
    collective_matmul: str | None = (
        None  # None, "unidirectional" or "bidirectional" (see ColumnParallelDense)
    )
    attention: str = "reference"  # one of ATTENTION_IMPLEMENTATIONS (see attend)
    axis_name: Any = DEPRECATED  # 0.2's name of `axis`
    sequence_parallel: Any = DEPRECATED  # 0.2's sequence_dim=1 (True)

    def _check_heads(self, role: HeadParallel, layer: Layer, size: int) -> None:
        """The block's own shape (whole kv groups), then its role's one divisibility check;
        kv heads fewer than devices are checked where each device reads its block
        (:func:`~fsdp_tp.tp.pieces.kept_block`)."""
        kv, fix = layer.num_kv_heads, "another num_kv_heads"
        require_divisible(layer.path, "num_heads", self.num_heads, "num_kv_heads", kv, fix)
        role.require_divides(layer, size, layer.path, lambda _: f"a smaller {self.axis!r} axis")

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """``x`` ``(..., S, d)``; ``segment_ids`` ``(..., S)``: packed documents, each token's
        (:func:`~fsdp_tp.attention.attend`'s), of the whole sequence a device attends over
        (under sequence parallelism too: its attention sees the sequence gathered)."""
        kv = self.num_kv_heads or self.num_heads
        d_model, dim = x.shape[-1], self.head_dim
        kw = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        no_bias = dict(kw, use_bias=False)

        def heads(q, k, v, out: nn.Module) -> jax.Array:
            split = lambda t: t.reshape(*t.shape[:-1], t.shape[-1] // dim, dim)
            y = _attend(split(q), split(k), split(v), self.causal, self.attention, segment_ids=segment_ids)
            return out(y.reshape(*y.shape[:-2], -1))

        if self.axis is None:
            q = nn.Dense(self.num_heads * dim, name="query", **kw)(x)
            k = nn.Dense(kv * dim, name="key", **no_bias)(x)
            v = nn.Dense(kv * dim, name="value", **kw)(x)
            return heads(q, k, v, nn.Dense(d_model, name="out", **kw))
        require_axes(self.axis, "AttentionBlock")
        axis = self.axis
        size = jax.lax.axis_size(axis)
        seq = self.sequence_dim
        ring = self.collective_matmul
        kept = kv % size != 0  # fewer kv heads than devices: each device the one its queries read
        role = HeadParallel(axis, sequence_dim=seq, replicated_kv=kept, collective_matmul=ring)
        where = module_path(self.path) or "AttentionBlock"
        layer = Layer(
            kind="attention", path=where, num_heads=self.num_heads, num_kv_heads=kv, norms_summed=True
        )
        self._check_heads(role, layer, size)
        # The role states the split: q, k and v on their heads, or k and v kept whole with
        # the block each device reads (HeadParallel.local's read).
        splits, reads = role.splits(layer), role.local(layer, size).read
        proj = dict(head_dim=dim, param_dtype=self.param_dtype, axis=axis, dtype=self.dtype)

        def projection(name: str, features: int, use_bias: bool) -> _Projection:
            split, read = f"{name}/kernel" in splits, reads.get(f"{name}/kernel")
            return _Projection(features, use_bias=use_bias, split=split, read=read, name=name, **proj)

        query = projection("query", self.num_heads * dim, self.use_bias)
        key, value = projection("key", kv * dim, False), projection("value", kv * dim, self.use_bias)
        out = RowParallelDense(d_model, axis=axis, sequence_dim=seq, collective_matmul=ring, name="out", **kw)

        # The role gives q, k and v one f (or one all-gather, or one ring): their input
        # gradients are summed locally, then reduced over the axis once.
        def run(shared):
            return heads(query(shared), key(shared), value(shared), out)

        return role.around("__call__", run, layer, (x,), {})

"""The tensor-parallel roles a tp rule gives a submodule, once for every front end.

A rule is ``(pattern, role)``: ``pattern`` is searched (``re.search``) in a submodule's
path, as every rule of the library is (:mod:`fsdp_tp.rules`), and ``role`` says how that
submodule computes on its slices over a mesh axis:

- :class:`ColumnParallel` (a dense layer, a convolution or an einsum): the kernel split on
  its (first) output feature dim (an einsum's: a kernel letter of the output, ``letter=``);
  the input is the same on every device, the output this device's slice of the features (or
  gathered, ``gather_output=True``);
- :class:`RowParallel` (the same kinds): the kernel split on its (first) contracted input
  dim (an einsum's: a kernel letter of the inputs only); the input arrives split (a
  column-parallel layer's output), the partial products are summed over the axis and the
  bias added once;
- :class:`HeadParallel` (multi-head attention): each device computes its share of the heads
  (query/key/value split on the heads dim, the output projection row-parallel);
- :class:`VocabParallel` (an embedding): the table split on the vocabulary; each device looks
  up the ids in its range and the rows are summed over the axis (``attend``, tied logits,
  gathers the vocabulary).

Sequence parallelism: give every role of the model ``sequence_dim`` (the sequence's dim of
the activations, 1 for ``(batch, seq, ...)``). Between tensor-parallel layers each device then
holds a slice of the sequence: the embedding's sum and each row layer's become
reduce-scatters along it, and each column layer (and attention, and tied logits) all-gathers
it first, whose backward reduce-scatters; no all-reduce is left over ``tensor``. It needs
``check_vma=True`` (a norm's parameters read sequence slices; JAX sums their gradients).

A role sees the module as a :class:`Layer`, which each front end builds from its own module
classes (Linen's ``nn.Dense`` and NNX's ``nnx.Linear`` are both the ``"dense"`` kind, their
``Einsum`` the ``"einsum"`` kind, whose equation says what it produces and contracts), and
computes through :mod:`fsdp_tp.tp`'s pieces. A new role is one :class:`TPRole` subclass here;
a module class of your own takes the column and row roles once :func:`register_einsum` says
what it computes.

>>> role = ColumnParallel()
>>> role.splits(Layer(kind="dense", path="mlp/up", features=(64,)))
{'kernel': -1, 'bias': -1}
>>> RowParallel().splits(Layer(kind="dense", path="mlp/down", features=(16,)))
{'kernel': -2}
>>> q = Layer(kind="einsum", path="attn/q", equation="BTD,NDH->BTNH", kernel_shape=(8, 64, 16))
>>> ColumnParallel().splits(q), ColumnParallel().local(q, 4)
({'kernel': -3, 'bias': -2}, {'kernel_shape': (2, 64, 16)})
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax

from .._einsum import register_einsum, shrunk
from .._layout import axis_text, require_divisible
from .._tree import module_path
from ..collective_matmul import ring_reduce_scatter
from ..collectives import gather_from_axis, require_sequence_divisible
from ..dropout import split_after, splitting, unplaceable_after
from ..errors import RuleError
from ._role import Layer, TPRole, _chunkwise, _copied, _einsum, _ringable, _ungrouped
from .pieces import add_bias_once, kept_block, row_reduce, vocab_lookup

__all__ = [
    "ROLES",
    "ColumnParallel",
    "HeadParallel",
    "Layer",
    "RowParallel",
    "TPRole",
    "VocabParallel",
    "register_einsum",
]


@dataclass(frozen=True)
class ColumnParallel(TPRole):
    """A dense layer, convolution or einsum split on the (first) output feature dim.

    ``gather_output``: all-gather the features (a model's last layer, whose output the
    loss reads whole); otherwise the next layer must be :class:`RowParallel`. ``letter``
    (an einsum's): the kernel letter to split, one the output has and the inputs do not
    (default: the kernel's first such letter, e.g. the heads of ``'BTD,NDH->BTNH'``).
    ``replicated`` (an einsum's): the kernel stays whole over the axis; each device computes
    every ``letter`` and keeps its block, ``size / axis`` of them, or the one its position
    needs when the axis is larger (grouped-query attention with fewer kv heads than devices:
    device t's query heads read kv head ``t * K // axis``). One more all-reduce backward (the
    output's cotangent) than a split. ``sequence_dim``: the input arrives as this device's
    slice of that dim and is all-gathered first (sequence parallelism); ``collective_matmul``
    (``"unidirectional"`` / ``"bidirectional"``, with ``sequence_dim``): that gather as a
    ``ppermute`` ring, each arriving chunk multiplied at once (:mod:`fsdp_tp.collective_matmul`)."""

    gather_output: bool = False
    letter: str | None = None
    replicated: bool = False
    sequence_dim: int | None = None
    collective_matmul: str | None = None
    kinds: ClassVar[tuple[str, ...]] = ("dense", "conv", "einsum")

    def splits(self, layer):
        eq, letter, dim = _einsum(layer, self, self.letter, "produced")
        if self.replicated:
            _replicable(layer, letter, self.gather_output)
            return {}
        if letter:
            kernel, *bias = layer.parameters
            splits = {kernel: dim - len(eq.kernel)}
            return splits | {name: eq.bias_letters.index(letter) - len(eq.bias_letters) for name in bias}
        _ungrouped(layer)
        dim = -len(layer.features)
        return {"kernel": dim, "bias": dim}

    def divides(self, layer):
        eq, letter, dim = _einsum(layer, self, self.letter, "produced")
        if self.replicated:
            return {}  # (the axis size and the letter's: one divides the other, checked per call)
        if letter and not layer.kernel_shape[dim]:
            raise RuleError(
                f"{layer.path}: ColumnParallel splits letter {letter!r} of {eq.text!r}, whose size the "
                f"module does not hold in an attribute it was registered with; register it with "
                f"sizes={{'<the attribute>': {letter!r}}}."
            )
        if letter:
            return {f"kernel dim {letter!r} of {eq.text!r}": layer.kernel_shape[dim]}
        return {"features": layer.features[0]}

    def local(self, layer, size):
        _, letter, dim = _einsum(layer, self, self.letter, "produced")
        if self.replicated:
            return {}  # it computes every `letter`, with the whole kernel
        if letter:
            return {"kernel_shape": shrunk(layer.kernel_shape, dim, size)}
        return {"features": (layer.features[0] // size, *layer.features[1:])}

    def call(self, method, run, layer, args, kwargs, prepared: bool = False):
        """``prepared``: the inputs already passed *f* or the sequence gather (a caller that
        shares it between layers: Linen's attention for q, k and v)."""
        sequence = self.sequence_dim
        if self.replicated:
            if sequence is not None:
                raise RuleError(f"{layer.path}: ColumnParallel(replicated=True) takes no sequence_dim.")
            return self._replicated(run(*args, **kwargs), layer)
        if self.collective_matmul is not None and sequence is not None:
            _ringable(self, layer, sequence)
        if not prepared:
            args, kwargs = _copied(args, kwargs, self.axis, sequence, self.collective_matmul)
        out = _chunkwise(run, layer, args, kwargs)
        eq, letter, _ = _einsum(layer, self, self.letter, "produced")
        dim = eq.dim_of(letter, eq.output, out.ndim) if letter else -len(layer.features)
        if self.gather_output:
            split_after({})
            return gather_from_axis(out, dim % out.ndim, self.axis)
        split_after({dim: self.axis}, out.shape, add=True)  # dropout until the row layer: its slice
        return out

    def _replicated(self, out: jax.Array, layer: Layer) -> jax.Array:
        """Every ``letter`` computed from the whole kernel and the input as it is (so the
        input's gradient from here is whole, not a share for *f* to sum); *f* on the output
        (its cotangent, zeros outside each device's block, summed over the axis: the kernel's
        and the input's gradients are whole on every device); this device's block kept."""
        eq, letter, dim = _einsum(layer, self, self.letter, "produced")
        n, size = layer.kernel_shape[dim], jax.lax.axis_size(self.axis)
        at = eq.dim_of(letter, eq.output, out.ndim)
        out = kept_block(out, at, n, self.axis, layer.path, f"letter {letter!r} of {eq.text!r}")
        if n >= size:  # each device its own block: a split
            split_after({at: self.axis}, out.shape, add=True)
        else:  # blocks shared by neighbours: no mask of the unsharded model's is drawn on them
            unplaceable_after(out.shape)
        return out


def _replicable(layer: Layer, letter: str, gather_output: bool) -> None:
    if not letter or gather_output:
        raise RuleError(
            f"{layer.path}: ColumnParallel(replicated=True) keeps each device's block of an einsum's "
            f"output letter (kv heads fewer than the axis size); it takes an einsum layer and no "
            f"gather_output. Drop replicated=True."
        )


@dataclass(frozen=True)
class RowParallel(TPRole):
    """A dense layer, convolution or einsum split on the (first) contracted input dim: the
    input arrives split there, the partial products are summed over the axis (Megatron's
    *g*) and the bias, whole on every device, is added once after the sum. ``letter`` (an
    einsum's): the kernel letter to split, one the inputs have and the output does not
    (default: the kernel's first such letter, e.g. the heads of ``'BTNH,NHD->BTD'``).
    ``sequence_dim``: the partial products are reduce-scattered along that dim instead, each
    device leaving with its slice of the sequence (the bias's gradient summed over the axis).
    ``collective_matmul``: that reduce-scatter as a ``ppermute`` ring fused with the layer's
    matmul, chunk by chunk of the sequence; without ``sequence_dim``, the sum as that ring along
    the dim before the features, then an all-gather."""

    letter: str | None = None
    sequence_dim: int | None = None
    collective_matmul: str | None = None
    kinds: ClassVar[tuple[str, ...]] = ("dense", "conv", "einsum")

    def splits(self, layer):
        eq, letter, dim = _einsum(layer, self, self.letter, "contracted")
        if letter:
            return {layer.parameters[0]: dim - len(eq.kernel)}
        _ungrouped(layer)
        return {"kernel": -(layer.contracted + len(layer.features))}

    def divides(self, layer):
        eq, letter, dim = _einsum(layer, self, self.letter, "contracted")
        if letter:
            return {f"kernel dim {letter!r} of {eq.text!r}": layer.kernel_shape[dim]}
        return {"input dim": layer.in_size}

    def local(self, layer, size):
        _, letter, dim = _einsum(layer, self, self.letter, "contracted")
        drop_bias = {"use_bias": False} if "bias" in layer.parameters else {}  # added after the sum
        if letter:
            return {"kernel_shape": shrunk(layer.kernel_shape, dim, size), **drop_bias}
        return drop_bias

    def call(self, method, run, layer, args, kwargs):
        eq, letter, dim = _einsum(layer, self, self.letter, "contracted")
        if letter and layer.kernel_shape[dim]:  # (a size the module holds)
            x = args[0] if args else kwargs["inputs"]
            eq.require_slice(letter, x.shape, layer.kernel_shape[dim] // jax.lax.axis_size(self.axis))
        sequence = self.sequence_dim
        if self.collective_matmul is None:
            out = row_reduce(run(*args, **kwargs), self.axis, sequence)  # (whole, or sequence slices)
        else:
            out = self._ring(run, layer, args, kwargs, sequence)
        bias = layer.bias() if layer.use_bias and layer.bias is not None else None
        if bias is not None and letter:
            bias = bias.reshape(eq.bias_shape(bias.shape, out.ndim))
        return add_bias_once(out, bias, self.axis, sequence is not None, dtype=layer.dtype)

    def _ring(self, run, layer: Layer, args: tuple, kwargs: dict, sequence: int | None) -> jax.Array:
        """The layer on each chunk of its input's rows, reduce-scattered round the ring along the
        sequence (or the dim before the features, then all-gathered: the sum, whole)."""
        mode = self.collective_matmul
        assert mode is not None  # (the caller's test)
        x, *rest = args
        _ringable(self, layer, sequence)
        # the rows: the sequence, or the dim before the contracted ones (computed row by row)
        dim = sequence if sequence is not None else x.ndim - layer.contracted - 1
        if dim % x.ndim >= x.ndim - layer.contracted:
            raise RuleError(
                f"{layer.path}: RowParallel(collective_matmul={self.collective_matmul!r}) chunks dim "
                f"{dim} of its input, and the input has shape {x.shape}; pass collective_matmul=None."
            )
        require_divisible(
            layer.path,
            f"dim {dim % x.ndim} of the input (collective_matmul={mode!r} chunks it)",
            x.shape[dim],
            axis_text(self.axis),
            jax.lax.axis_size(self.axis),
            "pass collective_matmul=None",
            x.shape,
        )
        out = ring_reduce_scatter(lambda rows: run(rows, *rest, **kwargs), x, self.axis, dim, mode)
        if sequence is None:
            split_after({})
            return gather_from_axis(out, dim % x.ndim, self.axis)
        split_after({sequence - out.ndim: self.axis}, out.shape)  # as row_reduce says for dropout
        return out


@dataclass(frozen=True)
class HeadParallel(TPRole):
    """Multi-head attention: each device computes ``num_heads / size`` heads; query, key and
    value are split on the heads dim, the output projection on its heads dim
    (:class:`RowParallel`), so the block has one all-reduce forward and one backward.
    Inside, activations are split on the heads (the attention weights' dim -3), which is
    where a dropout mask is drawn by heads (:mod:`fsdp_tp.dropout`). ``sequence_dim``: the
    inputs' sequence slices are all-gathered first and the output reduce-scattered along it.
    ``replicated_kv`` (a module with ``num_kv_heads``: grouped-query attention with fewer kv
    heads than devices): the key and value projections stay whole on every device, and each
    device projects with the block of kv heads its query heads read
    (:func:`~fsdp_tp.tp.kept_block`: their gradients are summed over the axis, one more
    all-reduce backward per projection than a split). ``collective_matmul`` (with
    ``sequence_dim``): the gather of the inputs and the output projection's reduce-scatter as
    ``ppermute`` rings, the query, key and value projections computed chunk by chunk."""

    sequence_dim: int | None = None
    replicated_kv: bool = False
    collective_matmul: str | None = None
    kinds: ClassVar[tuple[str, ...]] = ("attention",)

    def splits(self, layer):
        projections = ("query",) if self._kept(layer) else ("query", "key", "value")
        return {f"{proj}/{name}": -2 for proj in projections for name in ("kernel", "bias")}

    def kept_whole(self, layer):
        if not self._kept(layer):
            return ()
        return tuple(f"{proj}/{name}" for proj in ("key", "value") for name in ("kernel", "bias"))

    def divides(self, layer):
        heads = {"num_heads": layer.num_heads}
        if layer.num_kv_heads and layer.num_kv_heads != layer.num_heads and not self._kept(layer):
            heads["num_kv_heads"] = layer.num_kv_heads
        return heads  # (kept kv heads: they and the axis size, one divides the other, per call)

    def local(self, layer, size):
        kv_heads = layer.num_kv_heads or layer.num_heads
        if not self._kept(layer):
            return {"num_heads": layer.num_heads // size, "num_kv_heads": kv_heads // size}
        kept = functools.partial(
            kept_block, dim=-2, blocks=kv_heads, axis_name=self.axis, where=layer.path, what="num_kv_heads"
        )
        return {
            "num_heads": layer.num_heads // size,
            "num_kv_heads": max(1, kv_heads // size),
            "read": dict.fromkeys(self.kept_whole(layer), kept),
        }

    def _kept(self, layer: Layer) -> bool:
        if self.replicated_kv and not layer.num_kv_heads:
            raise RuleError(
                f"{layer.path}: HeadParallel(replicated_kv=True) keeps a grouped-query attention's kv "
                f"heads whole, and this attention module has no num_kv_heads (each head has its own "
                f"key and value). Drop replicated_kv."
            )
        return self.replicated_kv

    def inner(self):
        ring, sequence = self.collective_matmul, self.sequence_dim
        roles: dict[str, TPRole] = {
            "out": RowParallel(self.axis, sequence_dim=sequence, collective_matmul=ring)
        }
        if ring is not None and sequence is not None:  # the projections get the ring's chunks
            roles |= dict.fromkeys(("query", "key", "value"), _ChunkWise(self.axis))
        return roles

    def call(self, method, run, layer, args, kwargs):
        """``run`` computes this device's heads, its projections by their roles (``inner``)."""
        sequence = self.sequence_dim
        args, kwargs = _copied(args, kwargs, self.axis, sequence, self.collective_matmul)
        with splitting({-3: self.axis}):  # (..., heads, queries, keys) weights
            out = run(*args, **kwargs)
        # what leaves: whole, or this device's slice of the sequence (out's reduce-scatter)
        split_after({} if sequence is None else {sequence - out.ndim: self.axis}, out.shape)
        return out


@dataclass(frozen=True)
class VocabParallel(TPRole):
    """An embedding with the table split on the vocabulary: each device looks up the ids
    in its range (zeros for the others) and the rows are summed over the axis. ``attend``
    (logits tied to the table) computes this device's vocabulary slice and gathers it.
    ``sequence_dim``: the looked-up rows are reduce-scattered along it (each device leaves
    with its slice of the sequence), and ``attend`` all-gathers it first."""

    sequence_dim: int | None = None
    kinds: ClassVar[tuple[str, ...]] = ("embed",)
    methods: ClassVar[frozenset[str]] = frozenset({"__call__", "attend"})

    def splits(self, layer):
        return {"embedding": -2}

    def divides(self, layer):
        return {"num_embeddings": layer.num_embeddings}

    def local(self, layer, size):
        return {"num_embeddings": layer.num_embeddings // size}

    def call(self, method, run, layer, args, kwargs):
        sequence = self.sequence_dim
        split_after({})  # the logits gathered: whole (the lookup's sum says what it leaves)
        if method == "attend":
            args, kwargs = _copied(args, kwargs, self.axis, sequence)
            return gather_from_axis(run(*args, **kwargs), -1, self.axis)
        ids, *rest = args
        if sequence is not None:
            where = module_path((layer.path,), "embedding")
            require_sequence_divisible(where, ids.shape[sequence], sequence, self.axis)
        rows = layer.num_embeddings // jax.lax.axis_size(self.axis)
        lookup = vocab_lookup(ids, rows, self.axis, lambda i: run(i, *rest, **kwargs))
        return row_reduce(lookup, self.axis, sequence)  # summed, or scattered along the sequence


@dataclass(frozen=True)
class _ChunkWise(TPRole):
    """A projection inside a role's module (attention's query, key, value) that the module
    hands the ring's chunks: computed chunk by chunk, its split and sizes the outer role's."""

    kinds: ClassVar[tuple[str, ...]] = ("dense", "einsum")

    def splits(self, layer):
        return {}

    def divides(self, layer):
        return {}

    def call(self, method, run, layer, args, kwargs):
        return _chunkwise(run, layer, args, kwargs)


ROLES: tuple[type[TPRole], ...] = (ColumnParallel, RowParallel, HeadParallel, VocabParallel)

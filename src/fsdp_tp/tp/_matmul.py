"""The roles of a layer that multiplies its input by one kernel (a dense layer, a
convolution, an einsum): :class:`ColumnParallel` and :class:`RowParallel`, Megatron's pair, and
the layers their split cannot take (a ring over a convolution, a grouped convolution's channels),
each refused with its fix."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax

from ..collective_matmul import ring_reduce_scatter
from ..collectives import gather_from_axis
from ..dropout import split_after, unplaceable_after
from ..errors import RuleError
from ._around import chunkwise, copied
from ._einsum import Equation, shrunk, split_letter
from ._role import Layer, Local, TPRole
from .pieces import add_bias_once, kept_block, row_reduce

__all__ = ["ColumnParallel", "RowParallel"]


@dataclass(frozen=True)
class ColumnParallel(TPRole):
    """A dense layer, convolution or einsum split on the (first) output feature dim.

    ``gather_output``: all-gather the features (a model's last layer, whose output the
    loss reads whole); otherwise the next layer must be :class:`RowParallel`. ``letter``
    (an einsum's): the kernel letter to split, one the output has and the inputs do not
    (default: the kernel's first such letter, e.g. the heads of ``'BTD,NDH->BTNH'``).
    ``replicated`` (an einsum's): the kernel stays whole over the axis and each device computes
    with its block of ``letter`` (:func:`~fsdp_tp.tp.pieces.kept_block`, as
    :class:`~fsdp_tp.tp.HeadParallel`'s ``replicated_kv`` reads its kv kernels), ``size / axis``
    of them, or the one its position needs when the axis is larger (grouped-query attention
    with fewer kv heads than devices: device t's query heads read kv head ``t * K // axis``).
    One more all-reduce backward (the kernel's gradient) than a split. ``sequence_dim``: the
    input arrives as this device's slice of that dim and is all-gathered first (sequence
    parallelism); ``collective_matmul`` (``"unidirectional"`` / ``"bidirectional"``, with
    ``sequence_dim``): that gather as a ``ppermute`` ring, each arriving chunk multiplied at
    once (:mod:`fsdp_tp.collective_matmul`)."""

    gather_output: bool = False
    letter: str | None = None
    replicated: bool = False
    sequence_dim: int | None = None
    collective_matmul: str | None = None
    kinds: ClassVar[tuple[str, ...]] = ("dense", "conv", "einsum")

    def splits(self, layer):
        if self.replicated:
            return {}
        if dims := self._letter_dims(layer):
            return dims
        ungrouped(layer)
        dim = -len(layer.features)
        return {"kernel": dim, "bias": dim}

    def _letter_dims(self, layer: Layer) -> dict[str, int]:
        """An einsum's parameters and their dim of the letter, from the end (``{}``: no letter)."""
        eq, letter, dim = einsum_split(layer, self, self.letter, "produced")
        if not letter:
            return {}
        kernel, *bias = layer.parameters
        return {kernel: dim - len(eq.kernel)} | {
            name: eq.bias_letters.index(letter) - len(eq.bias_letters) for name in bias
        }

    def kept_whole(self, layer):
        if not self.replicated:
            return ()
        dims = self._letter_dims(layer)
        _replicable(layer, bool(dims), self.gather_output)
        return tuple(dims)

    def divides(self, layer):
        eq, letter, dim = einsum_split(layer, self, self.letter, "produced")
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
        eq, letter, dim = einsum_split(layer, self, self.letter, "produced")
        if self.replicated:  # its block of every kept parameter, read through kept_block
            n, what = layer.kernel_shape[dim], f"letter {letter!r} of {eq.text!r}"
            kept = functools.partial(kept_block, blocks=n, axis=self.axis, where=layer.path, what=what)
            reads = {name: functools.partial(kept, dim=at) for name, at in self._letter_dims(layer).items()}
            shape = tuple(max(1, n // size) if i == dim else k for i, k in enumerate(layer.kernel_shape))
            return Local(kernel_shape=shape, read=reads)
        if letter:
            return Local(kernel_shape=shrunk(layer.kernel_shape, dim, size))
        return Local(features=(layer.features[0] // size, *layer.features[1:]))

    def call(self, method, run, layer, args, kwargs):
        sequence = self.sequence_dim
        if self.replicated and sequence is not None:
            raise RuleError(f"{layer.path}: ColumnParallel(replicated=True) takes no sequence_dim.")
        if self.collective_matmul is not None and sequence is not None:
            ringable(self, layer, sequence)
        args, kwargs = self._copied(args, kwargs)
        out = chunkwise(run, layer, args, kwargs)
        eq, letter, kernel_dim = einsum_split(layer, self, self.letter, "produced")
        dim = eq.dim_of(letter, eq.output, out.ndim) if letter else -len(layer.features)
        if self.replicated:
            _placed(layer.kernel_shape[kernel_dim], dim, out.shape, self.axis)
            return out
        if self.gather_output:
            split_after({})
            return gather_from_axis(out, dim % out.ndim, self.axis)
        split_after({dim: self.axis}, out.shape, add=True)  # dropout until the row layer: its slice
        return out

    def _copied(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs through *f*, or the sequence gather (or its ring)."""
        return copied(args, kwargs, self.axis, self.sequence_dim, self.collective_matmul)


def _placed(n: int, dim: int, shape: tuple[int, ...], axis: str) -> None:
    """Where dropout finds a kept block of ``n`` along ``dim`` (:func:`fsdp_tp.dropout.split_after`)."""
    if n >= jax.lax.axis_size(axis):  # each device its own block: a split
        split_after({dim: axis}, shape, add=True)
    else:  # blocks shared by neighbours: no mask of the unsharded model's is drawn on them
        unplaceable_after(shape)


def _replicable(layer: Layer, einsum: bool, gather_output: bool) -> None:
    if not einsum or gather_output:
        raise RuleError(
            f"{layer.path}: ColumnParallel(replicated=True) reads each device's block of an einsum "
            f"kernel's output letter (kv heads fewer than the axis size); it takes an einsum layer and no "
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
        eq, letter, dim = einsum_split(layer, self, self.letter, "contracted")
        if letter:
            return {layer.parameters[0]: dim - len(eq.kernel)}
        ungrouped(layer)
        return {"kernel": -(layer.contracted + len(layer.features))}

    def divides(self, layer):
        eq, letter, dim = einsum_split(layer, self, self.letter, "contracted")
        if letter:
            return {f"kernel dim {letter!r} of {eq.text!r}": layer.kernel_shape[dim]}
        return {"input dim": layer.in_size}

    def local(self, layer, size):
        _, letter, dim = einsum_split(layer, self, self.letter, "contracted")
        use_bias = False if "bias" in layer.parameters else None  # (added after the sum)
        return Local(
            kernel_shape=shrunk(layer.kernel_shape, dim, size) if letter else None, use_bias=use_bias
        )

    def call(self, method, run, layer, args, kwargs):
        eq, letter, dim = einsum_split(layer, self, self.letter, "contracted")
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
        return add_bias_once(out, bias, self.axis, sequence, dtype=layer.dtype)

    def _ring(self, run, layer: Layer, args: tuple, kwargs: dict, sequence: int | None) -> jax.Array:
        """The layer on each chunk of its input's rows, reduce-scattered round the ring along the
        sequence (or the dim before the features, then all-gathered: the sum, whole)."""
        mode = self.collective_matmul
        assert mode is not None  # (the caller's test)
        x, *rest = args
        ringable(self, layer, sequence)
        # the rows: the sequence, or the dim before the contracted ones (computed row by row)
        dim = sequence if sequence is not None else x.ndim - layer.contracted - 1
        if dim % x.ndim >= x.ndim - layer.contracted:
            raise RuleError(
                f"{layer.path}: RowParallel(collective_matmul={self.collective_matmul!r}) chunks dim "
                f"{dim} of its input, and the input has shape {x.shape}; pass collective_matmul=None."
            )
        fix = "pass collective_matmul=None"  # (the ring checks its chunks divide: one check)
        rows = lambda chunk: run(chunk, *rest, **kwargs)
        out = ring_reduce_scatter(rows, x, self.axis, dim, mode, layer.path, fix)
        if sequence is None:
            split_after({})
            return gather_from_axis(out, dim % x.ndim, self.axis)
        split_after({sequence - out.ndim: self.axis}, out.shape)  # as row_reduce says for dropout
        return out


def einsum_split(layer: Layer, role: TPRole, letter: str | None, what: str) -> tuple[Equation, str, int]:
    """An einsum layer's equation, the letter ``role`` splits and its kernel dim (``""`` and
    0 for another kind, which takes no ``letter``)."""
    return split_letter(layer.kind, layer.equation, layer.path, type(role).__name__, letter, what)


def ringable(role: TPRole, layer: Layer, sequence: int | None) -> None:
    """A ring computes the layer chunk by chunk of the rows: a convolution's window reads its
    neighbours' rows, and an einsum's rows are the sequence only it names."""
    if layer.kind == "conv":
        why, fix = "reads its neighbours' rows", "."
    elif layer.kind == "einsum" and sequence is None:
        why, fix = "has no rows without sequence_dim", ", or give the role sequence_dim."
    else:
        return
    mode = getattr(role, "collective_matmul", None)
    raise RuleError(
        f"{layer.path}: {type(role).__name__}(collective_matmul={mode!r}) "
        f"computes the layer on chunks of its rows, and a {layer.kind} layer {why}; pass "
        f"collective_matmul=None{fix}"
    )


def ungrouped(layer: Layer) -> None:
    """A grouped convolution mixes channels within groups only: a channel split would cut
    across the groups, so it stays whole."""
    if layer.groups != 1:
        raise RuleError(
            f"{layer.path} is a convolution with feature_group_count={layer.groups}: splitting its "
            f"channels over a mesh axis would cut across its groups. Leave {layer.path} whole (drop "
            f"it from the tp rules)."
        )

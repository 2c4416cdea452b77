"""How an activation inside a sharded step is split, which dropout needs to draw its block of
the unsharded mask (:func:`activation_split`): dim 0 over the step's batch axes, and the dims
the tensor-parallel roles say they left split (:func:`split_after` after a column layer, ``{}``
after a row layer's sum; :func:`splitting` for a head-parallel attention). Re-exported by
:mod:`fsdp_tp.dropout`, where users meet them.

>>> split_after({-1: "tensor"}, (4, 16))   # a column layer's output: its features over tensor
>>> [dims for dims, _ in STEP.get().region]
[((-1, 'tensor'),)]
>>> split_after({})                         # a row layer's sum: whole again
>>> STEP.get().region
()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import jax

from .._axes import bound_axis_names, checks_vma, varying_axes
from .._context import STEP
from .._sequence_split import SequenceSplit
from .._types import AxisName

__all__ = ["Split", "activation_split", "split_after", "splitting", "unplaceable_after"]


def _sequence_dim(x: jax.Array, tokens: int, where: str) -> int:
    """The dim of ``x`` a step's sequence split splits: dim 1, which holds a device's
    ``tokens`` (``(rows, tokens, ...)``, as the batch's leaves); otherwise its mask has no place."""
    if x.ndim > 1 and x.shape[1] == tokens:
        return 1
    raise ValueError(
        f"{where}: dropout on an activation of local shape {tuple(x.shape)} in a step that splits the "
        f"sequence: a device holds {tokens} tokens, and dim 1 of an activation is where they are "
        f"({'it holds ' + str(x.shape[1]) if x.ndim > 1 else 'it has none'}), so its mask cannot be "
        f"placed. Apply the dropout to a (rows, tokens, ...) activation, before any transpose."
    )


Split = tuple  # per dim: None, an axis, or a tuple of axes (major first), as box names are

# The activations a tensor-parallel role left split: per entry, the dims (counted from the
# end) and their axes (None: no split describes it, its mask cannot be placed), and the local
# shape they describe (None: any activation, inside a role that knows its own computation).
# Column layers add their output's entry, a row layer's sum clears them; a call starts whole.
# They are the step record's region (:data:`~fsdp_tp._context.STEP`), reset where it is.
Entry = tuple[tuple[tuple[int, AxisName], ...] | None, tuple[int, ...] | None]


def split_after(
    dims: Mapping[int, AxisName], shape: tuple[int, ...] | None = None, add: bool = False
) -> None:
    """From here on (until a role says otherwise) activations are split on ``dims`` (counted
    from the end) over their axes: a column layer's output features; ``{}`` after a sum.
    With ``shape`` (the output's local shape) the split describes activations of that shape
    only (elementwise work keeps it; an einsum or a reshape does not), and ``add=True`` keeps
    the earlier column layers' entries beside it (q and kv projections read in one attention)."""
    entry: Entry = (tuple(dims.items()), shape)  # ({}: whole again, whatever the shape)
    STEP.update(region=(*(STEP.get().region if add else ()), entry) if dims else ())


def unplaceable_after(shape: tuple[int, ...]) -> None:
    """Activations of ``shape`` are blocks no split describes (each device keeping the block of
    kv heads its queries read, shared with its neighbours): dropout on them is refused."""
    STEP.update(region=(*STEP.get().region, (None, tuple(shape))))


# Why a dropout inside a module of raw kernels cannot be placed, and its fix (a Region's)
_RAW_CODE = (
    "the code of a module a Region computes on its kernels' blocks, whose activations' split "
    "the roles do not know (dropout there: move it out of the module, after its sum, or give "
    "the activation a column layer of its own)"
)


@contextlib.contextmanager
def unplaceable_within(why: str = _RAW_CODE) -> Iterator[None]:
    """Within (a module :class:`~fsdp_tp.tp.Region` runs as written on its kernels' blocks):
    every activation is a block no split describes, its own code moving the split dims as it
    likes, so dropout is refused in both ``check_vma`` modes (unchecked, it would draw a mask no
    block of the unsharded one); ``why`` says so, with the fix, for the role that runs it."""
    with STEP.scoped(region=((None, None),), unplaceable=why):
        yield


@contextlib.contextmanager
def splitting(dims: Mapping[int, AxisName] | None = None) -> Iterator[None]:
    """Within: activations are split on ``dims`` (a head-parallel attention's heads); after, as
    before. ``splitting()`` starts a model call whole, whatever an earlier trace left."""
    with STEP.scoped(region=((tuple(dims.items()), None),) if dims else ()):
        yield


def _region_dims(x: jax.Array, where: str) -> tuple[tuple[int, AxisName], ...]:
    """The split dims of the region's entries that describe ``x``; inside a region none of
    whose entries does, an error: which of its dims are split is unknown."""
    entries = STEP.get().region
    if not entries:
        return ()
    matched = [dims for dims, shape in entries if shape is None or shape == tuple(x.shape)]
    known = ", ".join(str(shape) for _, shape in entries if shape is not None)
    placed = [dims for dims in matched if dims is not None]
    if not placed or len(placed) < len(matched) or len(set(placed)) > 1:
        why = (
            STEP.get().unplaceable
            if (None, None) in entries
            else "a block no split describes (kv heads kept whole, replicated=True)"
            if None in matched
            else f"the tensor-parallel roles know the split of activations of local shapes {known} only"
        )
        raise ValueError(
            f"{where}: dropout on an activation of local shape {tuple(x.shape)} inside a tensor-parallel "
            f"region: {why}, so its mask cannot be placed (an einsum or a reshape of a column layer's "
            f"output moves its split dims; attention weights computed from q and k are one). Apply the "
            f"dropout to a column layer's output as it is, or after the row layer's sum, or give the "
            f"attention module HeadParallel, which knows its weights."
        )
    return placed[0]


def activation_split(x: jax.Array, batch_axes: Sequence[AxisName], where: str) -> Split:
    """How ``x``, an activation inside ``jax.shard_map``, is split: dim 0 over ``batch_axes``,
    and the dims the tensor-parallel roles left split. Under ``check_vma=True`` the batch axes
    ``x`` does not vary over are left out (a value the batch does not reach, drawn the same on
    every device, as unsharded), and an axis ``x`` varies over that no dim accounts for is an
    error naming ``where``: its mask cannot be placed."""
    names: list = [()] * x.ndim
    bound = bound_axis_names()
    checking = bool(bound) and checks_vma(bound[0])
    varying = varying_axes(x) if checking else None
    step = STEP.get()
    sequence, tokens = (step.sequence, step.tokens) if step.tokens is not None else (None, 0)
    if x.ndim:
        names[0] = tuple(a for a in batch_axes if (varying is None or a in varying))
    if sequence is not None and sequence.axis in names[0]:  # (the step splits dim 1, not the rows)
        names[0] = tuple(a for a in names[0] if a != sequence.axis)
        names[_sequence_dim(x, tokens, where)] = (sequence,)
    known = _region_dims(x, where)
    for dim, axis in known:
        if -x.ndim <= dim < 0 and (varying is None or axis in varying):
            names[dim] = (*names[dim], axis)
    placed = {a.axis if isinstance(a, SequenceSplit) else a for entry in names for a in entry}
    if varying is not None and (lost := varying - placed):
        raise ValueError(
            f"{where}: dropout on an activation of shape {x.shape} that varies over "
            f"{sorted(lost, key=str)}, but no dim is known to be split over it (dim 0 over the batch "
            f"axes {tuple(batch_axes)}, and the dims tensor-parallel roles split: "
            f"{dict(known) or 'none here'}); its mask would repeat across those devices. Apply the "
            f"dropout before the activation is split, or where a role's output is."
        )
    return tuple(entry[0] if len(entry) == 1 else (entry or None) for entry in names)

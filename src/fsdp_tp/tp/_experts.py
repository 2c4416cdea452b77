"""Expert parallelism as a role: :class:`ExpertParallel` puts an einsum's expert dim on a mesh
axis, and the tokens go to the device that holds their expert by ``all_to_all`` and come back
the same way.

A mixture of experts computes its experts on buffers ``(groups, E, capacity, d)``
(:mod:`fsdp_tp.models.moe`) with kernels ``(E, d, h)``. With E split over ``axis`` (whose
devices hold different tokens: it splits the batch), device ``j`` holds experts ``j E/n ..
(j+1) E/n``. The first expert layer to read a buffer sends each device's slice ``j`` of the
experts to device ``j`` (``all_to_all``: split on E, concatenated on the groups), once however
many layers read it (a gated expert's gate and up); the layers compute there on
``(n groups, E/n, capacity, ·)``; the layer with ``returns=True`` sends the results back (the
inverse ``all_to_all``). An expert's weights are never gathered over ``axis``.

A device's expert kernel meets every device's tokens, so its gradient is the sum of their
devices' losses' gradients: the role scales it by ``1/n`` (the loss is their mean), which the
gradient sync, leaving a split parameter alone on its axis, does not.

>>> layer = Layer(kind="einsum", path="moe/experts/gate", equation="GECD,EDH->GECH",
...               kernel_shape=(8, 16, 32))
>>> ExpertParallel().splits(layer), ExpertParallel().local(layer, 4)
({'kernel': -3, 'bias': -2}, Local(kernel_shape=(2, 16, 32)))

With ``within``, each expert's hidden dim split over ``tensor`` as well, a kernel on two axes:

>>> from fsdp_tp.tp._role import placements
>>> placements(ExpertParallel(within=ColumnParallel()), layer)[::2]
[('kernel', -3, 'expert'), ('kernel', -1, 'tensor')]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import jax

from .._batch import step_batch_axes
from ..errors import RuleError
from ._einsum import Equation, shrunk
from ._expert_call import cotangent_times as _cotangent_times
from ._expert_call import experts_call, gathered_read
from ._matmul import ColumnParallel, RowParallel
from ._region import Region, named_dims
from ._role import Layer, Local, TPRole
from .pieces import once

__all__ = ["EXPERT", "ExpertParallel"]

EXPERT = "expert"
"""The mesh axis :class:`ExpertParallel` splits the experts over unless told another."""


@dataclass(frozen=True)
class ExpertParallel(TPRole):
    """An einsum layer whose kernel has an expert dim (``letter``, default the kernel's first
    letter the input and the output share, e.g. the ``E`` of ``'GECD,EDH->GECH'``), split over
    ``axis``. Its input arrives with every expert (a dispatched buffer: sent to the experts'
    devices first) or already there (another expert layer's output); ``returns=True`` on the
    expert MLP's last layer sends the output back. The buffer's rows travel along its first
    input dim that is neither a kernel dim nor contracted (the groups). ``within``: each
    expert's own Megatron split over another axis, on the experts' devices (gate and up
    ``ColumnParallel()``, down ``RowParallel()`` over ``tensor``: the hidden dim split there too,
    one all-reduce forward and one backward per expert MLP). ``dims`` (``{parameter: dim}``,
    counted from the end): the role computes a module of raw expert kernels (any class), each
    named kernel split on its experts dim: a bank taking the dispatched buffers ``(groups, E,
    capacity, d)``, or a whole mixture routing in its own call; the module's call runs again
    with the buffers sent to the experts' devices before its einsums over the kernels and back
    before anything else reads them (:mod:`fsdp_tp.tp._expert_call`: one all-to-all each way);
    its ``within`` a :class:`~fsdp_tp.tp.Region` naming each kernel's hidden dim.

    >>> ExpertParallel(dims={"w_up": -3, "w_down": -3}).splits(Layer("module", "moe/experts"))
    {'w_down': -3, 'w_up': -3}"""

    axis: str = EXPERT
    letter: str | None = None
    returns: bool = False
    within: TPRole | None = None
    dims: Mapping[str, int] | tuple = ()
    kinds: ClassVar[tuple[str, ...]] = ("einsum",)
    on_batch_axis: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.dims:
            example = "ExpertParallel(dims={'w_gate': -3, 'w_up': -3, 'w_down': -3}) for (E, d, h), (E, h, d)"
            object.__setattr__(self, "dims", named_dims("ExpertParallel", self.dims, example))
            if self.letter is not None:
                raise RuleError(
                    f"ExpertParallel(dims={self.dims!r}, letter={self.letter!r}) computes a module of raw "
                    f"expert kernels, each split on the experts' dim dims names; letter= is an einsum "
                    f"layer's: drop it."
                )
        if self.within is not None:
            _require_within(self.within, self.axis, raw=bool(self.dims))

    def takes_any_module(self) -> bool:
        return bool(self.dims)  # (a bank of raw expert kernels, whatever its class)

    def runs_call_again(self) -> bool:
        return bool(self.dims)  # (fsdp_tp.tp._expert_call)

    def parts(self):
        return (self,) if self.within is None else (self, self.within)

    def _split(self, layer: Layer) -> tuple[Equation, str, int]:
        if layer.kind != "einsum":
            raise RuleError(
                f"{layer.path}: ExpertParallel splits an einsum's expert dim, and {layer.path} is a "
                f"{layer.kind} layer; give it to the einsums over the experts' kernels (E, d, h)."
            )
        eq = Equation.parse(layer.equation, layer.path)
        letter = eq.choose(self.letter, "ExpertParallel", "batched")
        return eq, letter, eq.kernel_dim(letter)

    def splits(self, layer):
        if self.dims:
            return dict(self.dims)
        eq, letter, dim = self._split(layer)
        kernel, *bias = layer.parameters
        return {kernel: dim - len(eq.kernel)} | {
            n: eq.bias_letters.index(letter) - len(eq.bias_letters) for n in bias
        }

    def divides(self, layer):
        if self.dims:
            return {}  # (the parameters' own sizes: storage checks each split names its dim)
        eq, letter, dim = self._split(layer)
        return {f"the experts (letter {letter!r} of {eq.text!r})": layer.kernel_shape[dim]}

    def local(self, layer, size):
        if self.dims:  # (each kernel read at its size, the einsums then take the block: _expert_call)
            read = {name: gathered_read(self.axis, dim, name) for name, dim in dict(self.dims).items()}
            if self.within is None:
                return Local(read=read)
            # (each expert's hidden dim a block over the within Region's axis, read as the block)
            hidden = dict(self.within.dims)  # type: ignore[attr-defined]
            return Local(read=read, blocks=hidden, blocks_axis=self.within.axis)
        _, _, dim = self._split(layer)
        own = Local(kernel_shape=shrunk(layer.kernel_shape, dim, size))
        if self.within is None:
            return own
        # (the hidden split of this device's experts: sizes over the within role's own axis)
        experts = dataclasses.replace(layer, kernel_shape=own.kernel_shape)
        return self.within.local(experts, jax.lax.axis_size(self.within.axis))

    def call(self, method, run, layer, args, kwargs):
        if self.dims:  # (a module of raw expert kernels: its own call, the all-to-alls placed inside)
            _require_batch_axis(self.axis, layer.path)
            return experts_call(run, args, kwargs, self.axis, layer.path, self.within)
        eq, letter, dim = self._split(layer)
        _require_batch_axis(self.axis, layer.path)
        x, n = args[0], jax.lax.axis_size(self.axis)
        expert, rows = eq.dim_of(letter, eq.inputs, x.ndim), _rows_dim(eq, eq.inputs, x.ndim)
        total = layer.kernel_shape[dim]
        if x.shape[expert] == total:  # a buffer with every expert: to the experts' devices
            x = once(x, ("experts", self.axis, expert, rows), lambda: _all_to_all(x, self.axis, expert, rows))
        elif x.shape[expert] != total // n:
            raise RuleError(
                f"{layer.path} (ExpertParallel over {self.axis!r}): its input {tuple(x.shape)} has "
                f"{x.shape[expert]} on the expert dim (letter {letter!r} of {eq.text!r}), neither the "
                f"{total} experts nor this device's {total // n}; feed it the experts' buffers."
            )
        if self.within is not None:  # each expert's Megatron split, on its device
            run = functools.partial(_around, self.within, method, run, layer)
        # The kernel's gradient 1/n (its tokens' losses are averaged over n devices), the
        # input's as it is: the output's cotangent scaled by 1/n, the input's back by n (once
        # per buffer, so a within column role's f is shared by the layers that read it).
        scaled = once(x, ("expert-scale", self.axis), lambda: _cotangent_times(x, n))
        out = _cotangent_times(run(scaled, *args[1:], **kwargs), 1 / n)
        if self.returns:
            back = _rows_dim(eq, eq.output, out.ndim)
            out = _all_to_all(out, self.axis, split=back, concat=eq.dim_of(letter, eq.output, out.ndim))
        return out


def _around(role: TPRole, method: str, run, layer: Layer, *args, **kwargs):
    return role.around(method, run, layer, args, kwargs)


def _require_within(role: TPRole, axis: str, raw: bool) -> None:
    """``within`` is a plain role over another axis: a column or row one on an einsum layer
    (a buffer of experts has no sequence to split or ring over, and its output is the
    experts': no gather, no kept block), or on raw expert kernels a :class:`Region` naming
    each kernel's hidden dim (its output summed, not gathered)."""
    kind = type(role)
    if raw:
        plain = kind is Region and role == Region(role.axis, dims=role.dims)  # type: ignore[attr-defined]
        example = "ExpertParallel(dims={...}, within=Region(dims={'w_gate': -1, 'w_up': -1, 'w_down': -2}))"
    else:
        plain = kind in (ColumnParallel, RowParallel) and role == kind(role.axis, letter=role.letter)  # type: ignore[call-arg, attr-defined]
        example = "ExpertParallel(within=ColumnParallel(axis='tensor'))"
    if not plain or role.axis == axis:
        raise RuleError(
            f"ExpertParallel(within={role!r}) over {axis!r}: within is each expert's Megatron split over "
            f"another axis: on einsum layers ColumnParallel() for gate and up, RowParallel() for down "
            f"(a letter= at most); on raw expert kernels (dims=) Region(dims=...) naming each kernel's "
            f"hidden dim; on an axis other than {axis!r}, e.g. {example}."
        )


def _require_batch_axis(axis: str, path: str) -> None:
    """The devices of ``axis`` hold different tokens (it splits the batch): where they held the
    same, each would send its copy to the experts, and the replicated parameters' gradients,
    summed over the axis by JAX, would be averaged over the batch axes without it."""
    step = step_batch_axes()
    if step is not None and axis not in step and jax.lax.axis_size(axis) > 1:
        raise RuleError(
            f"{path}: ExpertParallel over {axis!r} sends each device's tokens to the devices of "
            f"{axis!r} that hold their experts, so {axis!r} must split the batch; the step splits "
            f"it over {step!r}. Split the batch over {axis!r} too (batch_specs P({(*step, axis)!r}))."
        )


def _rows_dim(eq: Equation, operand: str, ndim: int) -> int:
    """The dim the buffer's rows travel along: the operand's first letter outside the kernel
    that the output keeps (the groups of ``'GECD'``)."""
    letters = [c for c in operand if c != "." and c not in eq.kernel and c in eq.output and c in eq.inputs]
    if not letters:
        raise RuleError(
            f"{eq.path}: ExpertParallel sends a buffer's rows to the experts' devices along a dim of "
            f"its input that the kernel does not have (the groups of 'GECD,EDH->GECH'); "
            f"{eq.text!r} has none. Write the experts' einsums over (groups, experts, capacity, d)."
        )
    return eq.dim_of(letters[0], operand, ndim) % ndim


def _all_to_all(x: jax.Array, axis: str, split: int, concat: int) -> jax.Array:
    return jax.lax.all_to_all(x, axis, split % x.ndim, concat % x.ndim, tiled=True)

"""A module of raw kernels computed as one Megatron region: :class:`Region`.

The roles of :mod:`._matmul` take a module with one kernel. Models people bring hold several
raw parameters in one module and read them with ``jnp.einsum`` (a one-module SwiGLU MLP:
``w_gate``, ``w_up`` and ``w_down``; attention with raw ``q``/``kv``/``out``). :class:`Region`
names the dim each of them splits on; the module's own code then runs on its blocks, as
written: what enters is the same on every device (Megatron's *f*, once per distinct input),
what leaves is summed once over the axis (*g*), or gathered along its last dim for a module
that ends on a column. The plan check reads the module's trace against the unsharded one
(:mod:`fsdp_tp._check`), so only elementwise operations may stand between a column read
and a row read: a norm over the split hidden dim, or a split on the dim the first einsum
contracts, is refused at the model's line before anything trains.

>>> role = Region(dims={"w_gate": -1, "w_up": -1, "w_down": -2})
>>> role.splits(Layer("module", "mlp"))
{'w_down': -2, 'w_gate': -1, 'w_up': -1}
>>> role.local(Layer("module", "mlp"), 4)
Local(blocks={'w_down': -2, 'w_gate': -1, 'w_up': -1})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import jax

from ..collectives import gather_from_axis
from ..dropout import split_after, unplaceable_within
from ..errors import RuleError
from ._around import copied
from ._role import Layer, Local, TPRole
from .pieces import row_reduce

__all__ = ["Dims", "Region", "named_dims"]


class Dims(tuple):
    """A :class:`Region`'s ``{parameter: dim}``, hashable and in one order (a role is a frozen
    value), shown as the dict a user writes."""

    def __repr__(self) -> str:
        return repr(dict(self))


@dataclass(frozen=True)
class Region(TPRole):
    """A module of raw kernels on its blocks: ``dims`` maps each parameter the module holds
    (its name under the module, ``"w_gate"``) to the dim it splits on over ``axis``, counted
    from the end (``-1``: a column kernel's output features; ``-2``: a row kernel ``(h, d)``'s
    input features), so a stacked scan dim in front changes nothing; parameters it does not
    name stay whole. The module's output is summed over the axis (its last einsum contracts a
    split dim), or with ``gather_output=True`` all-gathered along its last dim (its last
    einsum produces one). ``sequence_dim``: sequence parallelism, as the column and row roles
    take it (the input all-gathered along it, the output reduce-scattered)."""

    dims: Mapping[str, int] | tuple = ()
    gather_output: bool = False
    sequence_dim: int | None = None
    kinds: ClassVar[tuple[str, ...]] = ("module",)  # (any class: its parameters named)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.axis, Mapping):
            raise RuleError(
                f"Region({dict(self.axis)!r}): a role's first argument is its mesh axis; pass the "
                f"parameters' dims by keyword: Region(dims={dict(self.axis)!r})."
            )
        example = "Region(dims={'w_gate': -1, 'w_up': -1, 'w_down': -2}) for kernels (d, h), (d, h), (h, d)"
        object.__setattr__(self, "dims", named_dims("Region", self.dims, example))

    def splits(self, layer: Layer) -> dict[str, int]:
        return dict(self.dims)

    def divides(self, layer: Layer) -> dict[str, int]:
        return {}  # (the sizes are the parameters' own: storage checks each split names its dim)

    def local(self, layer: Layer, size: int) -> Local:
        return Local(blocks=dict(self.dims))

    def call(self, method, run, layer, args, kwargs):
        args, kwargs = copied(args, kwargs, self.axis, self.sequence_dim)
        with unplaceable_within():  # (dropout inside: which dims are split, the roles cannot tell)
            out = run(*args, **kwargs)
        if not isinstance(out, jax.Array | jax.core.Tracer):
            raise RuleError(
                f"{layer.path}: Region sums or gathers what the module returns over {self.axis!r}, and it "
                f"returned a {type(out).__name__}; give the role to a module that returns one array."
            )
        if self.gather_output:
            split_after({})
            return gather_from_axis(out, out.ndim - 1, self.axis)
        return row_reduce(out, self.axis, self.sequence_dim)


def named_dims(role: str, dims, example: str) -> Dims:
    """A role's ``{parameter: dim}`` of a module of raw kernels, checked: at least one, each dim
    a whole number counted from the end (a stacked scan dim in front then changes nothing)."""
    given = dict(dims)
    bad = {
        name: dim
        for name, dim in given.items()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim >= 0
    }
    if not given or bad:
        raise RuleError(
            f"{role}(dims={given!r}): name each parameter of the module and the dim it splits on, "
            f"counted from the end ({bad or 'none named'}): {example}."
        )
    return Dims(sorted(given.items()))

"""What every tensor-parallel role stands on: :class:`Layer` (a submodule as a role sees it,
whichever front end built it), :class:`TPRole` (the interface a role implements), and the
steps the roles of :mod:`fsdp_tp.tp` share around a layer's call (the ``check_vma`` a
sequence split needs; the rest, *f* once per activation and a ring's chunks as they arrive, in
:mod:`fsdp_tp.tp._around`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from .._axes import TENSOR, checks_vma
from .._context import CHECK
from .._layout import axis_text, require_divisible
from ..collective_matmul import require_mode
from ..errors import RuleError

__all__ = ["Layer", "Local", "TPRole", "axes_of", "placements"]


@dataclass(frozen=True)
class Layer:
    """A submodule as a role sees it, whichever front end built it.

    ``kind``: ``"dense"``, ``"conv"``, ``"einsum"``, ``"attention"`` or ``"embed"``.
    ``features``: the output feature dims; ``contracted``: how many input dims it contracts;
    ``in_size``: the first contracted dim's size; ``groups``: a convolution's feature groups;
    ``equation`` and ``kernel_shape``: an einsum's (0 for a size the module does not hold);
    ``parameters``: the names a role may split, the kernel first (a module registered with
    :func:`~fsdp_tp.tp._registered.register_einsum`: its kernel only); ``bias``: reads the stored
    bias as the module reads it (gathered over FSDP's axes); ``norms_summed``: the model sums
    its replicated parameters' gradients over the axis itself (a model of Linen's Megatron
    layers, whose norms apply *f* to their parameters), so a ``sequence_dim`` needs no
    ``check_vma``."""

    kind: str
    path: str
    features: tuple[int, ...] = ()
    contracted: int = 1
    in_size: int = 0
    groups: int = 1
    num_heads: int = 0
    num_kv_heads: int = 0
    num_embeddings: int = 0
    use_bias: bool = False
    equation: str = ""
    kernel_shape: tuple[int, ...] = ()
    parameters: tuple[str, ...] = ("kernel", "bias")
    dtype: Any = None
    bias: Callable[[], jax.Array] | None = None
    norms_summed: bool = False


@dataclass(frozen=True)
class Local:
    """The sizes a role computes a module with on this device, which the front end writes as
    the module's attributes (``None``: the module's own): ``features`` (a dense or conv
    layer's output dims), ``kernel_shape`` (an einsum's), ``use_bias`` (``False``: a row layer
    adds the bias after its sum), ``num_heads`` and ``num_kv_heads`` (attention's),
    ``num_embeddings`` (an embedding's); ``read``: ``{parameter path under the module: a
    function of its stored value}``, what the call reads in its place (a block of a parameter
    kept whole); ``blocks``: ``{parameter name: dim}``, parameters the module reads as this
    device's block along that dim while its attributes keep the unsharded sizes (a module of
    raw kernels: a front end that checks a parameter against the module's sizes checks the
    block's), blocks over ``blocks_axis`` (``None``: the role's). A size a front end cannot
    write is an error there, never dropped.

    >>> Local(num_embeddings=8)
    Local(num_embeddings=8)
    """

    features: tuple[int, ...] | None = None
    kernel_shape: tuple[int, ...] | None = None
    use_bias: bool | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    num_embeddings: int | None = None
    read: Mapping[str, Callable[[jax.Array], jax.Array]] = dataclasses.field(default_factory=dict)
    blocks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    blocks_axis: str | None = None

    def __repr__(self) -> str:  # (the sizes set, as a role's docstring shows them)
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown = {k: v for k, v in given.items() if v is not None and v != {}}
        return f"Local({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


@dataclass(frozen=True)
class TPRole:
    """How a submodule computes on its slices over mesh axis ``axis``: which of its
    parameters are split on which dim (:meth:`splits`, dims counted from the end, so a
    stacked scan dim in front changes nothing), the sizes the axis must divide
    (:meth:`divides`), the local sizes it computes with (:meth:`local`, which the front end
    writes as the module's attributes), and the collectives around the call (:meth:`around`)."""

    axis: str = TENSOR
    kinds: ClassVar[tuple[str, ...]] = ()
    methods: ClassVar[frozenset[str]] = frozenset({"__call__"})
    # Whether the axis is one the batch is split over (experts meet every device's tokens
    # there), where a tensor-parallel axis never is.
    on_batch_axis: ClassVar[bool] = False

    def __post_init__(self):
        # A role with rings (collective_matmul) names a mode the rings have, checked once here.
        require_mode(getattr(self, "collective_matmul", None), type(self).__name__)
        dim = getattr(self, "sequence_dim", None)
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0):
            raise RuleError(
                f"{type(self).__name__}(sequence_dim={dim!r}): sequence_dim is the activations' "
                f"sequence dim counted from the front, a whole number >= 0 (1 for (batch, sequence, "
                f"features)); the last dim is the features a role splits, never the sequence."
            )

    def takes_any_module(self) -> bool:
        """Whether this role computes a module of any class, its parameters named by the role
        (a module of raw kernels: the ``"module"`` kind), beside the classes of its ``kinds``."""
        return "module" in self.kinds

    def runs_call_again(self) -> bool:
        """Whether the role runs the module's call again operation by operation (its trace re-run
        with collectives placed inside it), so that no role of a submodule inside it runs."""
        return False

    def splits(self, layer: Layer) -> dict[str, int]:
        """``{parameter path under the module: the dim split over the axis}``."""
        raise NotImplementedError

    def divides(self, layer: Layer) -> dict[str, int]:
        """``{what: size}`` that the axis size must divide for the split to work."""
        raise NotImplementedError

    def require_divides(self, layer: Layer, size: int, where: str, fix: Callable[[int], str]) -> None:
        """The one divisibility check of a role, whichever front end asks: the axis size
        (``size``) divides each size :meth:`divides` names, else the package's wording, with
        ``where`` the caller's name for the layer and ``fix(size)`` its remedy."""
        for what, value in self.divides(layer).items():
            require_divisible(where, what, value, axis_text(self.axis), size, fix(value))

    def kept_whole(self, layer: Layer) -> tuple[str, ...]:
        """Parameters (paths under the module) stored whole over the axis, of which each
        device reads a block (``local``'s ``read``): their gradients are summed over the
        axis, which a front end may do on its FSDP shard rather than on the gathered value."""
        return ()

    def local(self, layer: Layer, size: int) -> Local:
        """The sizes the module computes with on this device's slices, over an axis of
        ``size`` devices (:class:`Local`)."""
        return Local()

    def inner(self) -> dict[str, TPRole]:
        """Roles of the module's own children (by name), which it creates itself."""
        return {}

    def parts(self) -> tuple[TPRole, ...]:
        """This role, then any it runs inside itself on the same module over another axis
        (:class:`~fsdp_tp.tp.ExpertParallel`'s ``within``): a front end checks, places and
        sizes each over its own axis (:func:`placements`)."""
        return (self,)

    def around(self, method: str, run, layer: Layer, args: tuple, kwargs: dict):
        """The call, the one way every front end runs a role: ``run(*args, **kwargs)`` is the
        module's ``method`` on its slices, with the collectives :meth:`call` puts around it, once
        the step is known to run with the ``check_vma`` a ``sequence_dim`` needs (or the model
        sums its norms' gradients itself: ``layer.norms_summed``); inside the plan check's trace
        (``CHECK``'s ``unringed``), without rings."""
        if not layer.norms_summed:
            _sequence_checked(self, layer)
        _sequence_fits(self, layer, args)
        role = self
        if CHECK.get().unringed and getattr(self, "collective_matmul", None) is not None:
            role = dataclasses.replace(self, collective_matmul=None)  # type: ignore[call-arg]
        return role.call(method, run, layer, args, kwargs)

    def call(self, method: str, run, layer: Layer, args: tuple, kwargs: dict):
        """What a role puts around ``run``, the part each role writes; called by :meth:`around`
        alone."""
        raise NotImplementedError


def axes_of(roles: Iterable[TPRole]) -> set[str]:
    """The mesh axes ``roles`` and their parts (:meth:`TPRole.parts`) compute over."""
    return {part.axis for role in roles for part in role.parts()}


def placements(role: TPRole, layer: Layer) -> list[tuple[str, int, str]]:
    """``(parameter path under the module, dim, mesh axis)`` of every split ``role`` and its
    parts (:meth:`TPRole.parts`) make, in their order: a parameter may be split on two dims over
    two axes (an expert kernel's experts and hidden dim)."""
    return [(name, dim, part.axis) for part in role.parts() for name, dim in part.splits(layer).items()]


def _sequence_checked(role: TPRole, layer: Layer) -> int | None:
    """A role's ``sequence_dim``, once the step is known to run with ``check_vma=True``:
    between its layers a norm's parameters (or any replicated one) read sequence slices, so
    their gradients are partial sums over the axis, which JAX's checking sums (its implicit
    ``pvary``); unchecked, they would be this device's share, silently."""
    dim = getattr(role, "sequence_dim", None)
    if dim is not None and not checks_vma(role.axis):
        raise RuleError(
            f"{layer.path}: {type(role).__name__}(sequence_dim={dim}) splits the activations between "
            f"tensor-parallel layers along dim {dim} over {role.axis!r}, where replicated parameters "
            f"(a norm's scale) read sequence slices and their gradients must be summed over "
            f"{role.axis!r}: check_vma=True does that, and this step runs with check_vma=False. Run "
            f"the step (init_sharded and shard_step) with check_vma=True, or drop sequence_dim."
        )
    return dim


def _sequence_fits(role: TPRole, layer: Layer, args: tuple) -> None:
    """A ``sequence_dim`` that names a dim of the layer's input other than its features (a
    dense or conv layer's last dim; an einsum's input may put its sequence anywhere)."""
    dim = getattr(role, "sequence_dim", None)
    shape = getattr(args[0], "shape", None) if args else None
    if dim is None or shape is None:
        return
    last = len(shape) - (1 if layer.kind in ("dense", "conv", "attention") else 0)
    if dim >= last:
        raise RuleError(
            f"{layer.path}: {type(role).__name__}(sequence_dim={dim}) names dim {dim} of its input, of "
            f"shape {tuple(shape)} on this device, whose sequence dim is one of 0..{last - 1}"
            f"{' (the last is the features)' if last < len(shape) else ''}: pass the dim the sequence "
            f"is on (1 for (batch, sequence, features)), the same on every role of the plan."
        )

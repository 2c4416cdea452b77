"""An NNX layer as a tensor-parallel role sees it and computes it: which kind each NNX class
is (:data:`NNX`), the :class:`~fsdp_tp.tp.Layer` a module is (:func:`layer_of`), and the
subclass a module's class is swapped for, whose call runs the role with the local sizes
written as the module's attributes for that call (:func:`computed`).

>>> from flax import nnx
>>> layer = layer_of(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), "mlp/up")
>>> layer.kind, layer.features, layer.in_size
('dense', (16,), 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, ClassVar

import jax.extend
from flax import errors as flax_errors
from flax import nnx

from .._tree import module_path
from ..errors import RuleError
from ..tp import Layer, RowParallel, TPRole
from ..tp._front import Kinds, Local, compute, computes_of, dims, slice_error
from ._swap import Swap

__all__ = ["NNX", "NNXFront", "Path", "computed", "layer_of", "path_text"]

NNX = Kinds(
    "nnx",
    {
        "dense": (nnx.Linear, nnx.LinearGeneral),
        "conv": (nnx.Conv,),
        "einsum": (nnx.Einsum,),
        "attention": (nnx.MultiHeadAttention,),
        "embed": (nnx.Embed,),
    },
)

Path = tuple  # a module's or parameter's keys, as nnx.iter_graph and nnx.to_flat_state give them


def path_text(path: Path) -> str:
    """A path of ``nnx.state`` / ``nnx.iter_graph`` keys as the rules see it: ``blocks/0/up``."""
    return module_path(tuple(str(k) for k in path))


def layer_of(module: Any, path: str, kernel_shape: tuple[int, ...] = ()) -> Layer:
    """``module`` (an NNX layer of one of :data:`NNX`'s kinds, or a class registered with
    ``register_einsum``) as a role sees it. ``kernel_shape``: a registered module's, as the
    abstract model holds it (in the step its parameter is this device's block)."""
    kind = NNX.of(type(module))
    common: dict[str, Any] = {"kind": kind, "path": path, "dtype": getattr(module, "dtype", None)}
    if kind is None:  # a module of the user's whose parameters its role names (Region)
        return Layer(**common | {"kind": "module"})
    if (own := computes_of(type(module))) is not None:
        shape = kernel_shape or tuple(own.kernel_of(module, path).shape)
        return Layer(**common, equation=own.equation, kernel_shape=shape, parameters=(own.kernel,))
    if kind in ("dense", "conv"):
        return Layer(
            **common,
            features=dims(module.out_features),
            contracted=len(dims(getattr(module, "axis", -1))),
            in_size=dims(module.in_features)[0],
            groups=getattr(module, "feature_group_count", 1),
            use_bias=module.use_bias,
            bias=lambda: module.bias[...],
        )
    if kind == "einsum":
        return Layer(
            **common,
            equation=module.einsum_str or "",
            kernel_shape=tuple(module.kernel_shape),
            use_bias=module.bias is not None,
            bias=lambda: module.bias[...],
        )
    if kind == "attention":
        return Layer(**common, num_heads=module.num_heads, num_kv_heads=module.num_kv_heads)
    return Layer(**common, num_embeddings=module.num_embeddings)


def _attributes(module: Any, local: Local) -> list[tuple[nnx.Module, str, Any]]:
    """A role's local sizes as ``(module, attribute, value)``: what the layer's call reads
    (``nnx.LinearGeneral`` reshapes its bias to ``out_features``; a row-parallel
    ``nnx.Linear`` checks ``use_bias`` against its bias, which the role adds after the sum)."""
    out: list[tuple[nnx.Module, str, Any]] = []
    if local.features is not None:
        tuple_valued = isinstance(module.out_features, tuple)  # nnx.LinearGeneral's; Linear's is an int
        out.append((module, "out_features", local.features if tuple_valued else local.features[0]))
    if local.kernel_shape is not None:  # nnx.Einsum reshapes its bias by it; a registered class: its sizes
        out += _kernel_attributes(module, local.kernel_shape)
    if local.use_bias is False:
        out += [(module, "use_bias", False)] if "use_bias" in module.__dict__ else []
        out.append((module, "bias", None))
    if local.num_embeddings is not None:
        out.append((module, "num_embeddings", local.num_embeddings))
    for path, read in local.read.items():  # a block of a parameter kept whole
        *owners, name = path.split("/")
        owner = functools.reduce(getattr, owners, module)
        if (variable := getattr(owner, name, None)) is not None:
            out.append((owner, name, read(variable[...])))  # the call's `self.kernel[...]` reads it
    if local.num_heads is not None:
        heads, kv_heads, head_dim = local.num_heads, local.num_kv_heads, module.head_dim
        out += [(module, "num_heads", heads), (module, "num_kv_heads", kv_heads)]
        out += [(module, "qkv_features", heads * head_dim), (module.query, "out_features", (heads, head_dim))]
        out += [(getattr(module, p), "out_features", (kv_heads, head_dim)) for p in ("key", "value")]
    return out


def _kernel_attributes(module: Any, shape: tuple[int, ...]) -> list[tuple[nnx.Module, str, Any]]:
    if (own := computes_of(type(module))) is None:
        return [(module, "kernel_shape", shape)]
    return [(module, attr, size) for attr, size in own.attributes(shape).items()]


@contextlib.contextmanager
def _set(attributes: list[tuple[nnx.Module, str, Any]]) -> Iterator[None]:
    """The attributes set for one call, then restored: the module the step holds keeps its
    own (``nnx.split`` after the call sees the model as built). ``object.__setattr__``: the
    values are this call's sizes, not state NNX should track."""
    saved = [(m, name, m.__dict__[name]) for m, name, _ in attributes]
    try:
        for m, name, value in attributes:
            object.__setattr__(m, name, value)
        yield
    finally:
        for m, name, value in reversed(saved):
            object.__setattr__(m, name, value)


@dataclasses.dataclass(frozen=True)
class NNXFront:
    """The NNX front end as the core's roles see it (:class:`~fsdp_tp.tp._front.FrontEnd`):
    ``cls``, the module's own class (its methods, before the swap); ``kernel_shape``, a
    registered module's kernel as the abstract model holds it."""

    cls: type
    kernel_shape: tuple[int, ...] = ()
    kinds: ClassVar[Kinds] = NNX

    def layer_of(self, module: Any, path: str, args: tuple, kwargs: dict) -> Layer:
        return layer_of(module, path, self.kernel_shape)

    def with_local(self, module, method: str, role: TPRole, layer: Layer, local: Local, args, kwargs):
        """``module``'s ``method`` with ``local``'s sizes set as its attributes for the call."""
        attributes, original = _attributes(module, local), getattr(self.cls, method)
        made_in = _trace()

        def run(*args, **kwargs):
            nonlocal attributes, made_in
            if local.read and _trace() != made_in:
                # (a role that traces the call anew, ExpertParallel(dims=...)'s: the reads made
                # in that trace, where the role reads them, as Linen's map_variables makes them)
                attributes, made_in = _attributes(module, local), _trace()
            with _set(attributes):
                try:
                    return original(module, *args, **kwargs)
                except TypeError as err:
                    # A matmul's input of other sizes than its slices: a row layer's arrived
                    # whole, or a column layer's split (another TypeError is the layer's own).
                    if not (isinstance(role, RowParallel) or "contracting dimensions" in str(err)):
                        raise
                    raise slice_error(layer.path, role, err) from None
                except flax_errors.TraceContextError as err:
                    raise _mutated_in_trace(layer.path, role, err) from None

        return run


def _mutated_in_trace(path: str, role: TPRole, err: Exception) -> RuleError:
    """A module whose call mutates NNX state (an ``nnx.Dropout``'s rng count), run by a role
    that traces the call anew to place its collectives inside it (``ExpertParallel(dims=...)``):
    the state was made outside that trace, and NNX refuses the write."""
    return RuleError(
        f"{path}: {type(role).__name__} traces this module's call anew to place its all-to-alls "
        f"inside it, and the call updates NNX state made outside that trace ({str(err).split(' (')[0]}: "
        f"an nnx.Dropout's rng count, a BatchNorm's statistics). Move that layer out of the module "
        f"(a dropout after its output), or write the module in Linen, whose dropout draws the "
        f"unsharded mask inside it."
    )


def _trace():
    return jax.extend.core.get_opaque_trace_state(convention="fsdp_tp")


@Swap.kind("role")
def computed(cls: type, role: TPRole, path: str, kernel_shape: tuple[int, ...]) -> dict:
    """A module that runs ``role`` (its ``role.methods`` the role's), at ``path``."""
    front = NNXFront(cls, kernel_shape)

    def method(name: str):
        def run_role(self, *args, **kwargs):
            layer = front.layer_of(self, path, args, kwargs)
            return compute(front, role, self, name, layer, args, kwargs)

        return run_role

    return {name: method(name) for name in role.methods if hasattr(cls, name)}

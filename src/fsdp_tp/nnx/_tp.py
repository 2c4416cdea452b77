"""tp rules on an NNX model: the core's roles (:mod:`fsdp_tp.tp`) computing NNX layers on
their slices.

At :func:`~fsdp_tp.nnx.shard_by_rules` the rules are matched against the module paths of the
abstract model (:class:`RolePlan`), so a wrong rule is named before anything runs, and each
role's split joins the parameter's storage spec. Inside the step the model merged from the
blocks has each named module's class swapped for a subclass whose call runs the role
(:func:`compute_roles`): the role puts Megatron's collectives around the module's own
``__call__`` (``attend``), which runs with the local sizes as its attributes for the call
(``out_features / size``, ``num_heads / size``) and reads the stored slices. A swapped class
survives ``nnx.split`` / ``nnx.merge``, so the roles run inside the model's ``nnx.scan``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from .._axes import require_axes
from .._einsum import computes_of
from .._tree import module_path
from .._types import AxisName
from ..tp import Layer, RowParallel, TPRole
from ..tp._role import Local
from ..tp._rules import (
    CompiledRole,
    Kinds,
    compile_tp_rules,
    dims,
    kind_error,
    require_all_matched,
    require_divides,
    require_own_parameters,
    role_of,
    slice_error,
)

__all__ = ["NNX", "RolePlan", "compute_roles", "layer_of", "path_text", "tp_splits"]

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

Path = tuple


def path_text(path: Path) -> str:
    """A path of ``nnx.state`` / ``nnx.iter_graph`` keys as the rules see it: ``blocks/0/up``."""
    return module_path(tuple(str(k) for k in path))


def layer_of(module: Any, path: str, kernel_shape: tuple[int, ...] = ()) -> Layer:
    """``module`` (an NNX layer of one of :data:`NNX`'s kinds, or a class registered with
    ``register_einsum``) as a role sees it. ``kernel_shape``: a registered module's, as the
    abstract model holds it (in the step its parameter is this device's block)."""
    kind = NNX.of(type(module))
    common: dict[str, Any] = {"kind": kind, "path": path, "dtype": getattr(module, "dtype", None)}
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


@functools.cache
def _computed(cls: type, role: TPRole, path: str, kernel_shape: tuple[int, ...]) -> type:
    """The subclass of ``cls`` whose methods run ``role`` (one per class, role, path and
    kernel shape, so graphs that hold it compare equal from step to step)."""

    def method(name: str):
        original = getattr(cls, name)

        def run_role(self, *args, **kwargs):
            layer = layer_of(self, path, kernel_shape)
            attributes = _attributes(self, role.local(layer, jax.lax.axis_size(role.axis)))

            def run(*args, **kwargs):
                with _set(attributes):
                    try:
                        return original(self, *args, **kwargs)
                    except TypeError as err:
                        # A matmul's input of other sizes than its slices: a row layer's arrived
                        # whole, or a column layer's split (another TypeError is the layer's own).
                        if not (isinstance(role, RowParallel) or "contracting dimensions" in str(err)):
                            raise
                        raise slice_error(path, role, err) from None

            return role.around(name, run, layer, args, kwargs)

        return run_role

    namespace = {name: method(name) for name in role.methods if hasattr(cls, name)}
    return type(cls.__name__, (cls,), {**namespace, "__module__": cls.__module__})


class RolePlan:
    """The roles the tp rules give an NNX model's submodules, read off the abstract model:
    ``roles`` (module path -> (role, pattern, layer)), ``splits`` (parameter path -> (dim,
    axis, pattern)), ``whole`` (parameter path -> the axis a role reads blocks of it over, the
    parameter stored whole there). A rule that names a module no role computes, or nothing,
    is refused."""

    def __init__(self, model: nnx.Module, rules: tuple[CompiledRole, ...], params: list[str]):
        modules = sorted(
            ((path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module) and path),
            key=lambda item: len(item[0]),
        )
        types = {path_text(path): type(node) for path, node in modules}
        self.roles: dict[Path, tuple[TPRole, str, Layer]] = {}
        self.splits: dict[str, tuple[int, AxisName, str]] = {}
        self.whole: dict[str, AxisName] = {}
        used: set[int] = set()
        for path, node in modules:
            text = path_text(path)
            if any(path[: len(p)] == p for p in self.roles):
                continue  # a child of a module a role computes: its role (if any) is the role's
            if (found := role_of(text, rules)) is None:
                continue
            role, pattern, index = found
            if NNX.of(type(node)) not in role.kinds:
                raise kind_error(role, pattern, type(node), text, types, NNX)
            used.add(index)
            self._give(path, node, role, pattern, params)
        require_all_matched(rules, used, types, params, NNX)

    def _give(self, path: Path, node: nnx.Module, role: TPRole, pattern: str, params: list[str]) -> None:
        text = path_text(path)
        layer = layer_of(node, text)
        own = [p[len(text) + 1 :] for p in params if p.startswith(text + "/")]
        require_own_parameters(role, pattern, layer, type(node), own)
        self.roles[path] = (role, pattern, layer)
        for name, dim in role.splits(layer).items():
            if f"{text}/{name}" in params:  # a layer without a bias has no bias to split
                self.splits[f"{text}/{name}"] = (dim, role.axis, pattern)
        kept = (f"{text}/{name}" for name in role.kept_whole(layer))
        self.whole |= {path: role.axis for path in kept if path in params}
        for name, inner in role.inner().items():
            self._give((*path, name), getattr(node, name), inner, f"{text} (inside)", params)

    def check_sizes(self) -> None:
        """Per device: every role's axis is a mesh axis whose size divides what it splits."""
        for role, pattern, layer in self.roles.values():
            (axis,) = require_axes(role.axis, f"tp rule {pattern!r}")
            require_divides(role, pattern, layer, jax.lax.axis_size(axis))


def tp_splits(model: nnx.Module, tp_rules) -> dict[str, tuple[int, AxisName]]:
    """Where the roles of ``tp_rules`` split each parameter of ``model`` (abstract is enough):
    ``{parameter path: (dim counted from the end, mesh axis)}``, what :func:`shard_by_rules`
    adds to each storage spec. Storage rules that must leave those dims alone (FSDP on the
    largest dim tensor parallelism leaves whole, say) read it, so no table repeats the roles.

    >>> from flax import nnx
    >>> from fsdp_tp.tp import ColumnParallel, RowParallel
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.up, self.down = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 4, rngs=rngs)
    >>> model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    >>> tp_splits(model, [("up$", ColumnParallel()), ("down$", RowParallel())])
    {'down/kernel': (-2, 'tensor'), 'up/kernel': (-1, 'tensor'), 'up/bias': (-1, 'tensor')}
    """
    params = [path_text(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    plan = RolePlan(model, compile_tp_rules(tp_rules, "fsdp_tp.nnx.tp_splits"), params)
    return {path: (dim, axis) for path, (dim, axis, _) in plan.splits.items()}


def compute_roles(model: nnx.Module, plan: RolePlan) -> None:
    """Each module a role computes runs it from now on (its class swapped, in place)."""
    for path, node in nnx.iter_graph(model):
        if path in plan.roles:
            role, _, layer = plan.roles[path]
            computed = _computed(type(node), role, layer.path, layer.kernel_shape)  # type: ignore[arg-type]
            object.__setattr__(node, "__class__", computed)

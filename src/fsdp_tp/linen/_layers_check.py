"""The Linen Megatron layers checked against what the model around them computes, at init.

A model may split itself by hand: ``ColumnParallelDense`` for q, k and v, then the model's own
``x.reshape(b, s, self.heads, -1)``, then ``RowParallelDense``. Each layer runs its role on
this device's slice; the code between them runs as written, and a head count taken from the
module regroups a device's features into every head: another model, with no error. The rules'
check (:mod:`fsdp_tp.linen._check`) reads a device's trace against the unsharded model's; here
the unsharded model is the same model on a mesh whose tensor axes have one device (each layer
then holds and computes everything), so both traces run the same lines and pair.

:func:`recording` watches :func:`~fsdp_tp.init_sharded`'s per-device trace (the core's
:func:`~fsdp_tp._init_watch.watch_inits`): each top module called there whose call runs one of
these layers is checked after it, on its inputs' shapes, once per fields, shapes and sizes
(but the library's own models and layers, which its suite proves equal). The check
costs two abstract traces of the model's call, at init only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from .._check.driver import PlanCall, own_trace
from .._check.driver import check_call as drive
from .._init_watch import watch_inits
from .._trace.per_device import trace_per_device
from .._tree import module_path, static_split
from ..tp._find.driver import plan_mesh
from ..tp._front import Graph, module_of
from .layers.attention import AttentionBlock
from .layers.blocks import MLPBlock
from .layers.dense import ColumnParallelDense, RowParallelDense
from .layers.vocab import VocabParallelEmbed

__all__ = ["recording"]

_LAYERS = (ColumnParallelDense, RowParallelDense, VocabParallelEmbed, AttentionBlock, MLPBlock)
_WHOLE = "write it as nn.Dense / nn.Embed, whole on every device"
_CHECKED: set = set()  # (models checked in this process, by class and call: a suite inits one often)
_NOT_USERS = frozenset({"fsdp_tp", "flax", "builtins", "abc", "typing"})  # (classes' top packages)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """A Megatron layer the call ran: its path, class, mesh axis and sequence dim."""

    path: str
    kind: str
    axis: str
    sequence_dim: int | None

    @property
    def role(self) -> str:
        seq = "" if self.sequence_dim is None else f", sequence_dim={self.sequence_dim}"
        return f"{self.kind}(axis={self.axis!r}{seq})"


@dataclasses.dataclass
class _Call:
    """A top module's call during the init: the module unbound, the method, the inputs as
    each device gets them, its rng streams and the Megatron layers it ran."""

    module: nn.Module
    method: str
    args: tuple
    kwargs: dict
    streams: tuple[str, ...]
    layers: dict[str, _Layer] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def recording() -> Iterator[Callable[[Any, bool, Exception | None], None]]:
    """Within, the top modules' calls and the Megatron layers they run are recorded; gives the
    check to run after (``check(mesh, check_vma, error)``: ``error``, what the trace raised)."""
    calls: list[_Call] = []
    open_calls: list[_Call] = []

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "setup" or module.scope is None:
            return next_fun(*args, **kwargs)
        if not open_calls and module.scope.path == () and not _library_model(module):
            streams = tuple(module.scope.rngs)
            call = _Call(module.clone(parent=None), context.method_name, args, kwargs, streams)
            open_calls.append(call)
            try:
                return next_fun(*args, **kwargs)
            finally:
                open_calls.pop()
                if call.layers:
                    calls.append(call)
        if open_calls and isinstance(module, _LAYERS) and module.axis is not None:  # (None: whole)
            path = module_path(module.path)
            seq = getattr(module, "sequence_dim", None)
            open_calls[-1].layers[path] = _Layer(path, type(module).__name__, module.axis, seq)
        return next_fun(*args, **kwargs)

    def check(mesh: Any, check_vma: bool, error: Exception | None) -> None:
        for call in calls:
            _check(call, mesh, check_vma, error)

    with nn.intercept_methods(interceptor):
        yield check


def _library_model(module: nn.Module) -> bool:
    """Whether ``module`` is the library's own (one of :mod:`fsdp_tp.models`, or a layer or
    block called alone), wrapped or not: no code of the user's runs between its layers, the
    suite proves it equal to unsharded on every mesh it runs, and the CLI inits it often; not
    traced again. A user's class the library wraps (``shard_module_params(Model)``) is not."""
    return all(c.__module__.split(".")[0] in _NOT_USERS for c in type(module).__mro__)


def _check(call: _Call, mesh: Any, check_vma: bool, error: Exception | None) -> None:
    """Refuses (``RuleError``) where ``call`` on a device does not compute blocks of the same
    call with every layer whole, or (``error``: the call failed on a device) says why it failed
    (:func:`~fsdp_tp._check.driver.check_call`, on the mesh's sizes)."""
    shape = dict(mesh.shape)
    sizes = {layer.axis: shape[layer.axis] for layer in call.layers.values() if layer.axis in shape}
    if not any(n > 1 for n in sizes.values()):
        return
    arrays, rebuild = static_split(call.args, call.kwargs)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    said = (call.module, call.method, shapes, rebuild([None] * len(arrays)), shape, check_vma)
    whole_mesh = plan_mesh({axis: 1 if axis in sizes else n for axis, n in shape.items()})

    def unsharded(whole=None) -> Graph:
        given = [jax.ShapeDtypeStruct(whole(s.shape), s.dtype) if whole else s for s in shapes]
        return _graph(call, rebuild, given, whole_mesh, check_vma)

    def local() -> Graph:
        if error is not None:  # (the device's trace failed: said as a trace of the check's fails)
            raise error
        return _graph(call, rebuild, shapes, plan_mesh(shape), check_vma)

    layers = list(call.layers.values())
    plan = PlanCall(
        roles=tuple(layers),
        written=f"the Megatron layers [{', '.join(f'{layer.role} at {layer.path}' for layer in layers)}]",
        where=f"init_sharded({type(call.module).__name__})",
        same=(type(call.module), repr(said)),  # (the class itself: two classes may share a name)
        local=local,
        unsharded=unsharded,
        named=_named(call),
        sizes=sizes,
        whole=_WHOLE,
        # (the layers' own matmuls, the library's code, split: a split's origin names its layer)
        split_by=("dot_general",),
    )
    drive(plan, _CHECKED if error is None else set())


def _graph(call: _Call, rebuild, shapes: list, mesh, check_vma: bool) -> Graph:
    """``call``'s init computing its output, traced as one device of ``mesh`` runs it (its
    inputs ``shapes`` on every device; the roles without rings)."""
    streams = {name: jax.random.key(0) for name in ("params", "dropout", *call.streams)}
    found: list[Graph] = []

    def init(values):
        args, kwargs = rebuild(values)
        out, variables = call.module.init_with_output(streams, *args, method=call.method, **kwargs)
        return out, variables.get("params", {})

    def traced(*values):
        found.append(Graph.trace_init(init, list(values)))
        return ()

    specs = tuple(PartitionSpec() for _ in shapes)
    with own_trace():  # (no check of the check's own trace; roles without rings)
        trace_per_device(traced, mesh, specs, tuple(shapes), check_vma=check_vma)
    return found[0]


def _named(call: _Call) -> Callable[[str], tuple[str, str]]:
    """A name stack as the innermost Megatron layer it is in and its class; outside every
    layer (the model's own code), the module and the layers it holds."""

    def named(scope: str) -> tuple[str, str]:
        parts = module_of(scope).split("/")[1:]  # (the top module's name first)
        for end in range(len(parts), 0, -1):
            if (layer := call.layers.get("/".join(parts[:end]))) is not None:
                return layer.path, layer.role
        inside = "/".join(parts)
        held = [layer.path for layer in call.layers.values() if layer.path.startswith(inside)]
        return inside, f"the Megatron layers at {', '.join(held)}"

    return named


watch_inits(recording)

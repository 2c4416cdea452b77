"""The proof for a user's own model: :func:`check_sharded` builds the sharded model and its
unsharded twin from what the user has (the model, the rules, a mesh, a batch and a loss) and
runs the suite's check (:func:`~fsdp_tp.testing.check_equal`) on them.

Long because the one entry point reads every form of the user's call: a model of either API,
of one input or several, a loss as a mean or as ``(sum, weight)``, and names each of them that
cannot run, with its fix, before anything is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from .._axes import CONTEXT, as_axis_tuple
from .._batch import DEFAULT_BATCH_AXES
from .._check.driver import PARTIAL_SUM_READ, checking
from .._sequence_split import SequenceSplit
from .._types import AxisNames
from ..errors import RuleError
from ..gradients import global_mean_loss
from ..linen._testing import is_linen, linen_pair
from ..mesh import make_mesh
from ..nnx._constructor import built as _built
from ._arguments import Inputs, called, require_arguments, require_model
from ._harness import OPTIMIZERS, Comparison, check_equal
from ._nnx import NNXSharded, NNXTwin, initial_state
from ._precision import require_float64, widened
from ._precision import wide as _wide
from ._reference import Reference, fingerprint, identity

__all__ = ["check_sharded"]

_CALLER = "fsdp_tp.testing.check_sharded"


def check_sharded(
    model: Any,
    batch: tuple[Any, Any],
    loss: Callable[[Any, Any], jax.Array],
    mesh: Mesh | Mapping[str, int],
    rules=(),
    *,
    tp_rules=(),
    batch_axes: AxisNames | None = None,
    steps: int = 3,
    optimizers: Mapping[str, Callable[[], optax.GradientTransformation]] = OPTIMIZERS,
    check_vma: bool = True,
    float64: bool = True,
    seed: int = 0,
    rngs: Mapping[str, jax.Array] | None = None,
    sequence: SequenceSplit | None = None,
    reference: Reference | None = None,
) -> None:
    """Proves ``model`` laid out by ``rules`` and ``tp_rules`` on ``mesh`` equal to the unsharded
    model, or raises ``AssertionError`` naming the first leaf that differs (its path, both
    values, the largest difference). The checks: the init bit for bit; on ``batch`` (``(inputs,
    targets)``, split over ``batch_axes`` on dim 0) the outputs, ``loss(outputs, targets)`` (a
    mean over the rows) and the synced gradients; the parameters after ``steps`` steps of the
    first of ``optimizers`` (default SGD, then AdamW) and, at each step, every other one's update
    of the same gradients (one compiled step a side for them all). ``model``: a Linen module
    (the sharded one is ``fsdp_tp.shard_by_rules(type(model), rules, tp_rules=...)`` with its
    fields) or an NNX constructor ``make(rngs)`` (``fsdp_tp.nnx.shard_by_rules(make, rules,
    tp_rules=...)``).
    ``float64``: computed in float64 (floating inputs and every floating parameter cast, and
    an NNX layer's dtype, both models alike), where rounding is far below the tolerance; an
    operation that still computes narrower (an ``astype``, a Linen layer's own
    ``dtype=jnp.float32``) is named in a ``CheckPrecisionWarning``. A scalar output (a loss the
    model returns) is compared as the mean of the devices' values. ``rngs`` (``{"dropout":
    key}``): the streams the model draws from at its call, the same for both (the sharded model
    draws the twin's dropout masks): a Linen model's ``apply(..., rngs=rngs)``; an NNX model's
    ``model(x, rngs=nnx.Rngs(**rngs))``, anew for each call. An NNX model holding its own
    ``nnx.Rngs`` (``nnx.Dropout(rate, rngs=rngs)``) draws from them where no ``rngs`` is given:
    both models from the state ``make(nnx.Rngs(seed))`` holds, at every call (a stateless
    step's: the same draws each step).
    On a mesh with a ``context`` axis (or the axis of ``sequence``, a
    :class:`~fsdp_tp.context.SequenceSplit`: balanced by default, the ring's attention) the
    sequence is split too: dim 1 of every leaf of the batch and the outputs past a vector, laid
    out as ``shard_step`` lays it, the model's attention (:func:`~fsdp_tp.attention.attend`)
    computed across devices; positions and segment ids the model reads go in with the inputs.
    ``reference`` (a :class:`~fsdp_tp.testing.Reference`): the unsharded run computed once for
    every check given it with the same model, batch, loss, seed, steps, optimizers, ``float64``
    and ``rngs`` (the same objects: a new ``lambda`` is a new loss), whatever the mesh and rules.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from fsdp_tp.tp import ColumnParallel, RowParallel
    >>> class MLP(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(4, name="down")(nn.gelu(nn.Dense(16, name="up")(x)))
    >>> x, y = jnp.ones((8, 4)), jnp.zeros((8, 4))
    >>> check_sharded(MLP(), (x, y), lambda out, y: jnp.mean((out - y) ** 2), {"data": 2, "tensor": 4},
    ...               tp_rules=[("up$", ColumnParallel()), ("down$", RowParallel())], steps=1)
    """
    require_model(model)
    require_arguments(
        batch=batch, mesh=mesh, steps=steps, optimizers=optimizers, rngs=rngs, batch_axes=batch_axes
    )
    mesh = make_mesh(dict(mesh)) if isinstance(mesh, Mapping) else mesh
    defaults = tuple(a for a in DEFAULT_BATCH_AXES if a in mesh.shape)
    axes = as_axis_tuple(batch_axes) if batch_axes is not None else defaults
    x, y = batch
    split = _split_of(sequence, mesh)
    _require_splittable(x, y, mesh, axes, split)
    step_axes = (*axes, split.axis) if split is not None else axes
    with jax.enable_x64(float64):
        x, y = (jax.tree.map(_wide, t) for t in (x, y)) if float64 else (x, y)
        call = _streams(model, rngs)
        built = _pair(model, rules, tp_rules, step_axes, x, seed, float64)
        sharded, twin = (_Called(m, call, rngs or {}, float64) for m in built)
        shapes, weighted = _require_scalar_loss(twin, loss, x, y, seed, float64)
        shards = int(np.prod([mesh.shape[a] for a in axes]))
        tokens = mesh.shape[split.axis] if split is not None else 1
        per_device = lambda m, p, x, y: loss(_whole(m.apply({"params": p}, x), shapes, shards, tokens), y)
        unsharded = lambda m, p, x, y: loss(m.apply({"params": p}, x), y)
        if weighted:  # ((sum, weight): the whole batch's sum over its weight, on every split)
            per_device = _weighted(
                per_device, lambda total, weight: global_mean_loss(total, weight, step_axes)
            )
            unsharded = _weighted(unsharded, lambda total, weight: total / weight)
        reduction = WEIGHTED if weighted else AVERAGED
        pair = Comparison(
            sharded,
            twin,
            mesh,
            axes,
            per_device,
            unsharded,
            check_vma=check_vma,
            sequence=split,
            reduction=reduction,
        )
        key = (identity(model), identity(loss), seed, float64, fingerprint(rngs) if rngs else None)
        try:
            check_equal(
                pair, [(x, y)] * steps, jax.random.key(seed), optimizers, reference=reference, key=key
            )
        except RuleError as err:  # (the step check's: here the loss is the user's, the step ours)
            if getattr(err, "kind", "") == PARTIAL_SUM_READ and not weighted:
                err.args = (f"{err.args[0]} {_RATIO_FIX}", *err.args[1:])
            raise


# How check_sharded reduces the devices' losses, as a failure on the loss names it.
AVERAGED = "the devices' losses averaged (pmean): right for a mean over equal counts"
WEIGHTED = "the token-weighted mean: every device's sum over every device's weight"
_RATIO_FIX = (
    "In check_sharded, return the loss as (sum, weight), e.g. lambda out, y: ((ce(out, y) * w).sum(), "
    "w.sum()): the check divides the whole batch's sum by its weight, sharded (global_mean_loss) and "
    "unsharded alike."
)


def _weighted(loss: Callable, reduce: Callable) -> Callable:
    """``loss`` returning ``(sum, weight)``, reduced to one value by ``reduce``."""
    return lambda m, p, x, y: reduce(*loss(m, p, x, y))


@dataclasses.dataclass(frozen=True)
class _Called:
    """A model (sharded or the twin) called with the run's rng streams: at init (a Linen
    model's dropout draws there too) and at each call."""

    model: Any
    call: Callable[[], dict]
    streams: Mapping[str, jax.Array]
    float64: bool

    def init(self, rng, x):
        linen = is_linen(self.model)
        variables = called(
            self.model.init, x, {"params": rng, **self.streams} if linen and self.streams else rng
        )
        # float64 reaches every layer through its parameters: a layer left at flax's default
        # param_dtype=float32 (dtype=None) computes in the promoted dtype of its inputs and
        # parameters, so a token model's first layer would keep the whole model in float32.
        return jax.tree.map(_wide, variables) if self.float64 else variables

    def apply(self, variables, x):
        if is_linen(self.model):  # (an NNX model's face unpacks the inputs itself)
            return called(self.model.apply, x, variables, **self.call())
        return self.model.apply(variables, x, **self.call())


def _streams(model, rngs) -> Callable[[], dict]:
    """The keyword arguments of each call of the model: its rng streams, anew each time."""
    if not rngs:
        return dict
    if is_linen(model):
        return lambda: {"rngs": dict(rngs)}
    return lambda: {"rngs": nnx.Rngs(**rngs)}


def _pair(model, rules, tp_rules, axes, x, seed: int, float64: bool) -> tuple[Any, Any]:
    """The sharded model (Linen-faced, per device) and its twin, from the user's model."""
    if is_linen(model):
        return linen_pair(model, rules, tp_rules, axes)
    if isinstance(model, nnx.Module) or not callable(model):
        raise TypeError(
            f"{_CALLER}: model is a Linen module or an NNX constructor make(rngs); got "
            f"{type(model).__name__}. For an NNX model pass lambda rngs: Model(..., rngs=rngs)."
        )
    _require_seeded(model)
    model = widened(model) if float64 else model
    auto: dict[str, Any] = {"inputs": (x,)} if isinstance(tp_rules, str) and tp_rules == "auto" else {}
    state = initial_state(model, seed)  # (one build of its other Variables, for both)
    sharded = NNXSharded(model, rules, model_state=state, batch_axes=axes, tp_rules=tp_rules, **auto)
    return sharded, NNXTwin(model, model_state=state)


def _split_of(sequence: SequenceSplit | None, mesh: Mesh) -> SequenceSplit | None:
    """The sequence split the check runs: ``sequence`` (its axis the mesh's), else the default
    one where the mesh has a ``context`` axis."""
    if sequence is None:
        return SequenceSplit() if CONTEXT in mesh.shape else None
    if not isinstance(sequence, SequenceSplit) or sequence.axis not in mesh.shape:
        raise ValueError(
            f"{_CALLER}: sequence={sequence!r}; pass a fsdp_tp.context.SequenceSplit over an axis of "
            f"the mesh {dict(mesh.shape)}, e.g. SequenceSplit(axis={CONTEXT!r}) with a {CONTEXT!r} axis "
            f"in the mesh."
        )
    return sequence


def _require_splittable(x, y, mesh: Mesh, axes: tuple, split: SequenceSplit | None) -> None:
    n = int(np.prod([mesh.shape[a] for a in axes]))
    for name, tree in (("inputs", x), ("targets", y)):
        for leaf in jax.tree.leaves(tree):
            rows = np.shape(leaf)[0] if np.ndim(leaf) else None
            if rows is None or rows % n:
                raise ValueError(
                    f"{_CALLER}: the batch's {name} have {rows} rows (shape {np.shape(leaf)}), which the "
                    f"batch axes {axes} (sizes {[mesh.shape[a] for a in axes]}: {n} shards) do not split "
                    f"evenly; pass a batch of a multiple of {n} rows."
                )
            if split is not None and np.ndim(leaf) > 1:
                split.require_divides(np.shape(leaf)[1], mesh.shape[split.axis], f"{_CALLER} ({name})")


def _require_scalar_loss(twin, loss, x, y, seed: int, float64: bool) -> tuple[list[tuple[int, ...]], bool]:
    """The twin's output shapes, once its loss is known to be a scalar or a ``(sum, weight)``
    pair of scalars (the second result: which), and, under ``float64``, a warning where an
    operation of its computes narrower."""
    try:
        params = jax.eval_shape(lambda: twin.init(jax.random.key(seed), x)["params"])
        applied = lambda p: (out := twin.apply({"params": p}, x), loss(out, y))
        jaxpr, (outputs, value) = jax.make_jaxpr(applied, return_shape=True)(params)  # (one trace for all)
    except TypeError as err:
        if isinstance(x, Inputs):
            raise
        raise TypeError(
            f"{_CALLER}: the unsharded model called on the batch's inputs raised TypeError: {err}. The "
            f"check calls model(inputs), the inputs one argument (a pytree); a model of several takes "
            f"them as fsdp_tp.testing.Inputs(tokens, positions, mask=...): batch=(Inputs(...), targets)."
        ) from err
    weighted = isinstance(value, tuple) and len(value) == 2 and all(np.shape(v) == () for v in value)
    if not weighted and (isinstance(value, tuple) or np.shape(value) != ()):
        got = f"a tuple of {len(value)}" if isinstance(value, tuple) else f"shape {np.shape(value)}"
        raise ValueError(
            f"{_CALLER}: loss(outputs, targets) returns {got}; the check needs the batch's mean loss, a "
            f"scalar (reduce it, e.g. lambda out, y: jnp.mean(...)), or a token-weighted loss as "
            f"(sum, weight), two scalars."
        )
    if float64:
        require_float64(jaxpr, _CALLER)
    return [tuple(leaf.shape) for leaf in jax.tree.leaves(outputs)], weighted


def _whole(outputs, shapes: list[tuple[int, ...]], shards: int, tokens: int = 1):
    """``outputs`` (one device's), refused where a leaf is left split beyond its rows, which
    the batch axes split ``shards`` ways, and its sequence (dim 1), split ``tokens`` ways (a
    last ColumnParallel without ``gather_output``, whose logits only a vocabulary-parallel loss
    reads): ``loss`` is the twin's, of whole outputs. Not in the step check's own traces,
    one of which runs the step on the whole batch (:mod:`fsdp_tp._check.step`)."""
    if not checking():
        return outputs
    for leaf, shape in zip(jax.tree.leaves(outputs), shapes, strict=True):
        rows = (shape[0] // shards, *shape[1:]) if shape else shape
        if len(rows) > 1 and tokens > 1:
            rows = (rows[0], rows[1] // tokens, *rows[2:])
        if tuple(np.shape(leaf)) != rows:
            raise ValueError(
                f"{_CALLER}: the sharded model's output has shape {tuple(np.shape(leaf))} on each device, "
                f"where the unsharded model's {shape} with its rows split over the batch axes is {rows}: "
                f"it is left split over a tp axis (a last ColumnParallel without gather_output, whose "
                f"logits only a vocabulary-parallel loss reads), and the loss, as the twin's, reads whole "
                f"outputs. Prove the model with its output whole: give its last ColumnParallel "
                f"gather_output=True."
            )
    return outputs


def _require_seeded(make) -> None:
    """The twin and the sharded model are built by ``make`` from the same rngs: two traces of it
    must make the same program and constants (a constructor drawing from an rng of its own,
    ``np.random`` or a key from the clock, does not)."""
    build = lambda: nnx.state(_built(make, 0), nnx.Param)
    # (two functions: JAX keeps the trace of one function and would not run it again)
    first, second = jax.make_jaxpr(lambda: build())(), jax.make_jaxpr(lambda: build())()
    same = str(first) == str(second) and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first.consts, second.consts, strict=True)
    )
    if not same:
        raise ValueError(
            f"{_CALLER}: make(nnx.Rngs(0)) built different parameters twice: it draws from an rng of "
            f"its own (numpy's, or a key it makes), so no twin can be built. Draw every parameter from "
            f"the rngs passed in."
        )

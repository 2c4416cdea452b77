"""``shard_by_rules`` for Flax NNX: a model built by the user's constructor, stored by rules,
gathered where it is read.

The NNX front end is a thin layer over the core. The model's constructor runs once
abstractly (``nnx.eval_shape``) to learn every parameter's path, shape and sharding
annotation; the core's rule grammar (:mod:`fsdp_tp.rules`) gives each its spec. The
per-device init runs the constructor and keeps each device's block
(:func:`fsdp_tp._layout.block_of`, boxed as flax's ``Partitioned``, which the core reads),
so ``fsdp_tp.init_sharded`` builds the state; ``merge`` rebuilds the model inside the step
from the blocks, with Variables that gather on read (:mod:`fsdp_tp.nnx._read`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from .._axes import bound_axis_names
from .._batch import checked_batch_axes, resolve_batch_axes
from .._layout import check_fit
from .._optimizer import checked_tx
from .._sequence_split import sequence_split
from .._types import AxisNames
from ..dropout import split_after
from ..errors import warn
from ..precision import MixedPrecision, checked_policy
from ..rules import REPLICATED, Rules, as_spec, compile_rules, unmatched_warning
from ..train import TrainState
from ._check import PlanChecks, checked_class
from ._constructor import CALLER, built, require_constructor, scan_errors_named
from ._dropout import exact_dropouts
from ._layers import path_text
from ._specs import Placements, storage_specs
from ._state import (
    Path,
    flat_tree,
    model_state_of,
    nest,
    other_variables,
    param_variables,
    split_model,
    stored_block,
)
from ._tp import compute_roles

__all__ = ["ShardedModel", "shard_by_rules"]


class ShardedModel:
    """An NNX model's layout by rules, and the per-device pieces of a sharded run: the
    state (:meth:`state_init_fn`, for :func:`fsdp_tp.init_sharded`) and the model rebuilt
    from it inside the step (:meth:`merge`). Made by :func:`shard_by_rules`."""

    def __init__(
        self,
        make_model,
        rules,
        tp_rules,
        default,
        batch_axes,
        logical_axis_rules,
        precision=None,
        inputs=None,
    ):
        require_constructor(make_model)
        self._make = make_model
        self.precision = precision
        self._rules = compile_rules(rules, CALLER)
        self.batch_axes = checked_batch_axes(batch_axes, CALLER)
        abstract = nnx.eval_shape(lambda: built(make_model))
        self.graphdef, params, rest = split_model(abstract)
        self._params = list(nnx.to_flat_state(params))
        self._rest = list(nnx.to_flat_state(rest))
        paths = [path_text(path) for path, _ in self._params]
        storage, used = storage_specs(self._params, self._rules, default, logical_axis_rules)
        if warning := unmatched_warning(self._rules, used, paths, CALLER):
            warn(warning)
        self._checks = PlanChecks(self, inputs)
        self._layouts = Placements(abstract, storage, tp_rules, inputs, CALLER, self._checks.attempt)

    @property
    def specs(self) -> dict[Path, PartitionSpec]:
        """Each parameter's storage spec (with its role's split), by path."""
        return self._layouts().specs

    @property
    def tp_plans(self) -> dict:
        """``tp_rules="auto"``: the plan found (:class:`~fsdp_tp.tp.auto.TPPlan`) for each
        ``tensor`` size met, by size (found at init, under the mesh)."""
        return self._layouts.plans

    # -- the state -----------------------------------------------------------------------

    def init(self, rng: jax.Array, *extra) -> tuple[dict, dict]:
        """Per device (under ``jax.shard_map``): ``(params, model_state)`` of the model the
        constructor builds from ``nnx.Rngs(rng)``, each parameter this device's block of
        the full value (boxed with its split), so gathered it is the unsharded init."""
        _rng_alone(extra, "init")
        model = built(self._make, rng)
        _, params, rest = split_model(model)
        values = {path: variable.get_raw_value() for path, variable in nnx.to_flat_state(params)}
        layout = self._layouts()
        layout.roles.require_divides()
        sizes = {axis: jax.lax.axis_size(axis) for axis in bound_axis_names()}
        shapes = ((path_text(p), values[p].shape, s) for p, s in layout.specs.items())
        check_fit(shapes, sizes, "change the rule")
        stored = nest((p, stored_block(values[p], spec)) for p, spec in layout.specs.items())
        model_state = model_state_of(rest)
        self._checks.at_init(stored, model_state)  # (with inputs=: the plan checked here, before any step)
        return stored, model_state

    def state_init_fn(self, tx) -> Callable[[jax.Array], TrainState]:
        """``init_fn(rng)`` for :func:`fsdp_tp.init_sharded`: a :class:`~fsdp_tp.TrainState` of
        the blocks, the other Variables as ``model_state``, the optimizer ``tx`` and ``rng``."""

        checked_tx(tx, f"{CALLER}(...).state_init_fn")

        def init_fn(rng, *extra):
            _rng_alone(extra, "state_init_fn(tx)")
            params, model_state = self.init(rng)
            return TrainState.create(apply_fn=None, params=params, tx=tx, rng=rng, model_state=model_state)

        return init_fn

    # -- inside the step -----------------------------------------------------------------

    def merge(self, params: dict, model_state: dict | None = None) -> nnx.Module:
        """Per device: the model, holding this device's blocks, each gathered where the model
        reads it. Differentiate through it with respect to ``params`` (the gathers
        reduce-scatter the gradients). Its ``nnx.Dropout`` draws this device's block of the
        unsharded mask (:mod:`fsdp_tp.nnx._dropout`); other reads of an rng key are folded
        over the batch axes, so each batch shard draws its own values."""
        if not bound_axis_names():
            raise ValueError(
                f"{CALLER}(...).merge: called outside jax.shard_map; merge builds one device's model "
                f"from its blocks inside the step. Outside it, read the global parameters into an "
                f"unsharded model: nnx.update(model, nnx.State(jax.tree.map(lambda b: b.value, "
                f"params, is_leaf=lambda b: hasattr(b, 'names'))))."
            )
        flat, layout = flat_tree(params), self._layouts()
        if lacking := [path_text(p) for p, _ in self._params if p not in flat]:
            raise ValueError(
                f"{CALLER}(...).merge: the params given lack {len(lacking)} of the model's "
                f"{len(self._params)} parameters ({', '.join(lacking[:4])}{', ...' * (len(lacking) > 4)}): "
                f"pass the whole tree init_sharded made (state.params), every layer in it."
            )
        batch_axes = resolve_batch_axes(self.batch_axes, CALLER)
        batch = frozenset(batch_axes)
        variables = param_variables(self._params, flat, layout, batch, self.precision)
        rest = other_variables(self._rest, model_state, batch_axes, CALLER)
        model = nnx.merge(self.graphdef, nnx.from_flat_state(variables), nnx.from_flat_state(rest))
        compute_roles(model, layout.roles)
        exact_dropouts(model, batch_axes, path_text)
        split_after({})  # the model starts whole, whatever an earlier trace's roles left
        if layout.first_split:
            scan_errors_named(model, layout.first_split)
        # its first call on inputs of a shape checks the plan (and a sequence split) against the model
        if layout.roles.roles or sequence_split() is not None:
            checked_class(model, self._checks)
        return model

    def model_state(self, model: nnx.Module) -> dict:
        """The model's Variables other than parameters, as :meth:`init` lays them out: what a
        step returns as its third output (after averaging what differs across devices).
        Rng keys come back as stored (folded only where read); the draws advance the counts."""
        return model_state_of(split_model(model)[2])


def _rng_alone(extra: tuple, fn: str) -> None:
    """``sharded.<fn>`` given more than the rng by ``init_sharded`` (a Linen init takes the batch
    too; an NNX constructor needs none): named, with the call that works."""
    if extra:
        raise TypeError(
            f"{CALLER}(...).{fn} is called with the rng alone, and init_sharded passed {len(extra)} "
            f"more argument(s): the model's constructor needs no inputs. Pass "
            f"init_sharded(sharded.{fn}, mesh, P(), rng)."
        )


def shard_by_rules(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    rules: Rules = (),
    *,
    tp_rules=(),
    batch_axes: AxisNames | None = None,
    default: PartitionSpec | Sequence = REPLICATED,
    logical_axis_rules=None,
    mixed_precision: MixedPrecision | None = None,
    inputs: tuple | None = None,
) -> ShardedModel:
    """Lays an NNX model's parameters out by partition rules; every parameter is stored as
    this device's block and gathered where the model reads it.

    ``make_model(rngs)`` builds the model (``lambda rngs: Model(cfg, rngs=rngs)``). ``rules``:
    ``(pattern, spec)`` pairs searched in each parameter's path in ``nnx.state(model)``
    (``"blocks/up/kernel"``), first match wins, as for Linen (:mod:`fsdp_tp.rules`); a
    parameter no rule matches follows its own annotation (``nnx.with_partitioning`` /
    ``out_sharding``: mesh axes, or logical names mapped by ``logical_axis_rules``), else
    ``default``. ``batch_axes``: the mesh axes the batch is split over (a gather over one
    reduce-scatters the mean gradient); left out, the step's (:func:`~fsdp_tp.shard_step`'s
    ``batch_specs``), else those of ``("data", "fsdp")`` the mesh has; given, they must be the
    step's (a :class:`~fsdp_tp.errors.BatchAxesError` says when they are not).
    ``mixed_precision`` (a :class:`~fsdp_tp.MixedPrecision`): every floating parameter is read
    rounded to its ``gather_dtype`` and gathered in it, its gradient reduce-scattered in its
    ``reduce_dtype``, as for Linen: the numbers of the unsharded model computing on
    ``policy.round(params)``. ``tp_rules``: ``(pattern, role)`` pairs naming the modules that
    compute on their slices (:mod:`fsdp_tp.tp`), or the plan :func:`~fsdp_tp.nnx.find_tp_rules`
    finds from what the model computes, or ``"auto"``: that plan found here, from the model's
    call traced once on ``inputs`` (its positional arguments, arrays or
    ``jax.ShapeDtypeStruct``), over mesh axis ``tensor`` for its size under the mesh (read it as
    ``.tp_plans[size]``). With explicit ``tp_rules``, ``inputs=`` checks the plan against what
    each device computes at init (else at the merged model's first call in the step).

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> sharded = shard_by_rules(lambda rngs: nnx.Linear(8, 16, rngs=rngs), [("kernel$", P("fsdp"))])
    >>> state, specs = init_sharded(sharded.state_init_fn(optax.sgd(0.1)), mesh, P(), jax.random.key(0))
    >>> specs.params["kernel"], state.params["kernel"].value.shape
    (P('fsdp', None), (8, 16))
    """
    default = as_spec(default, CALLER, "default=")
    precision = checked_policy(mixed_precision, CALLER)
    return ShardedModel(
        make_model, rules, tp_rules, default, batch_axes, logical_axis_rules, precision, inputs
    )

"""``tensor_parallel``: split the parameters of any Flax module over a mesh axis by rules.

The wrapped module computes on this device's slices of its parameters, so a
``Dense`` whose kernel is split on the output dim yields this device's slice of
the features: column-parallel compute with the module's own code. Init stays
that of the unsplit module, bit for bit: the full parameter is initialized from
the module's rng and sliced (as in :func:`~fsdp_tp.linen.layers.split_param`).

The transform splits parameters only. The collectives around the module are
the caller's: :func:`~fsdp_tp.collectives.copy_to_axis` on a replicated input (its
gradient is summed over the axis), :func:`~fsdp_tp.collectives.gather_from_axis` on a
split output, :func:`~fsdp_tp.collectives.reduce_from_axis` on partial sums.
:class:`~fsdp_tp.ColumnParallelDense` and :class:`~fsdp_tp.RowParallelDense`
do that wiring for ``Dense``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._axes import axes_named, require_axes
from .._layout import check_fit, sliced_init
from .._tree import module_path
from .._types import AxisName
from ..errors import IndivisibleShapeError, RuleError
from ..rules import split_rule
from ._gather import param_boxed
from ._transform import check_module_class, keep_module_name

__all__ = ["tensor_parallel"]


@dataclass(frozen=True)
class _Rule:
    pattern: str
    regex: re.Pattern
    dims: tuple[int, ...]


def _compile(rules, caller: str) -> tuple[_Rule, ...]:
    compiled = []
    for rule in rules:
        pattern, regex, dims = split_rule(rule, caller, "(pattern, dims) pair, e.g. ('kernel', -1)")
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        if not dims or not all(isinstance(d, int) for d in dims):
            raise RuleError(
                f"{caller}: rule {pattern!r} -> {rule[1]!r}: give a dim (int) or a tuple of dims."
            )
        compiled.append(_Rule(pattern, regex, dims))
    return tuple(compiled)


def _resolve(rule: _Rule, path: str, shape: tuple[int, ...], axis: AxisName) -> tuple[int, ...]:
    """The rule's dims as non-negative indices into ``shape``; each named once."""
    ndim = len(shape)
    bad = [d for d in rule.dims if not -ndim <= d < ndim]
    if bad:
        raise RuleError(
            f"tensor_parallel: rule {rule.pattern!r} names dim {bad[0]} of parameter {path}, which has shape "
            f"{shape} ({ndim} dims); name a dim in {-ndim}..{ndim - 1}."
        )
    dims = tuple(d % ndim for d in rule.dims)
    if len(dims) > 1:
        raise RuleError(
            f"tensor_parallel: rule {rule.pattern!r} splits parameter {path} (shape {shape}) on dims "
            f"{rule.dims} over the one mesh axis {axis!r}: an axis can split one dim of a parameter. "
            f"Split the other dim over another axis (e.g. shard_module_params over 'fsdp')."
        )
    return dims


def tensor_parallel(
    target, axis_name: str, rules: Sequence[tuple[str, int | Sequence[int]]], split_input=False
):
    """Wraps a Flax module class so the parameters ``rules`` name are split over ``axis_name``.

    ``rules``: ``(pattern, dim)`` pairs, first match wins; ``pattern`` is a
    regular expression searched in the parameter's full path, as every rule of the
    library is (:mod:`fsdp_tp.rules`): ``"kernel$"`` matches ``"mlp/up/kernel"``
    (only parameters the module declares itself are split), ``dim`` the dim split over
    the axis (negative counts from the end).
    Unmatched parameters stay whole on every device. Every rule must match a
    parameter the module creates.

    ``split_input``: the module's input arrives split on the dims that size
    the split parameter dims (a row-parallel ``Dense`` sees its slice of the
    features), so the shapes it asks for are already this device's; the full
    shape for init is that times the axis size. Otherwise the requested
    shapes are the full ones.

    The module's code runs unchanged on the slices, so it must take their
    sizes from the parameters themselves: ``Dense``, ``Conv``, ``Embed`` and
    ``DenseGeneral``'s kernel do; ``DenseGeneral``'s bias is reshaped to the
    full ``features`` (a clear error says so; use ``use_bias=False``).

    Composes with :func:`~fsdp_tp.shard_module_params` over another axis
    (which picks another dim), and keeps ``target``'s parameter tree, name and
    init, so unsharded parameters load unchanged.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import init_sharded, make_mesh
    >>> mesh = make_mesh({"data": 2, "tensor": 4})
    >>> Column = tensor_parallel(nn.Dense, "tensor", [("kernel", -1), ("bias", 0)])
    >>> _, specs = init_sharded(lambda r, x: Column(16).init(r, x)["params"], mesh, (P(), P()),
    ...                         jax.random.key(0), jnp.ones((2, 8)))
    >>> specs
    {'bias': P('tensor',), 'kernel': P(None, 'tensor')}
    """
    caller = f"tensor_parallel({getattr(target, '__name__', target)!s})"
    check_module_class(target, "tensor_parallel")
    compiled = _compile(rules, caller)
    if not compiled:
        raise RuleError(f"{caller}: no rules; name at least one parameter to split, e.g. ('kernel', -1).")

    class Split(target):  # type: ignore[valid-type, misc]
        def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
            path = module_path(self.path, name)
            rule = next((r for r in compiled if r.regex.search(path)), None)
            if rule is None:
                return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
            (axis,) = require_axes(axis_name, caller)
            init_fn, init_args = _full_size_init(init_fn, init_args, rule, path, axis, split_input)
            create = super().param
            boxed = param_boxed(
                self, name, lambda: create(name, init_fn, *init_args, unbox=False, **init_kwargs)
            )
            return boxed.value if unbox and isinstance(boxed, nn.Partitioned) else boxed

        def __call__(self, *args, **kwargs):
            try:
                out = super().__call__(*args, **kwargs)
                if self.is_initializing():
                    _require_all_matched(compiled, self)
            except (TypeError, ValueError) as err:
                if isinstance(err, RuleError | IndivisibleShapeError):
                    raise
                if self.is_initializing():  # a rule that matched nothing is the likelier cause
                    _require_all_matched(compiled, self)
                raise RuleError(
                    f"{caller}: the module failed computing on its local parameter slices ({err}). Its "
                    f"code may size a split parameter from its attributes (nn.DenseGeneral reshapes its "
                    f"bias to the full `features`); split only parameters it uses by their own shape, "
                    f"e.g. the kernel with use_bias=False."
                ) from err
            return out

    return keep_module_name(Split, target)


def _full_size_init(init_fn, init_args, rule: _Rule, path: str, axis: AxisName, split_input: bool):
    """An init that computes the full parameter, then keeps this device's slice, boxed."""
    size = jax.lax.axis_size(axis)
    if split_input:
        shape = init_args[0] if init_args else None
        if not (isinstance(shape, tuple) and all(isinstance(n, int | np.integer) for n in shape)):
            raise RuleError(
                f"tensor_parallel: split_input=True needs the parameter's shape as the first init argument "
                f"(flax's initializer convention); {path} was declared with {init_args!r}."
            )
        dims = _resolve(rule, path, shape, axis)
        init_args = (tuple(n * size if d in dims else n for d, n in enumerate(shape)), *init_args[1:])

    def spec_of(shape: tuple, names: tuple) -> PartitionSpec:
        (dim,) = _resolve(rule, path, shape, axis)
        if axis in axes_named(names):
            raise RuleError(
                f"tensor_parallel: parameter {path} is already split over {axis!r} (names {names}); "
                f"an axis can split one dim of a parameter. Wrap the module once per axis."
            )
        if names[dim] is not None:
            raise RuleError(
                f"tensor_parallel: dim {dim} of parameter {path} is already split over {names[dim]!r}; "
                f"split another dim over {axis!r}."
            )
        spec = PartitionSpec(*(axis if d == dim else None for d in range(len(shape))))
        check_fit([(path, shape, spec)], {axis: size}, f"use a smaller {axis!r} axis")
        return spec

    return sliced_init(init_fn, spec_of), init_args


def _require_all_matched(rules: tuple[_Rule, ...], module: nn.Module) -> None:
    created = list(module.variables.get("params", {}))
    paths = [module_path(module.path, name) for name in created]
    caller = f"tensor_parallel({type(module).__name__})"
    for rule in rules:
        if not any(rule.regex.search(path) for path in paths):
            where = module_path(module.path) or type(module).__name__
            raise RuleError(
                f"{caller}: rule {rule.pattern!r} matches no parameter of {where} (its parameters: "
                f"{', '.join(sorted(set(created))) or 'none'}); fix the pattern or drop the rule."
            )

"""A module's own call with its raw expert kernels on this device's experts: the all-to-alls
placed between its operations, where its einsums read the kernels (:func:`experts_call`).

A mixture of experts written in one ``__call__`` (MaxText's and DeepSeek's layout) routes its
tokens, dispatches them into buffers ``(groups, E, capacity, d)``, runs them through raw
kernels ``(E, d, h)`` and combines the results, all inside the module. A role runs around a
module's call, so it cannot put the all-to-all between the dispatch and the first expert
einsum. Here the call is traced once (abstractly, each expert kernel read at its full size as
the gather of this device's block, which is never run) and re-run operation by operation on
this device's values, each value either as the model computed it (*whole*) or laid out on the
experts' devices (:class:`Place`: a ``1/n`` of its experts dim, ``n`` times its rows):

- an einsum (``dot_general``) batching over a kernel's experts dim takes the kernel's block
  and its other operand sent to the experts' devices (``all_to_all``: split on the experts,
  concatenated on the operand's first free dim, the rows), once per value however many
  einsums read it; its result stays there;
- an elementwise operation (a ``jax.nn.silu`` between the gate and up einsums, even a jitted or
  custom-derivative one) of values laid out alike computes there;
- anything else that reads a value laid out so (the combine einsum, a reshape, a norm) gets it
  back first (the inverse ``all_to_all``), as do the module's outputs.

So the tokens go to their experts once and come back once, and the expert weights are never
gathered. The gradient a device's experts get is the sum over every device's tokens: it is
scaled by ``1/n`` (the loss is their mean), as for the einsum role
(:class:`~fsdp_tp.tp.ExpertParallel`). A kernel read otherwise (its experts dim contracted, a
weight norm) is refused with the op and the fix.

With each expert's hidden dim split over another axis too (``within``, a
:class:`~fsdp_tp.tp.Region`), a buffer a column einsum reads enters through *f* once and the
row einsum's parts are summed before they go back. A dropout between the einsums draws its
mask on this device's rows, whole, and the mask goes with them (refused when split twice: which
dims are the hidden blocks, it cannot tell). Each operation is made again at the model's line
(:mod:`fsdp_tp._trace.rebind`).

Long because the re-run is one class: its rules (a kernel's read and an expert einsum, keyed by
primitive in :data:`_RULES` as JAX's own interpreters keep theirs; then an elementwise operation,
anything else) read and write the same places of the same values.

>>> import functools, jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> from fsdp_tp import make_mesh
>>> mesh = make_mesh({"expert": 4}, devices=jax.devices()[:4])
>>> def bank(x, w):  # buffers (groups, E, capacity, d), kernels (E, d, h)
...     return jax.nn.relu(jnp.einsum("gecd,edh->gech", x, w)).sum(-1)
>>> x, w = jnp.ones((4, 8, 2, 3)), jnp.arange(8 * 3 * 5.0).reshape(8, 3, 5)
>>> @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=P("expert"))
... def split(x, w):
...     read = gathered_read("expert", -3, "w")
...     return experts_call(lambda x: bank(x, read(w)), (x,), {}, "expert", "moe")
>>> bool(jnp.allclose(split(x, w), bank(x, w)))
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import numpy as np

from .._trace.rebind import bind, body, elementwise, line, vma
from .._trace.relations import ELEMENTWISE
from ..collectives import copy_to_axis, reduce_from_axis
from ..dropout import unplaceable_within
from ..errors import RuleError

__all__ = ["Place", "cotangent_times", "experts_call", "gathered_read"]

_MARK = "fsdp_tp_expert_kernel"
# Why a dropout is refused inside raw experts split twice, and its fix
_SPLIT_TWICE = (
    "the code of a module whose raw expert kernels ExpertParallel(dims=..., within=Region(...)) "
    "splits twice, each expert's hidden dim on its Region's axis as its kernels' dims say, which "
    "the dropout cannot tell apart (dropout there: drop within=, the experts alone on their axis, "
    "where its mask is drawn on this device's rows and sent with them)"
)
# Elementwise operations that a part of a sum may go through (the sum of their results is theirs).
_LINEAR = frozenset({"convert_element_type", "copy", "copy_p", "neg", "pvary", "pcast"})


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a value is laid out on the experts' devices: ``experts``, the dim holding this
    device's experts (``1/n`` of them); ``rows``, the dim every device's rows are concatenated
    on (``n`` times the rows), ``None`` for a kernel (this device's block, no rows). With each
    expert's hidden dim split over another axis too (``within``): ``hidden``, the dim of a
    kernel that is its block there; ``partial``, a value that is this device's part of a sum
    over that axis (an einsum contracted the hidden blocks)."""

    experts: int
    rows: int | None = None
    hidden: int | None = None
    partial: bool = False

    def permuted(self, order: tuple[int, ...]) -> Place:
        at = lambda dim: None if dim is None else order.index(dim)
        return Place(order.index(self.experts), at(self.rows), at(self.hidden), self.partial)


class _Ran(NamedTuple):
    """An operation re-run: its outputs' values and where each is laid out (``None``: whole)."""

    values: list
    places: list[Place | None]

    @staticmethod
    def whole(values: list) -> _Ran:
        return _Ran(values, [None] * len(values))


class _Sent(NamedTuple):
    """A value sent to the experts' devices (kept with it, so its id, the key, is not reused),
    what arrived there, and that through *f* over the hidden dims' axis once a column einsum
    read it (``None`` until then)."""

    value: Any
    moved: Any
    through_f: Any | None


class _Splat(NamedTuple):
    """A scalar broadcast, made again at a place's shape where it meets laid-out values."""

    scalar: Any
    dtype: Any


def gathered_read(axis: str, dim: int, name: str) -> Callable[[jax.Array], jax.Array]:
    """How a module reads expert kernel ``name`` (split on ``dim`` over ``axis``) inside
    :func:`experts_call`: at its full size, as the gather of this device's block, so the
    module's own code traces as written. :func:`experts_call` never runs the gather: the
    einsums reading it take the block."""

    def read(block: jax.Array) -> jax.Array:
        with jax.named_scope(f"{_MARK}:{name}"):
            return jax.lax.all_gather(block, axis, axis=dim % block.ndim, tiled=True)

    return read


def experts_call(run: Callable, args: tuple, kwargs: dict, axis: str, path: str, within=None) -> Any:
    """``run(*args, **kwargs)`` (a module's call whose expert kernels are read through
    :func:`gathered_read`) with its values on the experts' devices between the einsums over
    the kernels and what reads their results (see the module's docstring). ``within``: a
    :class:`~fsdp_tp.tp.Region` splitting each expert's hidden dim over its axis, Megatron's
    way on the experts' devices: a buffer a column einsum reads enters through *f* (once), and
    what the row einsum leaves partial is summed over that axis before it goes back."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array | jax.core.Tracer)]

    def traced(*values):
        given = list(leaves)
        for i, value in zip(arrays, values, strict=True):
            given[i] = value
        a, k = jax.tree.unflatten(tree, given)
        return run(*a, **k)

    # (each expert's hidden dim split too: which dims of an activation are, a dropout inside
    # cannot tell, so it is refused, as inside a Region; else a mask is drawn on this device's
    # rows, whole, and sent with them)
    with unplaceable_within(_SPLIT_TWICE) if within is not None else contextlib.nullcontext():
        closed, shape = jax.make_jaxpr(traced, return_shape=True)(*(leaves[i] for i in arrays))
    outs = _Rerun(axis, jax.lax.axis_size(axis), path, within).run(
        closed.jaxpr, closed.consts, [leaves[i] for i in arrays]
    )
    return jax.tree.unflatten(jax.tree.structure(shape), outs)


class _Rerun:
    """One re-run of a traced call: each value and, for those laid out on the experts' devices,
    its :class:`Place`."""

    def __init__(self, axis: str, n: int, path: str, within):
        self.axis, self.n, self.path = axis, n, path
        self.hidden = dict(within.dims) if within is not None else {}
        self.tensor = within.axis if within is not None else None
        self.sent: dict[tuple[int, int, int], _Sent] = {}  # (value id, experts dim, rows dim): sent once
        self.returned: dict[Any, Any] = {}
        self.places: dict[Any, Place] = {}
        self.kernels: dict[Any, str] = {}  # (the kernels' names, for the refusals)
        self.splats: dict[Any, _Splat] = {}

    def run(self, jaxpr, consts, args) -> list:
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        self._eqns(jaxpr.eqns, env)
        return [self._whole(var, env, "the module's output") for var in jaxpr.outvars]

    def _eqns(self, eqns, env: dict) -> None:
        for eqn in eqns:
            if eqn.primitive.name == "broadcast_in_dim" and np.shape(eqn.invars[0].aval) == ():
                scalar = self._read(eqn.invars[0], env)
                self.splats[eqn.outvars[0]] = _Splat(scalar, eqn.outvars[0].aval.dtype)
            outs, places = self._eqn(eqn, env)
            named = next(
                (self.kernels[v] for v in eqn.invars if self._place(v) is not None and v in self.kernels),
                None,
            )
            for var, value, place in zip(eqn.outvars, outs, places, strict=True):
                env[var] = value
                if place is not None:
                    self.places[var] = place
                if named is not None and place is not None and place.rows is None:  # (a cast, a transpose)
                    self.kernels.setdefault(var, named)

    def _read(self, atom, env):
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    def _place(self, atom) -> Place | None:
        return None if isinstance(atom, jcore.Literal) else self.places.get(atom)

    def _eqn(self, eqn, env) -> _Ran:
        """The operation re-run: by its primitive's rule (:data:`_RULES`) where it has one that
        applies, else on its values where they are laid out alike (:meth:`_elementwise`), else
        as the model computed it (:meth:`_as_computed`)."""
        places = [self._place(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        ran = rule(self, eqn, env, places) if rule is not None else None
        if ran is None and any(p is not None for p in places):
            laid = self._alike(eqn, places)
            if laid is not None:
                ran = self._elementwise(eqn, env, laid)
        return ran if ran is not None else self._as_computed(eqn, env)

    def _kernel_read(self, eqn, env, places) -> _Ran | None:
        """A kernel's read (the gather :func:`gathered_read` traced): this device's block, at
        its place; the gather never runs. ``None`` for any other all-gather."""
        marked = re.search(_MARK + r":([\w/.-]+)", str(eqn.source_info.name_stack))
        if not marked:
            return None
        name = self.kernels[eqn.outvars[0]] = marked.group(1)
        kernel = self._read(eqn.invars[0], env)
        hidden = self.hidden[name] % kernel.ndim if name in self.hidden else None
        return _Ran([kernel], [Place(eqn.params["all_gather_dimension"], hidden=hidden)])

    def _as_computed(self, eqn, env) -> _Ran:
        """The operation on whole values, as the model computed it."""
        ins = [self._whole(v, env, line(eqn)) for v in eqn.invars]
        if self.tensor is not None and eqn.primitive.name == "pvary":
            # (made where a value the trace typed varying over the hidden dims' axis, a part of
            # a sum there, met another: that value is summed now, so each operation's operands
            # are aligned where it is made, as JAX's tracing does, by bind)
            return _Ran(ins, [None])
        inner = body(eqn)
        if inner is not None and any(vma(x) != vma(v.aval) for x, v in zip(ins, eqn.invars, strict=True)):
            return self._inlined(eqn, inner, ins, env)
        return _Ran.whole(bind(eqn, ins))

    def _inlined(self, eqn, inner, ins: list, env: dict) -> _Ran:
        """A call whose operands are typed otherwise than its body was traced with (a value
        summed here that the trace typed as a part of a sum): its body run here, op by op; a
        custom derivative's body is not its derivative (``jax.nn.relu``'s at 0), so refused."""
        if eqn.primitive.name.startswith("custom_"):
            raise RuleError(
                f"{self.path} (ExpertParallel(dims=..., within=...)): {line(eqn)} is a function with a "
                f"custom derivative on the experts' output summed over {self.tensor!r}, which its "
                f"trace typed as a part of that sum; it cannot run as traced. Apply it inside the "
                f"experts (before the row einsum) or after the module, or drop within=."
            )
        consts = getattr(eqn.params.get("jaxpr"), "consts", ())
        env.update(zip(inner.constvars, consts, strict=True))
        env.update(zip(inner.invars, ins, strict=True))
        self._eqns(inner.eqns, env)
        return _Ran.whole([self._whole(v, env, line(eqn)) for v in inner.outvars])

    def _expert_einsum(self, eqn, env, places) -> _Ran | None:
        """An einsum reading a kernel's block: its experts dim must be one it batches over; the
        other operand goes to the experts' devices (or is there already). ``None`` for an
        einsum that reads no kernel's block."""
        if not any(p is not None and p.rows is None for p in places):
            return None
        (contract, batch) = eqn.params["dimension_numbers"]
        k = next(i for i, p in enumerate(places) if p is not None and p.rows is None)
        kernel, other = eqn.invars[k], eqn.invars[1 - k]
        experts = places[k].experts
        if experts not in batch[k] or (places[1 - k] is not None and places[1 - k].rows is None):
            raise RuleError(
                f"{self.path} (ExpertParallel(dims=...) over {self.axis!r}): {line(eqn)} reads the expert "
                f"kernel {self._name(kernel)} batched over no experts dim (as the 'e' of 'gecd,edh->gech' "
                f"is) or against another kernel; write it so, or leave the module whole."
            )
        i, there = batch[k].index(experts), places[1 - k]
        on, free = batch[1 - k][i], _free(other.aval.ndim, contract[1 - k], batch[1 - k])
        column = places[k].hidden is not None and places[k].hidden not in contract[k]
        if there is not None and there.experts == on:  # (already there: another einsum's result)
            rows, x = there.rows, self._read(other, env)
        elif free:
            rows, x = free[0], self._sent(other, env, on, free[0], copied=column)
        else:
            raise RuleError(
                f"{self.path} (ExpertParallel(dims=...) over {self.axis!r}): {line(eqn)} reads an expert "
                f"kernel with an operand {_shape(other)} that has no dim to carry the rows to the experts' "
                f"devices: dispatch the tokens into buffers (groups, E, capacity, d) first."
            )
        operands = [None, None]
        operands[k], operands[1 - k] = self._read(kernel, env), x
        (out,) = bind(eqn, operands)
        # (dot_general's result: batch dims, then the first operand's free dims, then the second's)
        n_batch = len(batch[0])
        first_free = _free(eqn.invars[0].aval.ndim, contract[0], batch[0])
        at = n_batch + (first_free.index(rows) if k == 1 else len(first_free) + free.index(rows))
        partial = places[k].hidden is not None and places[k].hidden in contract[k]
        return _Ran([out], [Place(i, at, partial=partial)])

    def _sent(self, var, env, experts: int, rows: int, copied: bool):
        """``var`` sent to the experts' devices along ``experts``, its rows on ``rows``, once
        per value (JAX's tracing may have retyped one value into several), through *f* over
        the hidden dims' axis where ``copied`` (a column einsum reads it)."""
        value = self._whole(var, env, "")
        key = (id(value), experts, rows)
        if key not in self.sent:
            moved = jax.lax.all_to_all(value, self.axis, experts, rows, tiled=True)
            self.sent[key] = _Sent(value, cotangent_times(moved, self.n), None)
        sent = self.sent[key]
        if copied and sent.through_f is None:
            sent = self.sent[key] = sent._replace(through_f=copy_to_axis(sent.moved, self.tensor))
        return sent.through_f if copied else sent.moved

    def _whole(self, atom, env, reader: str):
        """``atom``'s value as the model computed it: sent back from the experts' devices if it
        is laid out there (once); a kernel's block cannot be (its experts are on other devices)."""
        value, place = self._read(atom, env), self._place(atom)
        if place is None:
            return value
        if place.rows is None:
            raise RuleError(
                f"{self.path} (ExpertParallel(dims=...) over {self.axis!r}): {reader} reads the expert "
                f"kernel {self._name(atom)} other than through an einsum over its experts (each device "
                f"holds its own experts' block); read the kernel only in the experts' einsums, or leave "
                f"the module whole."
            )
        if atom not in self.returned:
            if place.partial:  # (the row einsum's parts, summed over the hidden dims' axis)
                value = reduce_from_axis(value, self.tensor)
            back = cotangent_times(value, 1 / self.n)
            self.returned[atom] = jax.lax.all_to_all(back, self.axis, place.rows, place.experts, tiled=True)
        return self.returned[atom]

    def _there(self, var, env, place: Place):
        """A whole operand of an elementwise operation on values at ``place``: a scalar's
        broadcast made there; anything else (a mask drawn on this device's rows) sent there."""
        assert place.rows is not None  # (_alike: a kernel's block has no whole operand beside it)
        if var in self.splats:
            splat = self.splats[var]
            local = list(var.aval.shape)
            local[place.experts] //= self.n
            local[place.rows] *= self.n
            return jax.lax.broadcast_in_dim(splat.scalar, tuple(local), ()).astype(splat.dtype)
        return self._sent(var, env, place.experts, place.rows, copied=False)

    def _name(self, kernel) -> str:
        return repr(self.kernels.get(kernel, _shape(kernel)))

    def _alike(self, eqn, places) -> Place | None:
        """The one place of an elementwise operation's values laid out on the experts' devices
        (the others scalars), or ``None`` where it cannot compute there."""
        laid = {p for p in places if p is not None}
        if len(laid) != 1:
            return None
        (place,) = laid
        if eqn.primitive.name == "transpose":
            return place.permuted(tuple(eqn.params["permutation"]))
        if place.partial and eqn.primitive.name not in _LINEAR:
            return None  # (a part of a sum: summed first, where it is whole)
        shapes = {v.aval.shape for v, p in zip(eqn.invars, places, strict=True) if p is not None}
        others = [v for v, p in zip(eqn.invars, places, strict=True) if p is None]
        if len(shapes) != 1 or any(v.aval.shape not in shapes for v in eqn.outvars):
            return None
        name = eqn.primitive.name
        if name in ELEMENTWISE and place.rows is not None and not place.partial:
            # (a whole operand of the same shape, a dropout mask drawn on this device's rows:
            # sent along with them, _elementwise)
            return place if all(np.shape(v.aval) == () or v.aval.shape in shapes for v in others) else None
        if any(np.shape(v.aval) != () for v in others):
            return None
        if name in ELEMENTWISE:
            return place
        inner = body(eqn)
        return place if place.rows is not None and inner is not None and elementwise(inner) else None

    def _elementwise(self, eqn, env, place: Place) -> _Ran:
        """An elementwise operation on this device's experts' values: a primitive as it is; a
        call (whose body is traced at the whole shape) on the values reshaped to that shape, as
        many elements in another order, which an elementwise body cannot tell apart."""
        ins = [self._read(v, env) for v in eqn.invars]
        if eqn.primitive.name in ELEMENTWISE or eqn.primitive.name == "transpose":
            for i, v in enumerate(eqn.invars):
                if self._place(v) is None and np.shape(v.aval) != ():
                    ins[i] = self._there(v, env, place)
            outs = bind(eqn, ins)
            return _Ran(outs, [place] * len(outs))
        local = next(x.shape for x, v in zip(ins, eqn.invars, strict=True) if self._place(v) is not None)
        wide = [
            x.reshape(v.aval.shape) if np.shape(x) == local else x
            for x, v in zip(ins, eqn.invars, strict=True)
        ]
        outs = [o.reshape(local) for o in bind(eqn, wide)]
        return _Ran(outs, [place] * len(outs))


# The rules by primitive (each ``None`` where it does not apply: the operation is then re-run as
# :meth:`_Rerun._eqn` says for any other).
_RULES: dict[str, Callable[[_Rerun, Any, dict, list], _Ran | None]] = {
    "all_gather": _Rerun._kernel_read,
    "dot_general": _Rerun._expert_einsum,
}


def _free(ndim: int, contract, batch) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def _shape(var) -> str:
    return str(tuple(var.aval.shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_times(x: jax.Array, factor: float) -> jax.Array:
    return x


cotangent_times.defvjp(lambda x, factor: (x, None), lambda factor, _, cotangent: (cotangent * factor,))

"""An operation of a traced jaxpr made again on other values (:func:`bind`), as
``jax.core.eval_jaxpr`` makes it: at the model's line, so the plan check reads it as the model's
and a refusal names that line (:func:`line`); its operands first made to vary over the same
mesh axes, as JAX's tracing makes them (a re-run may sum a value the trace had vary).
:func:`body` and :func:`elementwise` read the jaxpr a call runs (``jax.nn.silu`` is jitted,
``jax.nn.relu`` has a custom derivative) and whether it computes each position from the same
positions alone. Used by :mod:`fsdp_tp.tp._expert_call`, which re-runs a module's call.

>>> import jax, jax.numpy as jnp
>>> jaxpr = jax.make_jaxpr(lambda x: jax.nn.silu(x) * 2.0)(jnp.ones(3))
>>> [eqn.primitive.name for eqn in jaxpr.eqns], elementwise(jaxpr.jaxpr)
(['jit', 'mul'], True)
>>> bind(jaxpr.eqns[1], [jnp.arange(3.0), 2.0])[0].tolist()
[0.0, 2.0, 4.0]
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax._src import source_info_util  # private: the user's line for each op made again, as eval_jaxpr

from .relations import ELEMENTWISE
from .sites import user_site
from .walk import equations

__all__ = ["bind", "body", "elementwise", "line", "vma"]

# Calls whose body a value may go through when the body is elementwise
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat"})


def bind(eqn, ins: list) -> list:
    """The model's operation ``eqn`` on ``ins``, made at the model's line (the plan check and
    its refusals name it there), as ``jax.core.eval_jaxpr`` makes it, its operands first made
    varying over the same axes (JAX's tracing makes them so; a value this re-run sums may be
    invariant where the trace had it vary)."""
    arrays = [x for x in ins if hasattr(x, "aval") or isinstance(x, jax.Array)]
    if body(eqn) is None and len(arrays) > 1:
        union = frozenset().union(*map(vma, arrays))
        ins = [_varying(x, union) for x in ins]
    info = eqn.source_info
    # (the name stack the call is made under, then the operation's own: the module's path, by
    # which the plan check pairs it with the unsharded trace's)
    name_stack = source_info_util.current_name_stack() + info.name_stack
    with source_info_util.user_context(info.traceback, name_stack=name_stack):
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def vma(x) -> frozenset:
    """The axes ``x`` (a value or an abstract one) varies over under ``check_vma``."""
    aval = x if isinstance(x, jax.core.AbstractValue) else getattr(x, "aval", None)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _varying(x, axes: frozenset):
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing and hasattr(x, "aval") else x


def body(eqn):
    """The jaxpr a call-like operation runs (``None`` for any other)."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            body = eqn.params[key]
            return getattr(body, "jaxpr", body)
    return None


def elementwise(jaxpr) -> bool:
    """Whether every operation of ``jaxpr`` computes each position from the same positions
    (scalars broadcast at most), through calls (a call's own operations are walked too; any
    other operation holding a jaxpr, a scan, is not elementwise)."""
    return all(
        eqn.primitive.name in ELEMENTWISE
        or (eqn.primitive.name == "broadcast_in_dim" and _scalar(eqn.invars[0]))
        or body(eqn) is not None
        for eqn in equations(jaxpr)
    )


def _scalar(var: Any) -> bool:
    return np.shape(var.aval) == ()


def line(eqn) -> str:
    """The operation and the model's line that made it, as the plan check names them."""
    return f"{eqn.primitive.name} at {user_site(eqn.source_info) or 'a line JAX does not record'}"

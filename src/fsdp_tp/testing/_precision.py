"""``check_sharded(float64=True)``: every floating input and parameter in float64, and a warning
naming the first operation of the twin's that still computes narrower.

A Linen layer whose ``dtype`` is None computes in the promoted dtype of its inputs and
parameters, so casting both reaches flax's default-dtype layers (``param_dtype=float32``), a
token model's too, whose integer inputs promote nothing. An NNX layer fixes its dtype when it is
built (``nnx.Embed``'s is its table's, float32), so an NNX constructor is checked
:func:`widened`: every floating parameter and every module's floating ``dtype`` in float64, the
twin and the sharded model alike. What still computes narrower (an ``astype`` in the model, a
Linen layer's own ``dtype=jnp.float32``) runs in that precision, at float32's tolerances, and
:func:`require_float64` says where.

>>> import jax, jax.numpy as jnp
>>> with jax.enable_x64():
...     wide(jnp.ones(2)).dtype, wide(jnp.arange(2)).dtype
(dtype('float64'), dtype('int64'))
>>> with jax.enable_x64():
...     narrow_site(jax.make_jaxpr(lambda x: (x.astype(jnp.float32) * 2).sum())(jnp.ones(2, jnp.float64)))
('convert_element_type', 'float32', ...)
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.extend.core import ClosedJaxpr

from .._trace.sites import user_site
from .._trace.walk import equations
from ..errors import CheckPrecisionWarning, warn
from ..nnx._constructor import keyword_only
from ._compare import ATOL, RTOL

__all__ = ["narrow_site", "require_float64", "wide", "widened"]


def wide(leaf):
    """A floating leaf in float64 (integer token ids as they are)."""
    return jnp.asarray(leaf, jnp.float64) if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating) else leaf


def widened(make):
    """The NNX constructor ``make`` whose model holds every floating parameter in float64 and
    computes every module with a floating ``dtype`` in float64 (the layers' dtypes are fixed at
    construction: nnx.Embed's is its table's).

    >>> import jax
    >>> with jax.enable_x64():
    ...     embed = widened(lambda rngs: nnx.Embed(4, 2, rngs=rngs))(rngs=nnx.Rngs(0))
    >>> embed.embedding[...].dtype, embed.dtype
    (dtype('float64'), dtype('float64'))
    """

    keyword = keyword_only(make)

    def make64(*, rngs):  # (keyword-only: the library calls it make64(rngs=...))
        model = make(rngs=rngs) if keyword else make(rngs)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Variable) and _narrow(getattr(node.get_raw_value(), "dtype", None)):
                node.set_raw_value(jnp.asarray(node.get_raw_value(), jnp.float64))
            elif isinstance(node, nnx.Module) and _narrow(getattr(node, "dtype", None)):
                object.__setattr__(node, "dtype", jnp.dtype(jnp.float64))
        return model

    return make64


def _narrow(dtype) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype) != jnp.float64
    except TypeError:  # (not a dtype)
        return False


def narrow_site(closed: ClosedJaxpr) -> tuple[str, str, str] | None:
    """The first operation of ``closed`` (its inner jaxprs too) that rounds a float64 value to
    a narrower float (a layer's own ``dtype=``, an ``astype``): its primitive, that dtype and the
    user's line that made it. A narrower constant (``jnp.zeros((), jnp.float32)``, exact) rounds
    nothing. JAX's own attention (``jax.nn.dot_product_attention``, which flax's attention
    calls) computes its softmax in float32 whatever its inputs' dtype, by design: no dtype of
    the model's changes that, so it is not named (its rounding, 1e-7 relative, is far inside
    the tolerance)."""
    for eqn in equations(closed.jaxpr):
        if eqn.primitive.name not in _ROUNDING or _in_jax_nn(eqn.source_info):
            continue
        given = getattr(eqn.invars[0].aval, "dtype", None)
        made = getattr(eqn.outvars[0].aval, "dtype", None)
        if given is not None and jnp.dtype(given) == jnp.float64 and _narrow(made):
            return eqn.primitive.name, str(made), str(user_site(eqn.source_info) or "an unknown line")
    return None


_ROUNDING = frozenset({"convert_element_type", "reduce_precision"})


def require_float64(closed: ClosedJaxpr, caller: str) -> None:
    """Warns (:class:`~fsdp_tp.errors.CheckPrecisionWarning`) where the twin's call ``closed``
    computes narrower than float64, naming the operation and the fix."""
    if (found := narrow_site(closed)) is None:
        return
    prim, dtype, line = found
    warn(
        CheckPrecisionWarning(
            f"{caller}(float64=True): the model computes in {dtype} at {line} ({prim}), although its "
            f"inputs and parameters were cast to float64: a layer computes in a dtype of its own (its "
            f"dtype=, or an astype in the model). The check ran with that rounding, at float32's "
            f"tolerances (rtol {RTOL:g}, atol {ATOL:g}). To prove it in float64, leave the layer's dtype "
            f"at None (the promoted dtype); to say the check is float32's, pass float64=False."
        )
    )


_JAX_NN = os.sep + os.path.join("jax", "_src", "nn") + os.sep


def _in_jax_nn(source) -> bool:
    traceback = getattr(source, "traceback", None)
    return traceback is not None and any(_JAX_NN in frame.file_name for frame in traceback.frames)

"""Every equation of a jaxpr, its inner jaxprs' (a call's, a scan's, a remat's, a branch's) each
before the equation that holds them: the one walk over a program's operations that the readers
which do not follow values (the precision check's, an elementwise test) share.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
>>> names = [eqn.primitive.name for eqn in equations(closed.jaxpr)]
>>> names[0], len(names), names[-1]    # (the jit's sin first, then the jit, then the product)
('sin', 3, 'mul')
"""

from __future__ import annotations

from collections.abc import Iterator

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

__all__ = ["equations"]


def equations(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr``, an inner jaxpr's before the one that holds it (a remat's or
    a scan's results are its body's: the body's operation is the one to name)."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                if isinstance(inner, ClosedJaxpr):
                    yield from equations(inner.jaxpr)
                elif isinstance(inner, Jaxpr):
                    yield from equations(inner)
        yield eqn

"""Two trees compared leaf by leaf, a failure naming the first leaf out of tolerance: its path,
how many of its elements differ, the largest difference and both values there.

>>> import jax.numpy as jnp
>>> assert_trees_close({"w": jnp.ones(3)}, {"w": jnp.ones(3)}, "grads")
>>> sharded, unsharded = {"w": jnp.array([1.0, 2.0, 3.0])}, {"w": jnp.array([1.0, 2.5, 3.0])}
>>> assert_trees_close(sharded, unsharded, "grads")
Traceback (most recent call last):
...
AssertionError: grads['w']: 1 of 3 elements out of tolerance (rtol 1e-05, atol 1e-06); the largest ...
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["ATOL", "RTOL", "assert_trees_close"]

# float32's tolerances (docs/design.md); never loosened to get a pass. A wrong split, a sum
# counted twice or a gradient N times too large is off by orders of magnitude more.
RTOL, ATOL = 1e-5, 1e-6


def assert_trees_close(
    actual, expected, what: str, exact: bool = False, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Raises ``AssertionError`` unless ``actual`` (the sharded run's) and ``expected`` (the
    unsharded twin's) have the same paths, shapes and dtypes and every leaf is within
    ``rtol``/``atol`` (``exact``: bit for bit). ``what`` starts the message, then the path."""
    found = jax.tree_util.tree_flatten_with_path(actual)[0]
    wanted = jax.tree_util.tree_flatten_with_path(expected)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in found]
    other = [jax.tree_util.keystr(p) for p, _ in wanted]
    if paths != other:
        raise AssertionError(f"{what}: paths differ: {sorted(set(paths) ^ set(other))}")
    for (path, a), (_, e) in zip(found, wanted, strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape or a.dtype != e.dtype:
            raise AssertionError(f"{where}: {a.shape}/{a.dtype} sharded, {e.shape}/{e.dtype} unsharded")
        if exact:
            bad = ~((a == e) | (np.isnan(a) & np.isnan(e))) if a.dtype.kind in "fc" else a != e
            tolerance = "bit for bit"
        else:
            bad = ~np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
            tolerance = f"rtol {rtol:g}, atol {atol:g}"
        if bad.any():
            gap = np.where(bad, np.abs(a.astype(np.float64) - e.astype(np.float64)), -np.inf)
            at = np.unravel_index(int(np.argmax(gap)), a.shape) if a.ndim else ()
            raise AssertionError(
                f"{where}: {int(bad.sum())} of {a.size} elements out of tolerance ({tolerance}); the "
                f"largest difference {float(gap[at]):.6g} at {tuple(map(int, at))}: "
                f"sharded {a[at].item()!r}, unsharded {e[at].item()!r}"
            )

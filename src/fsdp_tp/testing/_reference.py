"""The unsharded twin's run, computed once and read by every check that compares against it:
:class:`Reference`.

A model proved on several meshes is compared each time with the same unsharded run: the same
twin, batch, loss and optimizers give the same outputs, loss, gradients and steps whatever
the mesh. Without a reference each check traces, lowers, compiles and runs that twin again
(1.6-2.5 s of a language model's 11-13 s check in ``tests/test_context_step.py``, five times
over its mesh list). A :class:`Reference` keeps each run under a key of everything it is
computed from, and proves each reuse: the twin's init, which every check computes anyway
(the sharded init's program computes both), must equal the stored run's bit for bit, or the
check stops instead of comparing with numbers of another model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compare import assert_trees_close

__all__ = ["Reference", "TwinRun", "fingerprint", "identity"]


@dataclasses.dataclass(frozen=True)
class TwinRun:
    """The unsharded twin's run: its parameters at init and after the steps, its optimizer
    state after each step, and ``(outputs, loss, gradients)`` on the first batch."""

    init: Any
    params: Any
    states: list
    reads: Any


class Reference:
    """Unsharded runs, each computed once and read by every check of the same twin, batch,
    loss and optimizers: pass one to :func:`~fsdp_tp.testing.check_sharded` (or
    :func:`~fsdp_tp.testing.check_equal`) across the meshes a model is proved on.

    A run is stored under the check's key: for ``check_sharded`` the model (a Linen module by
    its class and fields, an NNX constructor by identity), the loss (by identity: a new
    ``lambda`` is a new key), the batch's bytes, the seed, the steps, the optimizers (by name
    and factory), ``float64`` and ``rngs``; ``check_equal`` adds the batches' and the rng's
    bytes and the optimizers to the key it is given. A run is read only where the
    twin's init, computed afresh by the check, equals the stored one bit for bit: a key that
    misses what the twin depends on stops the check with the first leaf that differs.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from fsdp_tp.testing import Reference, check_sharded
    >>> x, y = jnp.ones((8, 4)), jnp.zeros((8, 2))
    >>> loss = lambda out, y: jnp.mean((out - y) ** 2)
    >>> twins = Reference()
    >>> for mesh in ({"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 4}):
    ...     check_sharded(nn.Dense(2), (x, y), loss, mesh, steps=1, reference=twins)
    >>> twins.computed, twins.read
    (1, 2)
    """

    def __init__(self) -> None:
        self._runs: dict[Hashable, TwinRun] = {}
        self.computed = 0  # (runs computed, and runs read from the store: what a test may assert)
        self.read = 0

    def __len__(self) -> int:
        return len(self._runs)

    def run(self, key: Hashable, init: Any, compute: Callable[[], TwinRun]) -> TwinRun:
        """The run stored under ``key``, proved to start from ``init`` (the twin's parameters the
        check computed); else ``compute()``'s, stored."""
        stored = self._runs.get(key)
        if stored is None:
            stored = self._runs[key] = compute()
            self.computed += 1
            return stored
        try:
            assert_trees_close(init, stored.init, "the twin's init", exact=True)
        except AssertionError as differs:
            raise AssertionError(
                f"fsdp_tp.testing.Reference: the run stored under this check's key started from other "
                f"parameters ({differs}): the key misses something the twin depends on (a model or loss "
                f"changed in place, a constructor drawing from an rng of its own). Give this check a "
                f"Reference of its own, or none."
            ) from None
        self.read += 1
        return stored


def fingerprint(tree: Any) -> str:
    """A digest of ``tree``'s structure and every leaf's dtype, shape and bytes (a PRNG key by its
    key data): two trees of the same digest hold the same values.

    >>> fingerprint({"x": jnp.ones(2)}) == fingerprint({"x": jnp.ones(2)}) != fingerprint({"x": jnp.zeros(2)})
    True
    """
    digest = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.dtype}{leaf.shape}".encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()


def identity(obj: Any) -> Hashable:
    """``obj`` itself as a key where it hashes (a Linen module by its class and fields, a function
    by identity), else a key by identity that keeps ``obj`` alive (so its id is never reused)."""
    try:
        hash(obj)
    except TypeError:
        return _ByIdentity(obj)
    return obj


class _ByIdentity:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

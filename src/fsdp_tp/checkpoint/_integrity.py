"""Fingerprints of global arrays: what a checkpoint records so a restore can prove its bytes.

A fingerprint is two 32-bit sums over an array's bits, computed on the devices that hold
it (one jitted program over the whole tree, sharded like the tree):

- ``sum(word)`` and ``sum(word * (2 i + 1))`` over the array's 32-bit words ``word``,
  ``i`` the word's flat position, both modulo 2**32.

Modular integer sums do not depend on the order of the additions, so every mesh, every
process and every XLA backend computes the same fingerprint for the same bytes — the
check works when the restoring mesh differs from the saving one. Multiplying by an odd
weight is a bijection modulo 2**32, so any change to a single word changes the second sum,
and a word moved to another position changes it with certainty too unless the two words
are equal. It is an integrity check against flipped, truncated or zeroed bytes, not a
cryptographic hash.

>>> import jax.numpy as jnp
>>> a = fingerprints({"w": jnp.arange(4.0)})
>>> b = fingerprints({"w": jnp.arange(4.0).at[2].set(-1.0)})
>>> a == fingerprints({"w": jnp.arange(4.0)}), mismatches(a, b)
(True, ['w'])
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from .._tree import path_of
from .._types import PyTree

__all__ = ["fingerprints", "meta_digest", "mismatches"]


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as a flat vector of uint32 words (narrower types widened first)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:  # 4 bytes: one word each; 8 bytes: two
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _fingerprint(x: jax.Array) -> jax.Array:
    words = _words(x)
    weights = 2 * jnp.arange(words.size, dtype=jnp.uint32) + 1
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


@jax.jit
def _all(tree: PyTree) -> PyTree:
    return jax.tree.map(_fingerprint, tree)


def fingerprints(tree: PyTree) -> dict[str, str]:
    """Each array leaf's fingerprint as 16 hex digits, keyed by its ``/``-joined path.

    The results are replicated scalars, so every process of a multi-process run gets them.
    """
    sums = jax.tree_util.tree_flatten_with_path(_all(tree))[0]
    return {path_of(path): "".join(f"{int(v):08x}" for v in np.asarray(s)) for path, s in sums}


def mismatches(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """The leaves whose fingerprints differ or that one side lacks, sorted."""
    return sorted(k for k in saved.keys() | restored.keys() if saved.get(k) != restored.get(k))


def meta_digest(meta: dict) -> str:
    """A digest of a checkpoint's JSON meta (its step, what the run recorded, the arrays'
    fingerprints), as it reads back from disk: an edit of any field changes it.

    >>> saved = meta_digest({"step": 30})
    >>> saved == meta_digest({"step": 30}), saved == meta_digest({"step": 35})
    (True, False)
    """
    text = json.dumps(json.loads(json.dumps(meta)), sort_keys=True)  # as JSON gives it back
    return hashlib.sha256(text.encode()).hexdigest()[:16]

"""The baselines the library is measured against, re-implemented faithfully here.

They live in ``fsdp_tp.bench`` so that ``fsdp-tp bench`` can run them, and are not
exported from ``fsdp_tp``: reference points (and negative controls in the tests), not
something to use.
"""

from __future__ import annotations

import flax.linen as nn
import jax

__all__ = ["tutorial_sync_gradients"]


def tutorial_sync_gradients(grads, axis_names):
    """The well-known tutorial's ``sync_gradients``: pmean every leaf over the axes it is not split over.

    Right under ``check_vma=False``. Under ``check_vma=True`` JAX has already
    summed the gradients of replicated parameters, so this leaves them N times
    too large, with no error.
    """

    def sync(g):
        if isinstance(g, nn.Partitioned):
            axes = tuple(a for a in axis_names if a not in g.names)
            return g.replace(value=jax.lax.pmean(g.value, axes)) if axes else g
        return jax.lax.pmean(g, axis_names)

    return jax.tree.map(sync, grads, is_leaf=lambda x: isinstance(x, nn.Partitioned))

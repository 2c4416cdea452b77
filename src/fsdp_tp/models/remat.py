"""The decoder blocks' rematerialization policies, by the name ``--remat`` takes; framework-free,
so the Linen and the NNX GPT read one table.

>>> sorted(REMAT_POLICIES)
['dots', 'full', 'none']
>>> remat_policy("dots", "MoELM") is REMAT_POLICIES["dots"]
True
"""

from __future__ import annotations

import jax

__all__ = ["REMAT_POLICIES", "remat_policy"]

# What a decoder block keeps for the backward pass: ``full`` keeps only its input and
# recomputes the rest (and re-gathers its FSDP shards), ``dots`` also keeps the results of
# its weight matmuls (no batch dims: not the attention scores), ``none`` keeps everything.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "none": None,
}


def remat_policy(name: str, model: str):
    """The policy ``remat=name`` names for ``model``'s blocks (``None``: ``"none"``, no remat),
    or a ``ValueError`` naming the choices."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"{model}: remat={name!r} is not one of {sorted(REMAT_POLICIES)}.")
    return REMAT_POLICIES[name]

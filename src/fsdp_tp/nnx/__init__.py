"""The Flax NNX front end: an NNX model the user did not write, stored by the core's rules and
gathered where it is read, with the core's init, step, optimizer, plan and checkpoints.

:func:`shard_by_rules` is the one verb. It returns a :class:`ShardedModel`: pass its
``state_init_fn(tx)`` to :func:`fsdp_tp.init_sharded`, and inside the step function given to
:func:`fsdp_tp.shard_step` rebuild the model with ``merge(state.params, state.model_state)``
and differentiate with respect to the params, as a Linen step does with ``model.apply``.
Nothing here imports ``flax.linen``, and the core imports nothing from here.
"""

from ._model import ShardedModel, shard_by_rules

__all__ = ["ShardedModel", "shard_by_rules"]

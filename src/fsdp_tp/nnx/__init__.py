"""The Flax NNX front end: an NNX model the user did not write, stored by the core's rules and
gathered where it is read, with the core's tensor-parallel roles, init, step, optimizer, plan
and checkpoints.

:func:`shard_by_rules` is the one verb; its ``tp_rules=`` take the core's roles
(:mod:`fsdp_tp.tp`), the same objects the Linen front end takes. It
returns a :class:`ShardedModel`: pass its ``state_init_fn(tx)`` to
:func:`fsdp_tp.init_sharded`, and inside the step function given to
:func:`fsdp_tp.shard_step` rebuild the model with ``merge(state.params, state.model_state)``
and differentiate with respect to the params, as a Linen step does with ``model.apply``.
:func:`tp_splits` says where the roles split each parameter, for storage rules to agree with;
:func:`find_tp_rules` finds the rules of Megatron's plan from what the model computes.
Nothing here imports ``flax.linen``, and the core imports nothing from here.
"""

from .._aliases import aliases_of
from ._auto import find_tp_rules
from ._model import ShardedModel, shard_by_rules
from ._tp import tp_splits

__all__ = ["ShardedModel", "find_tp_rules", "shard_by_rules", "tp_splits"]

__getattr__ = aliases_of(__name__)  # 0.2 re-exported the roles here (fsdp_tp._aliases)

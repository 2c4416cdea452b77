"""The Linen front end: everything in fsdp_tp that builds, wraps or intercepts a
``flax.linen`` module. The core (:mod:`fsdp_tp.rules`, :mod:`fsdp_tp.tp`,
:mod:`fsdp_tp.sharded_init`, :mod:`fsdp_tp.train`, ...) imports nothing from here, so a
second front end sits beside this folder over the same core.

- :mod:`~fsdp_tp.linen.fsdp` (``shard_module_params``), :mod:`~fsdp_tp.linen.rule_transform`
  (``shard_by_rules``), :mod:`~fsdp_tp.linen.tp_rules` (the tensor-parallel roles): the
  module transforms;
- :mod:`~fsdp_tp.linen.auto_rules` (:func:`find_tp_rules`): the tp rules Megatron's plan
  gives a model, found from what it computes;
- :mod:`~fsdp_tp.linen.layers`: the hand-written tensor-parallel layers and blocks;
- ``_transform`` (store by a layout), ``_gather`` (gather where a submodule reads),
  ``_local_compute`` (the tp-rule interceptor): their Linen mechanics.
"""

from . import _plain  # noqa: F401  (a plain apply in a step that splits the sequence, checked)
from .auto_rules import find_tp_rules

__all__ = ["find_tp_rules"]

"""The Linen side of :func:`fsdp_tp.testing.check_sharded`: whether a user's model is a Linen
module, and the sharded module and its unsharded twin built from its fields."""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from .._types import AxisNames
from ._check import fields_of
from .rule_transform import shard_by_rules

__all__ = ["is_linen", "linen_pair"]


def is_linen(model: Any) -> bool:
    """Whether ``model`` is a Linen module (bound or not)."""
    return isinstance(model, nn.Module)


def linen_pair(model: nn.Module, rules, tp_rules, batch_axes: AxisNames) -> tuple[nn.Module, nn.Module]:
    """``model``'s class laid out by ``rules`` and ``tp_rules`` (:func:`fsdp_tp.shard_by_rules`)
    and the class itself, each built with ``model``'s fields."""
    fields = fields_of(model, type(model))
    sharded = shard_by_rules(type(model), rules, batch_axes=batch_axes, tp_rules=tp_rules)
    return sharded(**fields), type(model)(**fields)

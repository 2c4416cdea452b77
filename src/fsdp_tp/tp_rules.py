"""Deprecated home of the tp rules: ``from fsdp_tp.tp_rules import mlp_rules`` (0.1's spelling)
works until 0.3.0 with a ``DeprecationWarning``; the module is :mod:`fsdp_tp.linen.tp_rules`
(the roles themselves, for both front ends, are :mod:`fsdp_tp.tp.roles`).

The attribute ``fsdp_tp.tp_rules`` has reached the Linen module since 0.2.0 without a warning;
only this import path warns, since only it would break in 0.3.0.
"""

from __future__ import annotations

import warnings

from .linen.tp_rules import *  # noqa: F403  (the same names, from where they live)
from .linen.tp_rules import __all__ as __all__

warnings.warn(
    "fsdp_tp.tp_rules moved to fsdp_tp.linen.tp_rules in 0.2.0 (the roles for both Flax APIs are in "
    "fsdp_tp.tp.roles); this import path goes in 0.3.0: write `from fsdp_tp.linen.tp_rules import ...`.",
    DeprecationWarning,
    stacklevel=2,
)

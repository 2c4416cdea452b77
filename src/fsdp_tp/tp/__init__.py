"""Tensor parallelism, once for every front end: Megatron's pieces and the roles that put them
around a submodule a tp rule names.

- :mod:`fsdp_tp.tp.pieces`: what a column, a row and a vocabulary-parallel layer do around
  their local computation (*f*, *g*, the sequence gathers and reduce-scatters, the bias
  added once, a kept-whole block, the vocabulary lookup and loss). Every tensor-parallel
  path computes through them.
- :mod:`fsdp_tp.tp.roles`: ``ColumnParallel``, ``RowParallel``, ``HeadParallel``,
  ``VocabParallel``, the ``(pattern, role)`` rules of both front ends (``tp_rules=``), on
  the ``Layer`` / ``TPRole`` of ``fsdp_tp.tp._role``; ``fsdp_tp.tp._rules`` matches and
  checks the rules whichever front end applies them.

Both are importable from here: ``from fsdp_tp.tp import ColumnParallel, column_input``.
A front end adds its own module classes (``linen/tp_rules.py``, ``nnx/_tp.py``); a new TP
feature is a role's field here, and both front ends have it.

>>> from fsdp_tp.tp import ColumnParallel, roles
>>> ColumnParallel is roles.ColumnParallel
True
"""

from . import pieces, roles
from .pieces import *  # noqa: F403  (the pieces' names, re-exported)
from .roles import *  # noqa: F403  (the roles' names, re-exported)

__all__ = [*pieces.__all__, *roles.__all__, "pieces", "roles"]

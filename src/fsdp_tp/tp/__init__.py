"""Tensor parallelism, once for every front end: the roles a tp rule gives a submodule.

``from fsdp_tp.tp import ColumnParallel, RowParallel``: the roles (:class:`ColumnParallel`,
:class:`RowParallel`, :class:`HeadParallel`, :class:`VocabParallel`; :class:`ExpertParallel`
for a mixture's experts over ``expert``; :class:`Region` for a module of raw kernels its own
einsums read), what a role sees of a module (:class:`Layer`) and the base of a role of your own
(:class:`TPRole`, listed in :data:`ROLES`), and :func:`register_einsum` for a module class of
your own. The same objects
serve both Flax APIs: pass ``(pattern, role)`` rules as ``tp_rules=`` to
:func:`fsdp_tp.shard_by_rules` (Linen) or :func:`fsdp_tp.nnx.shard_by_rules`; each front end's
``find_tp_rules`` (:func:`fsdp_tp.linen.find_tp_rules`, :func:`fsdp_tp.nnx.find_tp_rules`)
finds them from what the model computes.

:mod:`fsdp_tp.tp.pieces` holds what a column, a row and a vocabulary-parallel layer do around
their local computation (Megatron's *f* and *g*, the sequence gathers and reduce-scatters, the
bias added once, a kept-whole block, the vocabulary lookup): every tensor-parallel path
computes through them. A new TP feature is a role's field here, and both front ends have it.
The paths 0.1 and 0.2 wrote elsewhere (a role in the old roles modules, a piece
read from here) still work, with a warning naming the path above (:mod:`fsdp_tp._aliases`).

>>> from fsdp_tp.tp import ColumnParallel, pieces
>>> ColumnParallel(sequence_dim=1).axis, pieces.column_input.__name__
('tensor', 'column_input')
"""

from .._aliases import aliases_of
from . import _roles, pieces
from ._roles import *  # noqa: F403  (the roles by the names _roles lists)

__all__ = [*_roles.__all__, "pieces"]

__getattr__ = aliases_of(__name__)

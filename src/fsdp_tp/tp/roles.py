"""0.2's module of the roles: each name here is read from :mod:`fsdp_tp.tp` with a
``DeprecationWarning`` naming it (``from fsdp_tp.tp import ColumnParallel``), until 0.3.0.
The paths are rows of :data:`fsdp_tp._aliases.MOVED`."""

from .._aliases import aliases_of

__all__: list[str] = []

__getattr__ = aliases_of(__name__)

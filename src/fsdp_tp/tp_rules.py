"""0.1's home of the tp rules: each name here is read from where it lives, the roles from
:mod:`fsdp_tp.tp` and Linen's ready rule sets from :mod:`fsdp_tp.linen.tp_rules`, with a
``DeprecationWarning`` naming that path, until 0.3.0. The paths are rows of
:data:`fsdp_tp._aliases.MOVED`."""

from ._aliases import aliases_of

__all__: list[str] = []

__getattr__ = aliases_of(__name__)

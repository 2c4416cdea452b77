"""Every deprecated path to a public name, in one table, served one way.

Each public name has one canonical path: where the docs, docstrings and error messages name it
(the shallowest module whose ``__all__`` lists it). A path 0.1 or 0.2 wrote that is not that one
is a row of :data:`MOVED`. A module that holds old paths ends with
``__getattr__ = aliases_of(__name__)`` (PEP 562: called only for a name the module lacks), so
reading an old path, by attribute or by ``from ... import``, returns the canonical object (the
very object: a class's identity, a registration, a patch hold under both names) with a
``DeprecationWarning`` that names the path to write and the release that removes the old one.
No module swaps itself in ``sys.modules``, no module warns at import: a name warns when read.
A setting 0.2 named another way (a Linen layer's field, a function's keyword) is a row of
:data:`fsdp_tp._renamed.RENAMED`, served the same way.

>>> import warnings
>>> from fsdp_tp import tp
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from fsdp_tp.tp_roles import ColumnParallel
>>> ColumnParallel is tp.ColumnParallel
True
>>> print(caught[0].message)
fsdp_tp.tp_roles.ColumnParallel is deprecated since 0.2.0 and goes in 0.3.0: write fsdp_tp.tp.ColumnParallel
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "Moved", "aliases_of", "canonical"]

REMOVED_IN = "0.3.0"


@dataclasses.dataclass(frozen=True)
class Moved:
    """``old`` (a dotted path a release wrote) now reads ``new`` (its canonical path)."""

    old: str
    new: str
    removed: str = REMOVED_IN

    @property
    def message(self) -> str:
        return f"{self.old} is deprecated since 0.2.0 and goes in {self.removed}: write {self.new}"


_ROLES = ("ColumnParallel", "RowParallel", "HeadParallel", "VocabParallel", "TPRole", "ROLES")
# The pieces 0.2 exported from fsdp_tp.tp, frozen: a piece added later has no old path to warn on.
_PIECES = (
    "add_bias_once",
    "column_input",
    "kept_block",
    "require_kept_blocks",
    "row_reduce",
    "shared_column_inputs",
    "vocab_lookup",
    "vocab_start",
)
_LINEN_RULES = ("LINEN", "attention_rules", "layer_of", "local_attributes", "mlp_rules")
_CROSS_ENTROPY = "fsdp_tp.vocab_parallel_cross_entropy"

MOVED: tuple[Moved, ...] = (
    # The roles, once for both front ends, live in fsdp_tp.tp (issue 58: six paths before).
    *(Moved(f"fsdp_tp.tp.roles.{n}", f"fsdp_tp.tp.{n}") for n in (*_ROLES, "Layer", "register_einsum")),
    *(Moved(f"fsdp_tp.tp_roles.{n}", f"fsdp_tp.tp.{n}") for n in (*_ROLES, "Layer", "register_einsum")),
    *(Moved(f"fsdp_tp.tp_rules.{n}", f"fsdp_tp.tp.{n}") for n in _ROLES),
    *(Moved(f"fsdp_tp.tp_rules.{n}", f"fsdp_tp.linen.tp_rules.{n}") for n in _LINEN_RULES),
    *(Moved(f"fsdp_tp.linen.tp_rules.{n}", f"fsdp_tp.tp.{n}") for n in _ROLES),
    *(Moved(f"fsdp_tp.nnx.{n}", f"fsdp_tp.tp.{n}") for n in _ROLES[:4]),
    # Megatron's collective pieces are a submodule of fsdp_tp.tp, not the roles' namespace.
    *(Moved(f"fsdp_tp.tp.{n}", f"fsdp_tp.tp.pieces.{n}") for n in _PIECES),
    Moved("fsdp_tp.tp.vocab_parallel_cross_entropy", _CROSS_ENTROPY),
    Moved("fsdp_tp.linen.layers.vocab_parallel_cross_entropy", _CROSS_ENTROPY),
    Moved("fsdp_tp.linen.layers.vocab.vocab_parallel_cross_entropy", _CROSS_ENTROPY),
    # Names a module re-exported from a sibling.
    Moved("fsdp_tp.train.fold_rng_over_axis", "fsdp_tp.dropout.fold_rng_over_axis"),
    *(
        Moved(f"fsdp_tp.linen.layers.attention.{n}", f"fsdp_tp.attention.{n}")
        for n in ("ATTENTION_IMPLEMENTATIONS", "attend", "resolved_implementation")
    ),
    Moved("fsdp_tp.models.transformer.REMAT_POLICIES", "fsdp_tp.models.remat.REMAT_POLICIES"),
    # The Linen modules the front door reached before the Linen folder.
    Moved("fsdp_tp.fsdp", "fsdp_tp.linen.fsdp"),
    Moved("fsdp_tp.layers", "fsdp_tp.linen.layers"),
)
"""Every deprecated path, each with its canonical one; the CHANGELOG lists the same rows."""

_BY_OLD = {moved.old: moved for moved in MOVED}
_MODULES = ("fsdp_tp.tp_roles", "fsdp_tp.tp_rules", "fsdp_tp.tp.roles")
"""Modules that are nothing but old paths: the package's ``__getattr__`` imports them on first
read (0.1 wrote the Linen rule sets as attributes of the first, after ``import fsdp_tp``)."""


def canonical(path: str) -> Any:
    """The object at the dotted ``path`` (a module, or a module's attribute).

    >>> canonical("fsdp_tp.tp.ColumnParallel").__name__
    'ColumnParallel'
    """
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def aliases_of(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module``: its old paths, read with a warning; any other missing
    name, the usual ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        path = f"{module}.{name}"
        if path in _MODULES:
            return importlib.import_module(path)
        moved = _BY_OLD.get(path)
        if moved is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if not sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):
            # (``from package import name`` asks importlib's hasattr first, then reads the
            # name where the user wrote it: one warning, at the user's line)
            warnings.warn(moved.message, DeprecationWarning, stacklevel=2)
        return canonical(moved.new)

    return __getattr__

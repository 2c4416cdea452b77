"""What an error of the model's own code on a device's slices under a plan means:
:func:`raise_failure` says which (the library's refusal as it is, the model's own where the
unsharded model fails too, else the plan's, at the line that failed, with the fix)."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from .._trace.sites import Site, flax_file, made_by_jax, users_file
from ..errors import RuleError
from ..tp._experts import ExpertParallel
from .refusals import RULE_DROPPED, axes_text

__all__ = ["raise_failure"]


def _flax_layer(err: Exception) -> str | None:
    """The class of the Flax layer whose own code raised ``err`` (its innermost frame outside
    JAX with a ``self`` is a Flax module's), else ``None``."""
    found = None
    tb = err.__traceback__
    while tb is not None:
        file, owner = tb.tb_frame.f_code.co_filename, tb.tb_frame.f_locals.get("self")
        if not made_by_jax(file) and _is_module(owner):  # (a Scope's frame, or a helper's: not one)
            found = type(owner).__name__ if flax_file(file) else None
        tb = tb.tb_next
    return found


def _is_module(owner: object) -> bool:
    return any(c.__module__ in ("flax.linen.module", "flax.nnx.module") for c in type(owner).__mro__)


def raise_failure(
    err: Exception,
    unsharded: Callable[[], Any],
    where: str,
    rules: str,
    sizes: Mapping[str, int],
    hints: Callable[[], str] = str,
    whole: str = RULE_DROPPED,
    roles: Iterable = (),
) -> NoReturn:
    """Raises what fits an error of the model's code on a device's slices under the plan
    (``rules``: the plan as written, ``"the tp rules [...]"``): the library's own errors as they
    are (they name their fix), and the model's own as they are where the unsharded model
    (``unsharded()`` traces it) fails too; else a :class:`~fsdp_tp.errors.RuleError` naming the
    line that failed, with ``hints()`` (:func:`~fsdp_tp.tp._find.plan.letter_hints`) after it and
    ``whole``, how a module is left whole."""
    frames = traceback.extract_tb(err.__traceback__)
    sites = [Site(f.filename, f.lineno or 0, f.name) for f in reversed(frames)]
    raiser = next((s for s in sites if not made_by_jax(s.file)), None)
    if type(err).__module__.startswith("fsdp_tp") or (raiser is not None and raiser.library):
        if isinstance(err, RuleError) and (extra := hints()):  # (a letter the rule left to chance)
            err.args = (f"{err.args[0]}{extra}", *err.args[1:])
        raise err  # (the library's own refusal: it names its fix)
    try:
        unsharded()
    except Exception:
        raise err from None  # (not the plan's doing: the model refuses these inputs itself)
    line = next((s for s in sites if users_file(s.file)), None)
    roles = list(roles)
    experts = [r for r in roles if isinstance(r, ExpertParallel)]
    if experts and not any(r.returns for r in experts):
        raise RuleError(
            f"{where}: under {rules} the model's code fails on each device's slices"
            f"{f' at {line}' if line else ''}: {type(err).__name__}: {err}. No ExpertParallel layer has "
            f"returns=True, so the experts' outputs never go back to their tokens' devices and the combine "
            f"reads the experts' buffers as its own. Fix: give the expert bank's last layer (the one whose "
            f"output the combine reads, e.g. the down projection) its own rule with "
            f"ExpertParallel(returns=True).{hints()}"
        ) from err
    if (layer := _flax_layer(err)) is not None:  # (a Flax layer the rules leave whole)
        raise RuleError(
            f"{where}: under {rules}, a {layer} the rules leave whole fails on a device's "
            f"slice of the features a column layer splits{f' at {line}' if line else ''}: "
            f"{type(err).__name__}: {err}. Its own sizes (its parameters') are the unsharded "
            f"model's, and a layer that reads the features whole (a norm over them) between a "
            f"column layer and its row layer is not the unsharded model's on a slice. Fix: leave the "
            f"column and row layers around it whole ({whole}), or move it out of the pair.{hints()}"
        ) from err
    raise RuleError(
        f"{where}: under {rules} the model's code fails on each device's slices"
        f"{f' at {line}' if line else ''}: {type(err).__name__}: {err}. Each role computes its "
        f"module on a block of what it splits over {axes_text(sizes)}, and the code around it runs as "
        f"written: a size taken from the module's constants (a head count, a stacked k/v dim) no "
        f"longer fits. Fix: size that code from the arrays it gets (reshape with -1 where the "
        f"split dim lands), give an einsum role the letter the model splits (letter=...), or leave "
        f"the modules around that line whole ({whole}).{hints()}"
    ) from err

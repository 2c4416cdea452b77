"""The user's NNX constructor, checked and run (a built model or a Linen module named with what
to pass), and the model's call with jax's error from an ``nnx.scan`` over a stack whose layer
dim a rule splits turned into one that names the rules."""

from __future__ import annotations

import inspect

from flax import nnx

from ..errors import RuleError
from ._swap import Swap

__all__ = ["CALLER", "built", "keyword_only", "require_constructor", "scan_errors_named"]

CALLER = "fsdp_tp.nnx.shard_by_rules"


def require_constructor(make_model) -> None:
    """``make_model`` builds an NNX model from ``nnx.Rngs``; a built model, or a Linen module,
    is named with what to pass instead."""
    if isinstance(make_model, nnx.Module):
        name = type(make_model).__name__
        raise TypeError(
            f"{CALLER}: got a built {name}; pass its constructor, e.g. lambda rngs: {name}(..., "
            f"rngs=rngs): each device builds its block of every parameter from the rng, so the init "
            f"is the unsharded one."
        )
    cls = make_model if isinstance(make_model, type) else type(make_model)
    if any(c.__module__.startswith("flax.linen") for c in cls.__mro__):
        raise TypeError(
            f"{CALLER}: got the Linen module {cls.__name__}; this is the NNX front end. For a Linen "
            f"model use fsdp_tp.shard_by_rules({cls.__name__}, rules) (the same rules and roles)."
        )
    if not callable(make_model):
        raise TypeError(f"{CALLER}: make_model must build the model from nnx.Rngs; got {make_model!r}.")


def built(make_model, rng=0) -> nnx.Module:
    """``make_model(nnx.Rngs(rng))``, or ``make_model(rngs=...)`` where it takes ``rngs`` by
    keyword only, its annotated parameters plain arrays (the unsharded model's: its layout is
    the library's, so no mesh is needed); a constructor whose signature needs more is named with
    what to pass."""
    rngs = nnx.Rngs(rng)
    signature = _signature(make_model)
    keyword = _keyword_only(signature)
    if signature is not None:
        try:
            signature.bind(rngs=rngs) if keyword else signature.bind(rngs)
        except TypeError as err:
            name = getattr(make_model, "__name__", type(make_model).__name__)
            name = "Model" if name == "<lambda>" else name
            raise TypeError(
                f"{CALLER}: the constructor is called as make_model(rngs) with an nnx.Rngs alone, and "
                f"it needs more ({err}); pass a function of the rngs that gives the rest, e.g. "
                f"lambda rngs: {name}(..., rngs=rngs)."
            ) from None
    with nnx.use_eager_sharding(False):
        model = make_model(rngs=rngs) if keyword else make_model(rngs)
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{CALLER}: make_model(nnx.Rngs(...)) returned a {type(model).__name__}, not an nnx.Module; "
            f"pass a constructor of the model, e.g. lambda rngs: Model(..., rngs=rngs)."
        )
    return model


def keyword_only(make_model) -> bool:
    """Whether ``make_model`` takes ``rngs`` by keyword only (how :func:`built` calls it)."""
    return _keyword_only(_signature(make_model))


def _signature(make_model) -> inspect.Signature | None:
    """How ``make_model`` is called: a class by its ``__init__`` (Flax's metaclass hides it
    behind ``*args, **kwargs``), less ``self``; ``None`` where Python cannot say."""
    try:
        if isinstance(make_model, type):
            init = inspect.signature(make_model.__init__)  # type: ignore[misc]
            return init.replace(parameters=list(init.parameters.values())[1:])
        return inspect.signature(make_model)
    except (TypeError, ValueError):
        return None


def _keyword_only(signature: inspect.Signature | None) -> bool:
    """Whether a constructor of ``signature`` takes ``rngs`` by keyword only (``def make(*, rngs)``)."""
    rngs = signature.parameters.get("rngs") if signature is not None else None
    return rngs is not None and rngs.kind is inspect.Parameter.KEYWORD_ONLY


@Swap.kind("scan errors named")
def scan_errors_named(cls: type, first_split: tuple[str, ...]) -> dict:
    """A model whose ``__call__`` turns jax's "different leading axis sizes" from an
    ``nnx.scan`` over the model's stack into a ``RuleError`` naming the parameters whose first
    dim a rule splits (an ``nnx.vmap`` stack's layer dim carries no mark a rule could be
    checked against before the scan runs)."""

    def __call__(self, *args, **kwargs):
        try:
            return cls.__call__(self, *args, **kwargs)
        except ValueError as err:
            if "different leading axis sizes" not in str(err):
                raise
            raise RuleError(
                f"{CALLER}: nnx.scan got a stack whose parameters split their layer dim ({err}). "
                f"Rules split the first dim of {', '.join(first_split)}: an nnx.vmap stack's layer "
                f"dim must stay whole (the scan hands each layer its slice); start those specs "
                f"with None, e.g. P(None, 'fsdp')."
            ) from None

    return {"__call__": __call__}

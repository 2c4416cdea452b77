"""Megatron tensor parallelism for a model you cannot edit: rules that name its submodules.

A rule is ``(pattern, role)``: ``pattern`` is searched (``re.search``) in a submodule's
path, as every rule of the library is (:mod:`fsdp_tp.rules`), and ``role`` says how that
submodule computes on its slices over a mesh axis:

- :class:`ColumnParallel` (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv``): the kernel split
  on its (first) output feature dim (a convolution's output channels); the input is the same
  on every device, the output this device's slice of the features (or gathered,
  ``gather_output=True``);
- :class:`RowParallel` (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Conv``): the kernel split on
  its (first) input dim; the input arrives split (a column-parallel layer's output), the partial
  products are summed over the axis and the bias added once;
- :class:`HeadParallel` (``nn.MultiHeadDotProductAttention``): each device computes its
  share of the heads (q/k/v column-parallel on the heads dim, the output projection
  row-parallel);
- :class:`VocabParallel` (``nn.Embed``): the table split on the vocabulary; each device
  looks up the ids in its range and the rows are summed over the axis (``attend``, tied
  logits, gathers the vocabulary).

Per attention or Dense-Dense MLP block that is Megatron's minimum: one all-reduce forward
(the row sum), one backward (the column input's gradient). :func:`attention_rules` and
:func:`mlp_rules` are the ready sets; pass the rules to :func:`~fsdp_tp.shard_by_rules`
as ``tp_rules=``, next to its storage rules (FSDP splits another dim).

>>> from fsdp_tp.linen.tp_rules import attention_rules, mlp_rules
>>> [(pattern, type(role).__name__) for pattern, role in mlp_rules(r"mlp/up$", r"mlp/down$")]
[('mlp/up$', 'ColumnParallel'), ('mlp/down$', 'RowParallel')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from .._tree import module_path
from ..collectives import gather_from_axis
from ..errors import RuleError
from ..tp import add_bias_once, column_input, row_reduce, vocab_lookup

__all__ = [
    "ROLES",
    "ColumnParallel",
    "HeadParallel",
    "RowParallel",
    "TPRole",
    "VocabParallel",
    "attention_rules",
    "mlp_rules",
]


def _count(dims) -> int:
    return len(dims) if isinstance(dims, tuple | list) else 1


def _first(features):
    return features[0] if isinstance(features, tuple | list) else features


def _with_first(features, value):
    return (value, *features[1:]) if isinstance(features, tuple | list) else value


def _copied(args: tuple, kwargs: dict, axis: str) -> tuple[tuple, dict]:
    """Megatron's *f* on every floating array input, once per distinct array (self-attention
    passes one array as q, k and v: one backward all-reduce, not three)."""
    done: dict[int, Any] = {}

    def copy(x):
        if not (isinstance(x, jax.Array | jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if id(x) not in done:
            done[id(x)] = column_input(x, axis)
        return done[id(x)]

    return tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}


def _ungrouped(module: nn.Module) -> None:
    """A grouped convolution mixes channels within groups only: a channel split would cut
    across the groups, so it stays whole."""
    groups = getattr(module, "feature_group_count", 1)
    if groups != 1:
        path = module_path(module.path) or type(module).__name__
        raise RuleError(
            f"{path} is an nn.Conv with feature_group_count={groups}: splitting its channels over a "
            f"mesh axis would cut across its groups. Leave {path} whole (drop it from the tp rules)."
        )


def _stored(module: nn.Module, name: str) -> jax.Array:
    """Parameter ``name`` of ``module`` as the module reads it (gathered over FSDP's axes)."""
    return meta.unbox(module.get_variable("params", name))


@dataclass(frozen=True)
class TPRole:
    """How a submodule computes on its slices over mesh axis ``axis``. A role says which
    of its parameters are split on which dim (:meth:`splits`, dims counted from the end,
    so a stacked ``nn.scan`` dim in front changes nothing), which attributes make the
    module compute on the local sizes (:meth:`local`), and the collectives around the
    call (:meth:`around`)."""

    axis: str = "tensor"
    kinds: ClassVar[tuple[type, ...]] = ()
    methods: ClassVar[frozenset[str]] = frozenset({"__call__"})

    def splits(self, module: nn.Module) -> dict[str, int]:
        """``{parameter path under the module: the dim split over the axis}``."""
        raise NotImplementedError

    def divides(self, module: nn.Module, args: tuple, kwargs: dict) -> dict[str, int]:
        """``{what: size}`` that the axis size must divide for the split to work."""
        raise NotImplementedError

    def local(self, module: nn.Module, args: tuple, kwargs: dict, size: int) -> dict[str, Any]:
        """The attributes the module computes with on this device's slices."""
        return {}

    def inner(self) -> dict[str, TPRole]:
        """Roles of the module's own children (by name), which it creates itself."""
        return {}

    def around(self, method: str, run, module: nn.Module, args: tuple, kwargs: dict):
        """The call: ``run(*args, **kwargs)`` is the module on its slices."""
        raise NotImplementedError


@dataclass(frozen=True)
class ColumnParallel(TPRole):
    """``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` split on the (first) output feature dim.

    ``gather_output``: all-gather the features (a model's last layer, whose output the
    loss reads whole); otherwise the next layer must be :class:`RowParallel`."""

    gather_output: bool = False
    kinds: ClassVar[tuple[type, ...]] = (nn.Dense, nn.DenseGeneral, nn.Conv)

    def splits(self, module):
        _ungrouped(module)
        dim = -_count(module.features)
        return {"kernel": dim, "bias": dim}

    def divides(self, module, args, kwargs):
        return {"features": _first(module.features)}

    def local(self, module, args, kwargs, size):
        return {"features": _with_first(module.features, _first(module.features) // size)}

    def around(self, method, run, module, args, kwargs):
        args, kwargs = _copied(args, kwargs, self.axis)
        out = run(*args, **kwargs)
        return gather_from_axis(out, -_count(module.features), self.axis) if self.gather_output else out


@dataclass(frozen=True)
class RowParallel(TPRole):
    """``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` split on the (first) contracted input dim: the
    input arrives split there, the partial products are summed over the axis (Megatron's
    *g*) and the bias, whole on every device, is added once after the sum."""

    kinds: ClassVar[tuple[type, ...]] = (nn.Dense, nn.DenseGeneral, nn.Conv)

    def splits(self, module):
        _ungrouped(module)
        contracted = _count(getattr(module, "axis", -1))
        return {"kernel": -(contracted + _count(module.features))}

    def divides(self, module, args, kwargs):
        axis = getattr(module, "axis", -1)
        return {"input dim": args[0].shape[_first(axis)]}

    def local(self, module, args, kwargs, size):
        return {"use_bias": False}

    def around(self, method, run, module, args, kwargs):
        out = row_reduce(run(*args, **kwargs), self.axis)
        bias = _stored(module, "bias") if module.use_bias else None
        return add_bias_once(out, bias, self.axis, dtype=module.dtype)


@dataclass(frozen=True)
class HeadParallel(TPRole):
    """``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``): each device computes
    ``num_heads / size`` heads; query, key and value are split on the heads dim, the output
    projection on its heads dim (:class:`RowParallel`), so the block has one all-reduce
    forward and one backward. Dropout inside attention draws its mask per device's heads:
    the same distribution as unsharded, not the same mask."""

    kinds: ClassVar[tuple[type, ...]] = (nn.MultiHeadDotProductAttention,)

    def splits(self, module):
        return {f"{proj}/{name}": -2 for proj in ("query", "key", "value") for name in ("kernel", "bias")}

    def divides(self, module, args, kwargs):
        return {"num_heads": module.num_heads}

    def local(self, module, args, kwargs, size):
        inputs_q = args[0] if args else kwargs["inputs_q"]
        qkv = module.qkv_features or inputs_q.shape[-1]
        return {
            "num_heads": module.num_heads // size,
            "qkv_features": qkv // size,
            "out_features": module.out_features or inputs_q.shape[-1],
        }

    def inner(self):
        return {"out": RowParallel(self.axis)}

    def around(self, method, run, module, args, kwargs):
        args, kwargs = _copied(args, kwargs, self.axis)
        return run(*args, **kwargs)


@dataclass(frozen=True)
class VocabParallel(TPRole):
    """``nn.Embed`` with the table split on the vocabulary: each device looks up the ids
    in its range (zeros for the others) and the rows are summed over the axis. ``attend``
    (logits tied to the table) computes this device's vocabulary slice and gathers it."""

    kinds: ClassVar[tuple[type, ...]] = (nn.Embed,)
    methods: ClassVar[frozenset[str]] = frozenset({"__call__", "attend"})

    def splits(self, module):
        return {"embedding": -2}

    def divides(self, module, args, kwargs):
        return {"num_embeddings": module.num_embeddings}

    def local(self, module, args, kwargs, size):
        return {"num_embeddings": module.num_embeddings // size}

    def around(self, method, run, module, args, kwargs):
        if method == "attend":
            args, kwargs = _copied(args, kwargs, self.axis)
            return gather_from_axis(run(*args, **kwargs), -1, self.axis)
        ids, *rest = args
        rows = module.num_embeddings // jax.lax.axis_size(self.axis)
        return row_reduce(vocab_lookup(ids, rows, self.axis, lambda i: run(i, *rest, **kwargs)), self.axis)


ROLES: tuple[type[TPRole], ...] = (ColumnParallel, RowParallel, HeadParallel, VocabParallel)


def attention_rules(pattern: str = r"MultiHeadDotProductAttention_\d+$", axis: str = "tensor"):
    """The ready rule set for Flax's ``nn.MultiHeadDotProductAttention``: head-parallel.

    >>> attention_rules()
    [('MultiHeadDotProductAttention_\\\\d+$', HeadParallel(axis='tensor'))]
    """
    return [(pattern, HeadParallel(axis))]


def mlp_rules(up: str = r"Dense_0$", down: str = r"Dense_1$", axis: str = "tensor"):
    """The ready rule set for a Dense-Dense MLP: ``up`` column-parallel, ``down`` row-parallel
    (the activation between them is elementwise, so it runs on the feature slices).

    >>> [type(role).__name__ for _, role in mlp_rules()]
    ['ColumnParallel', 'RowParallel']
    """
    return [(up, ColumnParallel(axis)), (down, RowParallel(axis))]

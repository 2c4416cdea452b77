"""Megatron tensor parallelism for a Linen model you cannot edit: rules that name its submodules.

A rule is ``(pattern, role)``: ``pattern`` is searched (``re.search``) in a submodule's
path, as every rule of the library is (:mod:`fsdp_tp.rules`), and ``role`` (one of
:mod:`fsdp_tp.tp`, the same objects the NNX front end takes) says how that submodule
computes on its slices over a mesh axis. The Linen layers each role computes (:data:`LINEN`):

- :class:`~fsdp_tp.tp.ColumnParallel`, :class:`~fsdp_tp.tp.RowParallel`: ``nn.Dense``, ``nn.DenseGeneral``,
  ``nn.Conv`` (a convolution's channels are its features), ``nn.Einsum`` (a kernel letter
  of the output, or of the inputs only);
- :class:`~fsdp_tp.tp.HeadParallel`: ``nn.MultiHeadDotProductAttention`` (and ``nn.SelfAttention``);
- :class:`~fsdp_tp.tp.VocabParallel`: ``nn.Embed`` (``attend``, tied logits, gathers the vocabulary).

:func:`layer_of` shows a Linen layer to a role, :func:`local_attributes` writes the role's
local sizes as the layer's attributes (``features / size``, ``num_heads / size``).
Per attention or MLP block that is Megatron's minimum: one all-reduce forward (the row
sum), one backward (the column input's gradient; a gated MLP's gate and up share it inside
``shard_step``, :func:`fsdp_tp.tp.pieces.shared_column_inputs`). :func:`attention_rules` and
:func:`mlp_rules` are the ready sets; pass the rules to :func:`~fsdp_tp.shard_by_rules`
as ``tp_rules=``, next to its storage rules (FSDP splits another dim).

>>> from fsdp_tp.linen.tp_rules import attention_rules, mlp_rules
>>> [(pattern, type(role).__name__) for pattern, role in mlp_rules(r"mlp/up$", r"mlp/down$")]
[('mlp/up$', 'ColumnParallel'), ('mlp/down$', 'RowParallel')]
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax.core import meta

from .. import tp as _tp  # (the roles by the package: a name of their own here would be an old path)
from .._aliases import aliases_of
from .._axes import TENSOR
from .._tree import module_path
from ..tp import Layer
from ..tp._front import Equation, Kinds, Local, computes_of, dims

__all__ = [
    "LINEN",
    "attention_rules",
    "layer_of",
    "local_attributes",
    "mlp_rules",
]

__getattr__ = aliases_of(__name__)  # 0.2 re-exported the roles here (fsdp_tp._aliases)

LINEN = Kinds(
    "nn",
    {
        "dense": (nn.Dense, nn.DenseGeneral),
        "conv": (nn.Conv,),
        "einsum": (nn.Einsum,),
        "attention": (nn.MultiHeadDotProductAttention,),
        "embed": (nn.Embed,),
    },
)


def layer_of(module: nn.Module, args: tuple, kwargs: dict) -> Layer:
    """``module`` (a Linen layer of one of :data:`LINEN`'s kinds, called with ``args``) as a role sees it."""
    kind = LINEN.of(type(module))
    path = module_path(module.path) or type(module).__name__
    common: dict[str, Any] = {"kind": kind, "path": path, "dtype": getattr(module, "dtype", None)}
    if kind is None:  # a module of the user's whose parameters its role names (Region)
        return Layer(**common | {"kind": "module"})
    if kind in ("dense", "conv"):
        axis = dims(getattr(module, "axis", -1))
        return Layer(
            **common,
            features=dims(module.features),
            contracted=len(axis),
            in_size=(args[0] if args else kwargs["inputs"]).shape[axis[0]],
            groups=getattr(module, "feature_group_count", 1),
            use_bias=module.use_bias,
            bias=lambda: meta.unbox(module.get_variable("params", "bias")),
        )
    if (own := computes_of(type(module))) is not None:  # a class of the user's: its sizes held
        held = own.held(module, path)
        letters = Equation.parse(own.equation, path).kernel
        shape = tuple(held.get(c, 0) for c in letters)
        return Layer(**common, equation=own.equation, kernel_shape=shape, parameters=(own.kernel,))
    if kind == "einsum":  # the equation is the module's or, when it has none, the call's
        equation = module.einsum_str or (args[1] if len(args) > 1 else kwargs.get("einsum_str"))
        return Layer(
            **common,
            equation=equation or "",
            kernel_shape=tuple(module.shape),
            use_bias=module.use_bias,
            bias=lambda: meta.unbox(module.get_variable("params", "bias")),
        )
    if kind == "attention":
        return Layer(**common, num_heads=module.num_heads)  # (no kv heads of its own: no grouping)
    return Layer(**common, num_embeddings=module.num_embeddings)


def local_attributes(module: nn.Module, local: Local, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A role's local sizes (:class:`~fsdp_tp.tp._role.Local`) as ``module``'s attributes (its
    ``read`` is :mod:`~fsdp_tp.linen._local_compute`'s, around the call)."""
    out: dict[str, Any] = {}
    if local.use_bias is not None:
        out["use_bias"] = local.use_bias
    if local.num_embeddings is not None:
        out["num_embeddings"] = local.num_embeddings
    if local.kernel_shape is not None and (own := computes_of(type(module))) is not None:
        out |= own.attributes(local.kernel_shape)
    elif local.kernel_shape is not None:
        out["shape"] = local.kernel_shape
    if local.features is not None:
        out["features"] = local.features if isinstance(module.features, tuple | list) else local.features[0]
    if local.num_heads is not None:
        inputs_q = args[0] if args else kwargs["inputs_q"]
        qkv = module.qkv_features or inputs_q.shape[-1]
        out["num_heads"] = local.num_heads
        out["qkv_features"] = qkv * local.num_heads // module.num_heads
        out["out_features"] = module.out_features or inputs_q.shape[-1]
    return out


def attention_rules(pattern: str = r"MultiHeadDotProductAttention_\d+$", axis: str = TENSOR):
    """The ready rule set for Flax's ``nn.MultiHeadDotProductAttention``: head-parallel.

    >>> [(pattern, role)] = attention_rules()
    >>> pattern
    'MultiHeadDotProductAttention_\\\\d+$'
    >>> role
    HeadParallel(axis='tensor', sequence_dim=None, replicated_kv=False, collective_matmul=None)
    """
    return [(pattern, _tp.HeadParallel(axis))]


def mlp_rules(up: str | None = None, down: str | None = None, axis: str = TENSOR):
    """The ready rule set for a Dense-Dense MLP: ``up`` column-parallel, ``down`` row-parallel
    (the activation between them is elementwise, so it runs on the feature slices). Name the
    MLP's two layers by path: a pattern as wide as ``Dense_0$`` would also split every other
    ``Dense_0`` of the model (a projection, a head), which is not followed by its row layer.

    >>> [type(role).__name__ for _, role in mlp_rules(r"mlp/Dense_0$", r"mlp/Dense_1$")]
    ['ColumnParallel', 'RowParallel']
    """
    if up is None or down is None:
        raise TypeError(
            f"mlp_rules(up={up!r}, down={down!r}): name the MLP's two layers by path, e.g. "
            f"mlp_rules(r'mlp/Dense_0$', r'mlp/Dense_1$') or, for blocks named layer_0, layer_1, "
            f"mlp_rules(r'layer_\\d+/Dense_0$', r'layer_\\d+/Dense_1$'); 'Dense_0$' alone would match "
            f"every Dense_0 of the model."
        )
    return [(up, _tp.ColumnParallel(axis)), (down, _tp.RowParallel(axis))]

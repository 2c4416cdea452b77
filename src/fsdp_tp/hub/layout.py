"""How the decoder (:mod:`fsdp_tp.hub.decoder`) is laid out on a mesh, as rules: Megatron's plan
and a mixture's experts (:func:`tp_rules`), FSDP's storage (:func:`fsdp_rules`). A rule only for
what the config has: a dense MLP's where some layer is dense, the experts' where some layer
mixes (a rule matching nothing is a warning).

>>> from fsdp_tp.hub.config import DecoderConfig
>>> [pattern for pattern, _ in tp_rules(DecoderConfig(64, 32, 4, 2, 8, 48, 2))][:3]
['embed$', 'attn/(q|k|v)$', 'attn/out$']
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from ..models.moe import expert_rules
from ..tp import ColumnParallel, RowParallel, VocabParallel
from .config import DecoderConfig

__all__ = ["fsdp_rules", "tp_rules"]


def tp_rules(
    config: DecoderConfig, gather_logits: bool = False, sizes: Mapping[str, int] | None = None
) -> list:
    """The Megatron plan: heads over ``tensor`` (q, k, v column-parallel on their heads, the
    output einsum row-parallel), the MLP's gate and up column-, down row-parallel, the
    embedding (so a tied head) by vocabulary, an untied head column-parallel: its logits split
    on the vocabulary for :func:`~fsdp_tp.vocab_parallel_cross_entropy`, or whole where
    ``gather_logits`` (for a loss that reads them whole, as ``check_sharded``'s twin does).
    A mixture's experts by the mesh's axis ``sizes`` (:func:`~fsdp_tp.models.moe.expert_rules`:
    over ``expert``, each one's hidden dim over ``tensor``); its router whole. Given ``sizes``,
    only what they split: no Megatron rule where ``tensor`` is 1 (nothing at all where ``expert``
    is 1 too); left out, the plan for a ``tensor`` axis that splits and no ``expert`` axis.

    >>> tp_rules(DecoderConfig(64, 32, 4, 2, 8, 48, 2), sizes={"fsdp": 8, "tensor": 1})
    []
    """
    sizes = {"tensor": 2} if sizes is None else sizes
    megatron = sizes.get("tensor", 1) > 1
    rules = [
        (r"embed$", VocabParallel()),
        (r"attn/(q|k|v)$", ColumnParallel()),
        (r"attn/out$", RowParallel()),
        (r"mlp/(gate|up)$", ColumnParallel()),
        (r"mlp/down$", RowParallel()),
    ]
    rules = (rules if _dense(config) else rules[:3]) if megatron else []
    if config.moe_layers:
        rules += expert_rules(sizes)
    head = megatron and not config.tied
    return [*rules, (r"head$", ColumnParallel(gather_output=gather_logits))] if head else rules


def fsdp_rules(config: DecoderConfig, axes: str | tuple[str, ...] = "fsdp") -> list:
    """Storage rules for FSDP over ``axes`` (``("fsdp", "context")`` where the sequence is split
    too): each kernel on its model dim ``D``, the dim :func:`tp_rules` leave whole, the
    embedding on its model dim (its vocabulary goes over ``tensor``); norms and biases stay
    replicated.

    >>> fsdp_rules(DecoderConfig(64, 32, 4, 2, 8, 48, 2))[0]
    ('attn/(q|k|v)/kernel$', P('fsdp',))
    """
    rules = [
        (r"attn/(q|k|v)/kernel$", P(axes)),
        (r"attn/out/kernel$", P(None, axes) if config.dense else P(None, None, axes)),
        (r"mlp/(gate|up)/kernel$", P(axes)),
        (r"mlp/down/kernel$", P(None, axes)),
        (r"embedding$", P(None, axes)),
    ]
    rules = rules if _dense(config) else [rule for rule in rules if "mlp/" not in rule[0]]
    if config.moe_layers:  # (each expert's kernel on its model dim: the one its split leaves)
        rules += [
            (r"experts/(gate|up)/kernel$", P(None, axes)),
            (r"experts/down/kernel$", P(None, None, axes)),
        ]
    if config.scan:  # (a scanned decoder's blocks: the leading layer dim whole, each layer split alike)
        rules = [(p, spec if p == r"embedding$" else P(None, *spec)) for p, spec in rules]
    return rules if config.tied else [*rules, (r"head/kernel$", P(axes))]


def _dense(config: DecoderConfig) -> bool:
    """Whether some layer's MLP is dense (so the dense MLP's rules match something)."""
    return len(config.moe_layers) < config.layers

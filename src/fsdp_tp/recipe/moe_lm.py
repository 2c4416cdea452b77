"""``fsdp-tp train --experts E``: the mixture-of-experts LM (:mod:`fsdp_tp.models.moe`) of a
:class:`~fsdp_tp.recipe.config.ModelConfig`, laid out by rules on the CLI's mesh.

The plan, by mesh axis (each only where its size is above 1):

- ``expert``: the experts' einsums split on their expert letter
  (:class:`~fsdp_tp.tp.ExpertParallel`); ``expert`` also splits the batch, and tokens reach
  their experts by ``all_to_all``;
- ``tensor``: Megatron's attention (query heads and kv heads split, the output projection
  summed), the tied embedding split on its vocabulary, the dense MLPs of the layers without
  experts column then row, and each expert's hidden dim split the same way (gate and up
  column, down row): on the experts' devices where ``expert`` holds them
  (``ExpertParallel(within=...)``), else on every device;
- ``fsdp``: every kernel and the embedding stored split on its model dim (the one no role
  splits) and gathered per layer.

Both APIs start from the Linen twin's init (NNX's ``blocks/i`` is Linen's ``block_i``) and
train its numbers: ``--check N`` compares them.

>>> from fsdp_tp.recipe.config import preset
>>> storage, tp = moe_rules({"data": 2, "expert": 2, "tensor": 2})
>>> [pattern for pattern, _ in tp][-2:]
['experts/(gate|up)$', 'experts/down$']
>>> type(tp[-1][1].within).__name__, tp[-1][1].within.axis, storage
('RowParallel', 'tensor', [])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..linen.rule_transform import shard_by_rules as linen_shard_by_rules
from ..models.llama import FSDP_RULES, RULES
from ..models.moe import EXPERTS_FSDP, MoELM, NNXMoELM, expert_rules
from ..nnx import shard_by_rules as nnx_shard_by_rules
from ..precision import MixedPrecision
from ..train import state_init_fn
from .config import ModelConfig

__all__ = ["linen_path", "moe_loss", "moe_rules", "nnx_moe_maker", "sharded_moe_parts"]


def moe_rules(sizes: Mapping[str, int], dense: bool = False) -> tuple[list, list]:
    """``(storage rules, tp rules)`` of the MoE LM on a mesh of axis ``sizes`` (see the module);
    ``dense``: some layers hold a dense MLP (``moe_every`` > 1), whose rules then join."""
    keep = lambda rules: [(pattern, x) for pattern, x in rules if dense or "mlp/" not in pattern]
    tp = [*(keep(RULES) if sizes.get("tensor", 1) > 1 else []), *expert_rules(sizes)]
    storage = [*keep(FSDP_RULES), *EXPERTS_FSDP] if sizes.get("fsdp", 1) > 1 else []
    return storage, tp


def moe_loss(out: tuple, targets: jax.Array) -> jax.Array:
    """The MoE LM's training loss: mean next-token cross-entropy of its (whole) logits, in f32 or
    wider whatever the compute dtype, plus its blocks' weighted load-balancing and z-losses."""
    logits, aux = out
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # (a bf16 loss: 0.03 a step)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean() + aux


def linen_path(path: tuple) -> tuple:
    """An NNX MoE LM parameter's path as the Linen twin names it: ``("blocks", 3, ...)`` is
    ``("block_3", ...)``.

    >>> linen_path(("blocks", 3, "moe", "router", "kernel"))
    ('block_3', 'moe', 'router', 'kernel')
    """
    if len(path) > 1 and path[0] == "blocks":
        return (f"block_{path[1]}", *path[2:])
    return tuple(path)


def nnx_moe_maker(config: ModelConfig) -> Callable[[nnx.Rngs], NNXMoELM]:
    """``make(rngs)``: the NNX MoE LM holding the Linen twin's init from the rng stream's key,
    each value carried over by its path (as :func:`fsdp_tp.recipe.nnx_gpt.nnx_maker` does for
    the GPT: NNX draws its initializers from other streams)."""
    sizes, twin = config.moe_sizes(), config.model()

    def make(rngs: nnx.Rngs) -> NNXMoELM:
        model = NNXMoELM(rngs, dtype=jnp.dtype(config.dtype), remat=config.remat, **sizes)
        linen = twin.init(rngs.default.key[...], jnp.zeros((1, config.seq_len), jnp.int32))["params"]
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            value = linen
            for key in linen_path(path):
                value = value[key]
            variable.set_value(value.reshape(variable.get_raw_value().shape))
        return model

    return make


def sharded_moe_parts(
    config: ModelConfig,
    api: str,
    sizes: Mapping[str, int],
    batch_axes: tuple,
    tx: optax.GradientTransformation,
    mixed_precision: MixedPrecision | None = None,
) -> tuple[Callable, Callable, Callable | None]:
    """``(init_fn, logits, twin_init_fn)`` of the MoE LM of ``config`` in ``api`` on a mesh of
    ``sizes``, as :class:`~fsdp_tp.recipe.trainer.ShardedGPT` holds them; ``logits(params,
    ids[, positions])`` returns ``(logits, aux)``; ``batch_axes``: the step's (the sequence's
    axis among them under a split: the load balance and the gathers' means over it too)."""
    storage, tp = moe_rules(sizes, dense=config.moe_every > 1)
    if api == "nnx":
        make = nnx_moe_maker(config)
        sharded = nnx_shard_by_rules(
            make, storage, tp_rules=tp, batch_axes=batch_axes, mixed_precision=mixed_precision
        )
        init = sharded.state_init_fn(tx)
        return (lambda rng, _ids: init(rng)), (lambda p, ids, *at: sharded.merge(p)(ids, *at)), None
    model = linen_shard_by_rules(
        MoELM, storage, batch_axes=batch_axes, mixed_precision=mixed_precision, tp_rules=tp
    )(config.moe_sizes(), dtype=jnp.dtype(config.dtype), remat=config.remat)
    logits = lambda p, ids, *at: model.apply({"params": p}, ids, *at)  # (at: the tokens' positions)
    return state_init_fn(model, tx), logits, state_init_fn(config.model(), tx)

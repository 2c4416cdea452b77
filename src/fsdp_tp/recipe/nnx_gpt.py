"""``fsdp-tp train --api nnx``: the GPT written in NNX, started from the Linen GPT's init and
laid out by rules, so that both APIs train the same numbers from the same seed."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from ..models.nnx_transformer import NNXTransformer, storage_rules, tp_rules
from ..nnx import ShardedModel, find_tp_rules, shard_by_rules
from ..precision import MixedPrecision
from ..tp.auto import TPPlan
from .config import ModelConfig

__all__ = ["found_plan", "nnx_maker", "sharded_gpt"]


def nnx_maker(config: ModelConfig) -> Callable[[nnx.Rngs], NNXTransformer]:
    """``make(rngs)`` for :func:`fsdp_tp.nnx.shard_by_rules`: the NNX GPT of ``config``, its
    parameters the Linen twin's init from the rng stream's key.

    NNX draws its initializers from streams that Linen does not (``rngs.params()`` folds a
    count into the key), so the model's own init would differ from Linen's for the same seed.
    Linen's ``init`` takes the key itself; ``nnx.Rngs(key)``'s stream holds that key, and the
    two models hold the same parameter tree, so each value is carried over by its path (the
    attention kernels reshaped: Linen's ``(d, heads * dim)`` is ``(d, heads, dim)`` here).

    >>> import jax
    >>> from flax import nnx
    >>> from fsdp_tp.recipe.config import preset
    >>> config = preset("tiny", num_layers=1)
    >>> nnx_params = nnx.state(nnx_maker(config)(nnx.Rngs(jax.random.key(3))), nnx.Param)
    >>> linen = config.model().init(jax.random.key(3), jax.numpy.zeros((1, 8), int))["params"]
    >>> bool((nnx_params["head"]["kernel"][...] == linen["head"]["kernel"]).all())
    True
    """
    twin = config.model()
    sizes = config.model_sizes()

    def make(rngs: nnx.Rngs) -> NNXTransformer:
        model = NNXTransformer(**sizes, rngs=rngs)
        linen = twin.init(rngs.default.key[...], jnp.zeros((1, config.seq_len), jnp.int32))["params"]
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            value = linen
            for key in path:
                value = value[key]
            variable.set_value(value.reshape(variable.get_raw_value().shape))  # (d, h * k) -> (d, h, k)
        return model

    return make


def abstract_gpt(config: ModelConfig) -> NNXTransformer:
    """The NNX GPT of ``config``, abstract, on the reference attention (its parameters are
    every implementation's)."""
    reference = dict(config.model_sizes(), attention="reference")
    return nnx.eval_shape(lambda: NNXTransformer(**reference, rngs=nnx.Rngs(0)))


def found_plan(config: ModelConfig, sizes: Mapping[str, int], abstract: nnx.Module | None = None) -> TPPlan:
    """Megatron's plan of the NNX GPT over ``tensor`` (of ``sizes``), found from what it
    computes: its logits left split for the vocab-parallel loss. tests/test_auto_tp.py proves
    it is :func:`~fsdp_tp.models.nnx_transformer.tp_rules` on tensor 2 and 4 (kv heads kept).
    Found on the reference attention's einsums: where the splits go does not depend on the
    implementation, and a fused kernel (cuDNN's) is one operation the trace cannot see into.
    ``abstract``: that model, when the caller has built it (:func:`abstract_gpt`)."""
    abstract = abstract_gpt(config) if abstract is None else abstract
    ids = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    return find_tp_rules(abstract, ids, size=sizes.get("tensor", 1), outputs_split=True)


def run_plan(
    config: ModelConfig,
    sizes: Mapping[str, int],
    sequence_parallel: bool = False,
    collective_matmul: str | None = None,
    abstract: nnx.Module | None = None,
) -> tuple[TPPlan, bool]:
    """The tp rules an ``--api nnx`` run computes with, as a plan, and whether they are the plan
    found: where its roles (with sequence parallelism and rings) are the GPT's Megatron plan,
    the plan found; where they are not (heads the axis cuts, where the finder leaves a block
    whole), the GPT's hand-written rules, whose role refuses at init naming the sizes and the
    fix, as the Linen GPT's layers refuse them. What ``fsdp-tp plan --api nnx`` prints."""
    found = found_plan(config, sizes, abstract).scheduled(1 if sequence_parallel else None, collective_matmul)
    kept = config.num_kv_heads % sizes.get("tensor", 1) != 0
    megatron = tp_rules(sequence_parallel, kept, collective_matmul)
    if not found.differences(megatron):
        return found, True
    return TPPlan(tuple(megatron), {}, found.whole, found.layers), False


def sharded_gpt(
    config: ModelConfig,
    sizes: Mapping[str, int],
    min_weight_size: int,
    batch_axes: tuple,
    sequence_parallel: bool = False,
    collective_matmul: str | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ShardedModel:
    """The NNX GPT of ``config`` laid out on a mesh of ``sizes`` as the Linen GPT's layout
    lays it out: Megatron TP over ``tensor`` (where it has more than one device) by the rules
    of :func:`run_plan` (the plan :func:`~fsdp_tp.nnx.find_tp_rules` finds: kv heads kept
    whole where ``tensor`` does not divide them, as Linen's attention keeps them; the logits
    left split for the vocab-parallel loss), FSDP over ``fsdp`` where the Linen GPT has it
    (:func:`~fsdp_tp.models.nnx_transformer.storage_rules`), its gathers in
    ``mixed_precision``'s dtypes where given, as the Linen layout's."""
    make = nnx_maker(config)
    abstract = abstract_gpt(config)
    # On a tensor axis of one device no rule splits anything: none, as the Linen layout has no
    # Megatron layers there, so FSDP may split every dim.
    tensor = sizes.get("tensor", 1) > 1
    tp = run_plan(config, sizes, sequence_parallel, collective_matmul, abstract)[0].rules if tensor else ()
    rules = storage_rules(abstract, sizes, min_weight_size, tp)
    return shard_by_rules(make, rules, tp_rules=tp, batch_axes=batch_axes, mixed_precision=mixed_precision)

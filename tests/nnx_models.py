"""Flax NNX models written as flax's NNX examples write them, and the adapters that let the
equivalence checks (tests/equivalence.py) run the same invariants on them as on Linen models.

The checks call ``model.init(rng, x)["params"]`` and ``model.apply({"params": p}, x)``;
:class:`fsdp_tp.testing.NNXSharded` answers for a model laid out by
``fsdp_tp.nnx.shard_by_rules`` (per device, under ``jax.shard_map``) and
:class:`fsdp_tp.testing.NNXTwin` for the unsharded model the user's constructor builds: the
only place where the two front ends differ in the tests.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from fsdp_tp.tp import ColumnParallel, HeadParallel, RowParallel, VocabParallel


class Block(nnx.Module):
    """A residual Linear-gelu-Linear MLP with a LayerNorm, as flax's NNX examples write one."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class MLPStack(nnx.Module):
    """``layers`` blocks between an input and an output projection: a Python loop of blocks
    (``scan=False``), or one stacked block run by ``nnx.scan`` over ``nnx.remat``, created by
    ``nnx.vmap`` (the memory-minded way flax documents)."""

    def __init__(self, d_in: int, d: int, d_out: int, layers: int, *, scan: bool, rngs: nnx.Rngs):
        self.scan = scan
        self.embed = nnx.Linear(d_in, d, rngs=rngs)
        if scan:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return Block(d, rngs)

            self.blocks = stack(rngs)
        else:
            self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        if self.scan:

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            @nnx.remat
            def run(block, x):
                return block(x)

            x = run(self.blocks, x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(x)


def lm_maker(vocab, d_model, heads, layers, **options):
    """``make(rngs)`` for :class:`LM`, from the sizes tests/plain_models.PlainLM takes."""
    return lambda rngs: LM(vocab, d_model, heads, layers, rngs=rngs, **options)


class NormDropNet(nnx.Module):
    """Linear, BatchNorm, Dropout, Linear: mutable state (batch statistics, rng counts) that a
    step updates and returns."""

    def __init__(self, d_in: int, d: int, d_out: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_in, d, rngs=rngs)
        self.norm = nnx.BatchNorm(d, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.down = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(self.norm(self.up(x))))


class DecoderBlock(nnx.Module):
    """Pre-norm attention and a Linear-gelu-Linear MLP, each residual, as flax's NNX LM
    examples write a block (causal self-attention through ``nnx.MultiHeadAttention``)."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs, param_dtype=jnp.float32):
        at = dict(param_dtype=param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, **at)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, **at)
        self.ln2 = nnx.LayerNorm(d, **at)
        self.up = nnx.Linear(d, 4 * d, **at)
        self.down = nnx.Linear(4 * d, d, **at)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    """A decoder-only LM: embed, ``layers`` blocks (a Python loop, or one stacked block made by
    ``nnx.vmap`` and run by ``nnx.scan``, over ``nnx.remat`` unless ``remat=False``), a final
    norm and the logits: the NNX twin of tests/plain_models.PlainLM."""

    def __init__(
        self, vocab, d, heads, layers, *, scan=False, remat=True, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.scan, self.remat = scan, remat
        at = dict(param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(vocab, d, **at)
        if scan:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return DecoderBlock(d, heads, rngs, param_dtype)

            self.blocks = stack(rngs)
        else:
            self.blocks = nnx.List([DecoderBlock(d, heads, rngs, param_dtype) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, **at)
        self.logits = nnx.Linear(d, vocab, **at)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan:

            def body(block, x):
                return block(x)

            step = nnx.remat(body) if self.remat else body
            x = nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.logits(self.norm(x))


class NNXTiedLM(nnx.Module):
    """TiedLM in NNX: ``nnx.Embed.attend`` and ``nnx.LinearGeneral`` over two groups."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.up = nnx.LinearGeneral(16, (4, 8), rngs=rngs)
        self.down = nnx.LinearGeneral((4, 8), 16, axis=(-2, -1), rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(nnx.gelu(self.up(x)))
        return self.embed.attend(self.norm(x))


# Megatron's rules on this module's LM (the NNX twin of tests/plain_models.PlainLM, whose
# rules are plain_models.MEGATRON), on its own paths: the NNX cases run the same test bodies.
NNX_MEGATRON = [
    (r"attn$", HeadParallel()),
    (r"up$", ColumnParallel()),
    (r"down$", RowParallel()),
    (r"^embed$", VocabParallel()),
    (r"^logits$", ColumnParallel(gather_output=True)),
]


class NNXGatedLM(nnx.Module):
    """GatedLM in NNX."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 2, param_dtype=jnp.float32):
        dtype = dict(param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(32, 16, **dtype)
        self.norms = nnx.List([nnx.LayerNorm(16, **dtype) for _ in range(layers)])
        self.gates = nnx.List([nnx.Linear(16, 32, **dtype) for _ in range(layers)])
        self.ups = nnx.List([nnx.Linear(16, 32, **dtype) for _ in range(layers)])
        self.downs = nnx.List([nnx.Linear(32, 16, **dtype) for _ in range(layers)])
        self.final = nnx.LayerNorm(16, **dtype)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for norm, gate, up, down in zip(self.norms, self.gates, self.ups, self.downs, strict=True):
            h = norm(x)
            x = x + down(nnx.silu(gate(h)) * up(h))
        return self.embed.attend(self.final(x))

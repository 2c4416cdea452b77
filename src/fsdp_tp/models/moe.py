"""A mixture of experts in place of the MLP, in Linen and in NNX with the same parameter paths,
and the Llama-style language model built of it (:mod:`fsdp_tp.models.llama`'s attention).

The block (:class:`LinenMoE`, :class:`NNXMoE`): a router (``router``, a dense layer to E
logits), token-choice top-k (:mod:`fsdp_tp.routing`: every token's first choice before any
second, ties to the lower expert), the experts as gated einsums over kernels with an expert dim
(``experts/gate`` and ``experts/up`` ``(E, d, h)``, ``experts/down`` ``(E, h, d)``) applied to
buffers ``(groups, E, capacity, d)``, an optional shared expert (``shared``, a gated MLP every
token takes), the load-balancing loss and the router z-loss. A *group* is ``group_rows``
consecutive rows of the batch (default one sequence): routing and capacity are a group's, so
a device holding whole groups routes as the unsharded model does, on any mesh.
``capacity_factor=None`` is dropless (every choice reaches its expert).

The block returns ``(y, (load_balancing, z))``; the language model returns ``(logits, aux)``
with ``aux`` the weighted sum of its blocks' losses, the term a training loss adds. Its
``remat`` (a key of :data:`~fsdp_tp.models.remat.REMAT_POLICIES`, default ``"none"``) says
what each block keeps for the backward pass, as the GPT's does: the same function either way. The
load-balancing loss is the global batch's: the experts' shares of the choices are averaged
over the batch axes before the product (:func:`~fsdp_tp.routing.load_balancing_loss`).

>>> import jax, jax.numpy as jnp
>>> model = MoELM()
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> params = model.init(jax.random.key(0), tokens)["params"]
>>> params["block_0"]["moe"]["experts"]["gate"]["kernel"].shape   # (E, d, h)
(4, 16, 32)
>>> logits, aux = model.apply({"params": params}, tokens)
>>> logits.shape, aux.shape
((2, 8, 32), ())
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..tp import ColumnParallel, ExpertParallel, RowParallel
from ._mixture import MOE_SIZES, mixture, moe_fields, weighted
from .llama import NNXMLP, LinenAttention, LinenMLP, NNXAttention, rms_norm
from .remat import remat_policy

__all__ = ["EXPERTS_FSDP", "MOE_SIZES", "LinenMoE", "MoELM", "NNXMoE", "NNXMoELM", "expert_rules", "mixture"]

# FSDP on the experts' model dim: the one neither the expert split nor the hidden split takes.
EXPERTS_FSDP = [
    (r"experts/(gate|up)/kernel$", P(None, "fsdp")),
    (r"experts/down/kernel$", P(None, None, "fsdp")),
]


def expert_rules(sizes: Mapping[str, int]) -> list:
    """The tp rules of an expert bank (``experts/gate``, ``up``, ``down``) on a mesh of axis
    ``sizes``: the experts over ``expert`` where it is above 1 (tokens sent to them by
    ``all_to_all``), each expert's hidden dim over ``tensor`` where that is (gate and up
    column-, down row-parallel: on the experts' devices where both are).

    >>> [type(role).__name__ for _, role in expert_rules({"expert": 2, "tensor": 1})]
    ['ExpertParallel', 'ExpertParallel']
    >>> type(expert_rules({"expert": 2, "tensor": 2})[1][1].within).__name__
    'RowParallel'
    """
    over_tensor = sizes.get("tensor", 1) > 1
    column, row = (ColumnParallel(), RowParallel()) if over_tensor else (None, None)
    if sizes.get("expert", 1) > 1:
        return [
            (r"experts/(gate|up)$", ExpertParallel(within=column)),
            (r"experts/down$", ExpertParallel(returns=True, within=row)),
        ]
    return [(r"experts/(gate|up)$", column), (r"experts/down$", row)] if over_tensor else []


class LinenExperts(nn.Module):
    experts: int
    hidden: int
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None  # the computation's (None: the parameters')

    @nn.compact
    def __call__(self, x):  # (G, E, C, D)
        d, shape = x.shape[-1], (self.experts, x.shape[-1], self.hidden)
        kw = dict(param_dtype=self.param_dtype, dtype=self.dtype)
        gate = nn.Einsum(shape, "GECD,EDH->GECH", False, name="gate", **kw)(x)
        up = nn.Einsum(shape, "GECD,EDH->GECH", False, name="up", **kw)(x)
        down = nn.Einsum((self.experts, self.hidden, d), "GECH,EHD->GECD", False, name="down", **kw)
        return down(nn.silu(gate) * up)


class LinenMoE(nn.Module):
    """The Linen block: returns ``(y, (load_balancing, z))``."""

    experts: int = MOE_SIZES["experts"]
    top_k: int = MOE_SIZES["top_k"]
    hidden: int = MOE_SIZES["hidden"]
    capacity_factor: float | None = None
    group_rows: int = 1
    shared_hidden: int = 0
    normalize: bool = True
    batch_axes: tuple | None = None
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None  # the experts' computation's (None: the parameters'); the router's is f32 or wider

    @nn.compact
    def __call__(self, x):
        router = nn.Dense(self.experts, use_bias=False, param_dtype=self.param_dtype, name="router")
        experts = LinenExperts(self.experts, self.hidden, self.param_dtype, self.dtype, name="experts")
        y, losses = mixture(
            x, router, experts, k=self.top_k, capacity_factor=self.capacity_factor,
            group_rows=self.group_rows, normalize=self.normalize, batch_axes=self.batch_axes,
        )  # fmt: skip
        if self.shared_hidden:
            y = y + LinenMLP(self.shared_hidden, self.param_dtype, self.dtype, name="shared")(x)
        return y, losses


class LinenMoEBlock(nn.Module):
    sizes: dict
    mixed: bool
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None

    @nn.compact
    def __call__(self, x, positions=None):
        s, d, dtype, compute = self.sizes, x.shape[-1], self.param_dtype, self.dtype
        attn = LinenAttention(s["heads"], s["kv_heads"], s["head_dim"], dtype, compute, name="attn")
        x = x + attn(rms_norm(x, self.param("attn_norm", nn.initializers.zeros, (d,), dtype)), positions)
        h = rms_norm(x, self.param("mlp_norm", nn.initializers.zeros, (d,), dtype))
        if not self.mixed:
            return x + LinenMLP(s["hidden"], dtype, compute, name="mlp")(h), jnp.zeros((), jnp.float32)
        y, losses = LinenMoE(**moe_fields(s), param_dtype=dtype, dtype=compute, name="moe")(h)
        return x + y, weighted(losses)


class MoELM(nn.Module):
    """The Linen language model: Llama's blocks with the MoE in place of the MLP in every
    ``moe_every``-th one; returns ``(logits, aux)``."""

    sizes: dict | None = None
    param_dtype: jnp.dtype = jnp.float32
    dtype: Any = None  # the computation's (None: the parameters'; the routers' is f32 or wider)
    remat: str = "none"  # fsdp_tp.models.remat.REMAT_POLICIES: what each block keeps for the backward

    @nn.compact
    def __call__(self, tokens, positions=None):
        """``(logits, aux)`` of ``tokens`` (B, T); ``positions`` (B, T): each token's, with the
        batch (a sequence split's: the device's tokens' places in the whole sequence)."""
        s = {**MOE_SIZES, **(self.sizes or {})}
        policy = remat_policy(self.remat, "MoELM")
        block = LinenMoEBlock if self.remat == "none" else nn.remat(LinenMoEBlock, policy=policy)
        embed = nn.Embed(s["vocab"], s["d"], param_dtype=self.param_dtype, dtype=self.dtype, name="embed")
        x, aux = embed(tokens), jnp.zeros((), jnp.float32)
        for i in range(s["layers"]):
            mixed = i % s["moe_every"] == s["moe_every"] - 1
            x, more = block(s, mixed, self.param_dtype, self.dtype, name=f"block_{i}")(x, positions)
            aux = aux + more
        final = self.param("final_norm", nn.initializers.zeros, (s["d"],), self.param_dtype)
        return embed.attend(rms_norm(x, final)), aux


class NNXExperts(nnx.Module):
    def __init__(self, d, experts, hidden, *, rngs, param_dtype=jnp.float32, dtype=None):
        up_shape, down_shape = (experts, d, hidden), (experts, hidden, d)
        kw = dict(param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.gate = nnx.Einsum("GECD,EDH->GECH", up_shape, **kw)
        self.up = nnx.Einsum("GECD,EDH->GECH", up_shape, **kw)
        self.down = nnx.Einsum("GECH,EHD->GECD", down_shape, **kw)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class NNXMoE(nnx.Module):
    """The NNX block, with :class:`LinenMoE`'s parameter paths: returns ``(y, (load_balancing, z))``."""

    def __init__(
        self, d, experts, top_k, hidden, *, rngs, capacity_factor=None, group_rows=1, shared_hidden=0,
        normalize=True, batch_axes=None, param_dtype=jnp.float32, dtype=None,
    ):  # fmt: skip
        self.router = nnx.Linear(d, experts, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.experts = NNXExperts(d, experts, hidden, **kw)
        self.shared = NNXMLP(d, shared_hidden, **kw) if shared_hidden else None
        self.top_k, self.capacity_factor, self.group_rows = top_k, capacity_factor, group_rows
        self.normalize, self.batch_axes = normalize, batch_axes

    def __call__(self, x):
        y, losses = mixture(
            x, self.router, self.experts, k=self.top_k, capacity_factor=self.capacity_factor,
            group_rows=self.group_rows, normalize=self.normalize, batch_axes=self.batch_axes,
        )  # fmt: skip
        return (y + self.shared(x) if self.shared is not None else y), losses


class NNXMoEBlock(nnx.Module):
    def __init__(self, s: dict, mixed: bool, *, rngs, param_dtype=jnp.float32, dtype=None):
        d, kw = s["d"], dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.attn_norm = nnx.Param(jnp.zeros((d,), param_dtype))
        self.attn = NNXAttention(d, s["heads"], s["kv_heads"], s["head_dim"], **kw)
        self.mlp_norm = nnx.Param(jnp.zeros((d,), param_dtype))
        if mixed:
            self.moe = NNXMoE(d, **moe_fields(s), **kw)
        else:
            self.mlp = NNXMLP(d, s["hidden"], **kw)
        self.mixed = mixed

    def __call__(self, x, positions=None):
        x = x + self.attn(rms_norm(x, self.attn_norm[...]), positions)
        h = rms_norm(x, self.mlp_norm[...])
        if not self.mixed:
            return x + self.mlp(h), jnp.zeros((), jnp.float32)
        y, losses = self.moe(h)
        return x + y, weighted(losses)


class NNXMoELM(nnx.Module):
    """The NNX language model, with :class:`MoELM`'s parameter paths but ``blocks/i`` for
    ``block_i`` (as :class:`~fsdp_tp.models.llama.NNXLlamaLM`)."""

    def __init__(self, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None, remat="none", **sizes):
        s = {**MOE_SIZES, **sizes}
        remat_policy(remat, "NNXMoELM")
        self.remat = remat
        self.embed = nnx.Embed(s["vocab"], s["d"], param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        every = s["moe_every"]
        blocks = [
            NNXMoEBlock(s, i % every == every - 1, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
            for i in range(s["layers"])
        ]
        self.blocks = nnx.List(blocks)
        self.final_norm = nnx.Param(jnp.zeros((s["d"],), param_dtype))

    def __call__(self, tokens, positions=None):
        x, aux = self.embed(tokens), jnp.zeros((), jnp.float32)
        run = lambda block, x, positions: block(x, positions)
        if self.remat != "none":
            run = nnx.remat(run, policy=remat_policy(self.remat, "NNXMoELM"))
        for block in self.blocks:
            x, more = run(block, x, positions)
            aux = aux + more
        return self.embed.attend(rms_norm(x, self.final_norm[...])), aux

"""Issue 57: every tensor-parallel plan is checked against what the model computes before
anything trains.

Attention as people write it (q, k, v as dense layers, then a reshape to heads), under
Megatron's rules or ``tp_rules="auto"``, Linen and NNX, on data 2 x tensor 4: each way of
writing it is either refused before the first step, the error naming the operation and its
line in this file, or equal to the unsharded model (outputs and synced gradients, float64).
Negative control: with the check switched off, every refused case trains another model (the
equality catches it), so the refusals are not a check's caution but real differences.
"""

from __future__ import annotations

import inspect
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp import ColumnParallelDense, RowParallelDense
from fsdp_tp._check.driver import switched_off
from fsdp_tp.errors import LayerLeftWholeWarning, RuleError, UncheckedPlanWarning
from fsdp_tp.testing import check_sharded
from fsdp_tp.tp import ColumnParallel, RowParallel, VocabParallel
from tests.equivalence import check_split
from tests.refusals import named_fix, role_named

D, HEADS = 32, 4  # model width and heads: 8 features a head, 2 heads a device on tensor 4
X = (4, 6, D)  # (batch, sequence, features)
RULES = [(r"^(q|k|v)$", ColumnParallel()), (r"^out$", RowParallel())]
FUSED_RULES = [(r"^qkv$", ColumnParallel()), (r"^out$", RowParallel())]


# How each writes q (b, s, d) as heads (b, s, heads, head dim), and what comes between the
# projection and the heads. A comment "refused" marks the line the check must name.
def heads_by_count(x):
    b, s, _ = x.shape
    return x.reshape(b, s, HEADS, -1)  # refused: regroups a device's features into every head


def heads_by_width(x):
    b, s, _ = x.shape
    return x.reshape(b, s, -1, D // HEADS)


def heads_from_shape(x):
    return x.reshape(*x.shape[:-1], -1, D // HEADS)


def heads_by_both_sizes(x):
    b, s, _ = x.shape
    return x.reshape(b, s, HEADS, D // HEADS)  # refused: fails on a device's slice


def head_width_from_the_features(x):
    b, s, features = x.shape
    return x.reshape(b, s, -1, features // HEADS)  # refused: the device's features, not the model's


def heads_first_by_width(x):  # einops' "b s (h d) -> b h s d", then back to (b, s, h, d)
    b, s, _ = x.shape
    return x.reshape(b, s, -1, D // HEADS).transpose(0, 2, 1, 3).transpose(0, 2, 1, 3)


def heads_first_by_count(x):
    b, s, _ = x.shape
    return x.reshape(b, s, HEADS, -1).transpose(0, 2, 1, 3).transpose(0, 2, 1, 3)  # refused


def normalized(x):  # an RMS norm over q's features before the heads
    return heads_by_width(x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6))  # refused


def softmaxed(x):
    return heads_by_width(jax.nn.softmax(x, axis=-1))  # refused: a max over split features


def flipped(x):
    return heads_by_width(x[..., ::-1])  # refused: reverses each device's block, not the whole


WAYS = {
    "heads_by_count": heads_by_count,
    "heads_by_width": heads_by_width,
    "heads_from_shape": heads_from_shape,
    "heads_by_both_sizes": heads_by_both_sizes,
    "head_width_from_the_features": head_width_from_the_features,
    "heads_first_by_width": heads_first_by_width,
    "heads_first_by_count": heads_first_by_count,
    "normalized": normalized,
    "softmaxed": softmaxed,
    "flipped": flipped,
    "fused_qkv_split": None,  # GPT-2's c_attn: one projection, then jnp.split (below)
}


def attend(q, k, v):
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(*out.shape[:2], -1)


def split_fused(qkv):
    return [heads_by_width(t) for t in jnp.split(qkv, 3, axis=-1)]  # refused: cuts split features


def _linen(way: str) -> type[nn.Module]:
    class LinenAttention(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = lambda width, name: nn.Dense(width, param_dtype=jnp.float64, name=name)
            if way == "fused_qkv_split":
                q, k, v = split_fused(dense(3 * D, "qkv")(x))
            else:
                q, k, v = (WAYS[way](dense(D, name)(x)) for name in ("q", "k", "v"))
            return dense(D, "out")(attend(q, k, v))

    return LinenAttention


def _layers(way: str) -> type[nn.Module]:
    """The same attention of the Linen Megatron layers, written by hand (its twin: ``nn.Dense``)."""

    class LayersAttention(nn.Module):
        sharded: bool = True

        @nn.compact
        def __call__(self, x):
            column, row = (ColumnParallelDense, RowParallelDense) if self.sharded else (nn.Dense, nn.Dense)
            dense = lambda kind, width, name: kind(width, param_dtype=jnp.float64, name=name)
            if way == "fused_qkv_split":
                q, k, v = split_fused(dense(column, 3 * D, "qkv")(x))
            else:
                q, k, v = (WAYS[way](dense(column, D, name)(x)) for name in ("q", "k", "v"))
            return dense(row, D, "out")(attend(q, k, v))

    return LayersAttention


def _nnx(way: str):
    class NNXAttention(nnx.Module):
        def __init__(self, rngs):
            dense = lambda width: nnx.Linear(D, width, param_dtype=jnp.float64, rngs=rngs)
            if way == "fused_qkv_split":
                self.qkv = dense(3 * D)
            else:
                self.q, self.k, self.v = dense(D), dense(D), dense(D)
            self.out = dense(D)

        def __call__(self, x):
            if way == "fused_qkv_split":
                q, k, v = split_fused(self.qkv(x))
            else:
                q, k, v = (WAYS[way](layer(x)) for layer in (self.q, self.k, self.v))
            return self.out(attend(q, k, v))

    return NNXAttention


def _refused_at(way: str) -> int | None:
    """The line of this file the check must name for ``way`` (``None``: equal to unsharded)."""
    source, first = inspect.getsourcelines(split_fused if way == "fused_qkv_split" else WAYS[way])
    marked = [first + i for i, line in enumerate(source) if "# refused" in line]
    return marked[0] if marked else None


def _model(api: str, way: str):
    return {"linen": _linen, "nnx": _nnx, "layers": _layers}[api](way)


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("api", ["linen", "nnx", "layers"])
def test_attention_as_people_write_it_is_refused_at_its_line_or_equal(api, way):
    """Hand rules, or the Linen Megatron layers in the model's own code (``"layers"``, checked at
    ``init_sharded``): refused naming the line, or equal to unsharded."""
    rules = FUSED_RULES if way == "fused_qkv_split" else RULES
    line = _refused_at(way)
    if line is None:
        check_split(api, _model(api, way), rules, X, check_vma=True)
        return
    with pytest.raises(RuleError, match=rf"test_plan_check\.py:{line} \(") as refused:
        check_split(api, _model(api, way), rules, X, check_vma=True)
    message = str(refused.value)
    assert "Fix:" in message and re.search(r"\bq\b|\bqkv\b", message), message


@pytest.mark.parametrize("way", [w for w in WAYS if w != "heads_by_both_sizes"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_auto_splits_attention_where_the_check_passes_else_leaves_it_whole_naming_the_line(api, way):
    """``tp_rules="auto"``: the plan found is checked where each device computes; a region the
    check refuses is left whole, the warning naming the line, and the model equals unsharded
    either way. (A reshape by both sizes fails on a device's slice: no region to blame, the
    hand rules' refusal above.)"""
    line = _refused_at(way)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", LayerLeftWholeWarning)
        _, specs = check_split(api, _model(api, way), "auto", X, check_vma=True)
    left = [str(w.message) for w in said if w.category is LayerLeftWholeWarning]
    projection = "qkv" if way == "fused_qkv_split" else "q"
    split = specs[projection]["kernel"]
    if line is None:
        assert not left and split == jax.sharding.PartitionSpec(None, "tensor"), (left, split)
    else:
        assert len(left) == 1 and f"test_plan_check.py:{line} (" in left[0], left
        assert split == jax.sharding.PartitionSpec(), split


REFUSED_AND_RUNNING = [w for w in WAYS if _refused_at(w) is not None and w != "heads_by_both_sizes"]


@pytest.mark.parametrize(
    ("api", "way"),
    [("linen", w) for w in REFUSED_AND_RUNNING] + [("layers", "heads_by_count"), ("layers", "softmaxed")],
)
def test_negative_control_unchecked_the_refused_ways_train_another_model(api, way):
    """With the check off, each refused way (but the one that cannot run on its slices) gives
    other outputs than the unsharded model: the check refuses real differences."""
    rules = FUSED_RULES if way == "fused_qkv_split" else RULES
    with switched_off(), pytest.raises(AssertionError, match="output"):
        check_split(api, _model(api, way), rules, X, check_vma=True)


def _left_whole(refused, rules: list) -> list:
    """``rules`` less those on the layers the refusal says to leave whole ("leave q whole
    together with k, v and out, ..."), applied as a user would: by the names it gives."""
    found = re.search(
        r"leave (\S+) whole(?: together with (.*?), the layers split with it)? \(", str(refused.value)
    )
    assert found, str(refused.value)
    names = [found[1], *(re.split(r", | and ", found[2]) if found[2] else [])]
    named_fix(refused, found[0])
    return [(pattern, role) for pattern, role in rules if not any(re.search(pattern, n) for n in names)]


@pytest.mark.parametrize(
    ("api", "way"),
    [("linen", w) for w in REFUSED_AND_RUNNING] + [("nnx", "heads_by_count"), ("nnx", "fused_qkv_split")],
)
def test_a_refusals_leave_whole_fix_is_accepted_and_equal(api, way):
    """Every refusal of a split region ends "or leave <layer> whole": applied by the names the
    message gives, the plan is accepted and equal to unsharded. A column layer left whole
    alone hands whole heads to the layers split with it, so the message names them (q with k,
    v and out; a fused qkv with out). Its first fix (the reshape, the norm after the sum)
    rewrites the model's code, which no test can do by the message; the ways that take it
    are the ones above that pass. The ``"layers"`` API writes its roles as classes in the
    model's code: leaving one whole is a code change too."""
    rules = FUSED_RULES if way == "fused_qkv_split" else RULES
    with pytest.raises(RuleError) as refused:
        check_split(api, _model(api, way), rules, X, check_vma=True)
    check_split(api, _model(api, way), _left_whole(refused, rules), X, check_vma=True)


def test_negative_control_leaving_the_refused_layer_alone_whole_is_refused_again():
    """The fix as it was worded ("leave q whole", q's rule dropped, the row layer's kept):
    refused again at the row layer, which expects the split features q, k and v no longer
    give."""
    with pytest.raises(RuleError, match=r"^out \(RowParallel\) takes the split features"):
        check_split("linen", _model("linen", "heads_by_count"), RULES[1:], X, check_vma=True)


def test_nnx_with_inputs_is_checked_at_init_before_any_step():
    """Explicit rules and ``inputs=``: the NNX plan is refused at ``init_sharded`` (no step is
    traced); without ``inputs=`` it is refused where the merged model is first called."""
    import optax

    import fsdp_tp
    import fsdp_tp.nnx

    make = _nnx("heads_by_count")
    mesh = fsdp_tp.make_mesh({"data": 2, "tensor": 4})
    with jax.enable_x64(True):
        x = jax.ShapeDtypeStruct(X, jnp.float64)
        sharded = fsdp_tp.nnx.shard_by_rules(make, tp_rules=RULES, batch_axes=("data",), inputs=(x,))
        init = sharded.state_init_fn(optax.sgd(0.1))
        with pytest.raises(
            RuleError, match=rf"test_plan_check\.py:{_refused_at('heads_by_count')} \("
        ) as refused:
            fsdp_tp.init_sharded(init, mesh, jax.sharding.PartitionSpec(), jax.random.key(0))
        left = _left_whole(refused, RULES)  # (the fix: every layer of the attention left whole)
        assert left == []
        whole = fsdp_tp.nnx.shard_by_rules(make, tp_rules=left, batch_axes=("data",))
        fsdp_tp.init_sharded(
            whole.state_init_fn(optax.sgd(0.1)), mesh, jax.sharding.PartitionSpec(), jax.random.key(0)
        )
        unchecked = fsdp_tp.nnx.shard_by_rules(make, tp_rules=RULES, batch_axes=("data",))
        fsdp_tp.init_sharded(unchecked.state_init_fn(optax.sgd(0.1)), mesh, jax.sharding.PartitionSpec(),
                             jax.random.key(0))  # fmt: skip


class StackedKV(nn.Module):
    """Gemma's attention: q by one einsum, k and v stacked in another and unpacked."""

    @nn.compact
    def __call__(self, x):
        einsum = lambda shape, eq, name: nn.Einsum(shape, eq, False, param_dtype=jnp.float64, name=name)
        q = einsum((D, HEADS, 8), "BTD,DNH->BTNH", "q")(x)
        k, v = einsum((2, D, 2, 8), "BSD,CDKH->CBSKH", "kv")(x)  # refused: C split, 1 of 2 here
        groups = q.reshape(*q.shape[:2], k.shape[-2], -1, 8)  # (query heads by kv head, from k's shape)
        weights = jax.nn.softmax(jnp.einsum("btkgh,bskh->bkgts", groups, k), -1)
        out = jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(q.shape)
        return einsum((HEADS, 8, D), "BTNH,NHD->BTD", "out")(out)


def test_an_einsum_role_that_takes_the_wrong_letter_names_the_letter_that_works():
    """``ColumnParallel()`` on the stacked kv einsum takes its first produced letter, the
    stacked k/v dim ``C``: the model fails on its slice (unpacking k, v), named at its line
    with the letters and the one the plan found from the model gives; that one is equal."""
    rules = [("q$", ColumnParallel()), ("kv$", ColumnParallel()), ("out$", RowParallel())]
    said = rf"test_plan_check\.py:{_refused_at_line(StackedKV)} .*kv: ColumnParallel\(\) splits letter 'C'"
    x = jax.random.normal(jax.random.key(2), X)
    prove = lambda: check_sharded(StackedKV(), (x, 0 * x), lambda out, y: jnp.mean((out - y) ** 2),
                                  {"data": 4, "tensor": 2}, tp_rules=rules, steps=1)  # fmt: skip
    with pytest.raises(
        RuleError, match=said + r".*the plan found gives ColumnParallel\(letter='K'\)"
    ) as refused:
        prove()
    rules[1] = ("kv$", role_named(refused, r"(?<=the plan found gives )ColumnParallel\(letter='K'\)"))
    prove()


def _refused_at_line(cls, marker: str = "# refused") -> int | None:
    source, first = inspect.getsourcelines(cls)
    return next((first + i for i, line in enumerate(source) if marker in line), None)


class UnknownBetween(nn.Module):
    """An MLP whose activation is a primitive the check does not know (bessel_i1e)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * D, param_dtype=jnp.float64, name="up")(x)
        h = jax.lax.bessel_i1e(h)  # unknown to the check: the plan is let through, said once
        return nn.Dense(D, param_dtype=jnp.float64, name="down")(h)


def test_a_plan_the_check_cannot_decide_runs_with_one_warning_naming_the_op():
    """The check does not know bessel_i1e: it accepts the plan with an UncheckedPlanWarning that
    names the primitive, its line and the proof to run, and that proof passes (it is elementwise)."""
    rules = [("^up$", ColumnParallel()), ("^down$", RowParallel())]
    line = _refused_at_line(UnknownBetween, "# unknown")
    x = jax.random.normal(jax.random.key(4), X)
    said = rf"bessel_i1e at tests/test_plan_check\.py:{line} .*check_sharded"
    with pytest.warns(UncheckedPlanWarning, match=said) as caught:
        check_sharded(UnknownBetween(), (x, 0 * x), lambda out, y: jnp.mean((out - y) ** 2),
                      {"data": 2, "tensor": 4}, tp_rules=rules, steps=1)  # fmt: skip
    assert {w.filename for w in caught} == {__file__}  # shown at the user's line, not the library's


def _scaled(x, eps):
    return jnp.asarray(eps, x.dtype) + x.astype(jnp.float32)  # eps converted first, then x


def test_an_operation_on_a_literal_made_a_value_does_not_shift_its_lines_pairs(monkeypatch):
    """Inside ``shard_map`` with ``check_vma`` jax 0.12 makes the ``1e-6`` of a bf16 RMS norm a
    value (``pvary``) and converts it by an operation the unsharded trace folds away: counted,
    it paired the norm's next convert with the wrong one, and the plan check refused the bf16
    MoE LM. Here ``optimization_barrier`` makes the literal a value on both jax lines; the
    device's convert of ``x`` must pair with the unsharded convert of ``x``. Negative control:
    counting the operations on literals pairs the literal's convert instead."""
    from fsdp_tp._trace import sites as _sites
    from fsdp_tp._trace.graph import Graph

    x = jnp.ones(4, jnp.bfloat16)
    reference = Graph.trace(lambda x: _scaled(x, 2.0), x)
    local = Graph.trace(lambda x: _scaled(x, jax.lax.optimization_barrier(2.0)), x)

    def converts_of_x(pairs):
        return {
            local.shapes[local.nodes[i].ins[0]]: reference.shapes[reference.nodes[r].ins[0]]
            for i, r in pairs.items()
            if local.nodes[i].prim == "convert_element_type"
        }

    assert converts_of_x(_sites.pair(local, reference)) == {(4,): (4,)}
    monkeypatch.setattr(_sites, "_on_literals", lambda graph: set())
    assert converts_of_x(_sites.pair(local, reference)) == {(): (4,)}


def _norm(x, scale):
    return x * (1 + scale)  # (an RMS norm's scale, read through a literal)


def test_a_parameter_an_initializer_makes_of_literals_is_paired_as_the_model_reads_it():
    """Linen's unsharded trace is its ``init``'s, where a norm's scale is ``ones``: made of
    literals alone, it was taken for a literal folded away, so ``1 + scale`` had no pair and
    the plan check warned it could not decide the sequence-parallel Llama's RMS norm. A device's
    trace reads the scale as the argument it is; each op of the norm pairs with its own.
    Negative control: without the parameters told apart, the norm's ops are left unpaired."""
    from fsdp_tp._trace import sites as _sites
    from fsdp_tp._trace.graph import Graph

    x = jnp.ones((2, 4))
    init = lambda x, scale: (_norm(x, scale), {"scale": scale})
    reference = Graph.trace_init(lambda x: init(x, jnp.ones(4)), x)
    local = Graph.trace(lambda p, x: _norm(x, p["scale"]), {"scale": jnp.ones(4)}, x)
    paired = lambda: {local.nodes[i].prim for i in _sites.pair(local, reference)}
    assert paired() == {node.prim for node in local.nodes} >= {"add", "mul"}
    reference.params.clear()
    assert "add" not in paired()


@pytest.mark.parametrize(
    ("sequence_parallel", "ring", "kv_heads", "scan"),
    [(True, "bidirectional", 2, True), (False, None, 1, False), (True, None, 1, True)],
)
def test_the_megatron_layers_check_passes_the_librarys_own_models(
    monkeypatch, sequence_parallel, ring, kv_heads, scan
):
    """No false refusal: the library's Linen transformer (its attention and MLP blocks, the
    vocabulary-parallel embedding and head; sequence parallel, rings, kv heads kept whole, a
    scan over layers), which the layers' check skips (the suite proves it equal), passes it
    when checked like a user's model. The check traced it (its two graphs)."""
    from fsdp_tp.linen import _layers_check
    from fsdp_tp.models import Layout, Transformer
    from tests.transformer_case import CONFIG

    traced = []
    graph = _layers_check._graph
    monkeypatch.setattr(_layers_check, "_library_model", lambda module: False)
    monkeypatch.setattr(_layers_check, "_graph", lambda *a: traced.append(a[3]) or graph(*a))
    layout = Layout("tensor", "fsdp", sequence_parallel, collective_matmul=ring, min_weight_size=0)
    config = {**CONFIG, "num_kv_heads": kv_heads}
    model = Transformer(**config, layout=layout, scan_layers=scan)
    ids = jnp.zeros((8, 8), jnp.int32)
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fsdp_tp.errors.ReplicatedParameterWarning)
        fsdp_tp.init_sharded(lambda r, x: model.init(r, x)["params"], mesh, (P(), P(("data", "fsdp"))),
                             jax.random.key(0), ids)  # fmt: skip
    assert [dict(m.shape)["tensor"] for m in traced][:2] == [2, 1], traced


def test_the_layers_check_sees_a_users_model_through_the_librarys_wrappers():
    """The user's attention of Megatron layers wrapped for FSDP (``shard_module_params``, a
    class of the library's module) is still the user's code: refused at its line."""
    model = fsdp_tp.shard_module_params(_layers("heads_by_count"), min_weight_size=64)()
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    said = rf"test_plan_check\.py:{_refused_at('heads_by_count')} \("
    with jax.enable_x64(True), pytest.raises(RuleError, match=said):
        x = jnp.ones((4, *X[1:]), jnp.float64)
        fsdp_tp.init_sharded(lambda r, x: model.init(r, x)["params"], mesh, (P(), P(("data", "fsdp"))),
                             jax.random.key(0), x)  # fmt: skip


# Sequence parallelism: between the layers each device holds its slice of the sequence, handed
# to the model's code by the library's own collective (the embedding's reduce-scatter). The
# model's code then often calls a jnp function JAX jits (jnp.roll, jnp.cumsum), whose traced
# body records no line of the model's: the check reads it at the line that calls it.
VOCAB, SEQUENCE = 16, 8
SEQUENCE_RULES = [
    ("^embed$", VocabParallel(sequence_dim=1)),
    ("^up$", ColumnParallel(sequence_dim=1)),
    ("^down$", RowParallel(sequence_dim=1)),
    ("^head$", ColumnParallel(sequence_dim=1, gather_output=True)),
]


def token_shift(x, positions):  # RWKV's: each position mixed with the one before it
    return x + jnp.roll(x, 1, axis=1)  # refused: rolls each device's slice of the sequence


def running_sum(x, positions):
    return jnp.cumsum(x, axis=1)  # refused: sums along each device's slice of the sequence


def positions_by_length(x, positions):  # learned positions, as many as the activations have
    return x + positions[: x.shape[1]]  # refused: the first rows, on every device


def feature_sum(x, positions):  # along the features, which every device holds whole here
    return jnp.cumsum(x, axis=-1)


SEQUENCE_WAYS = {f.__name__: f for f in (token_shift, running_sum, positions_by_length, feature_sum)}


def _sequence_lm(api: str, way: str):
    mix = SEQUENCE_WAYS[way]
    if api == "linen":

        class LinenLM(nn.Module):
            @nn.compact
            def __call__(self, ids):
                positions = self.param("positions", nn.initializers.normal(1.0), (SEQUENCE, D), jnp.float64)
                x = mix(nn.Embed(VOCAB, D, param_dtype=jnp.float64, name="embed")(ids), positions)
                dense = lambda width, name: nn.Dense(width, param_dtype=jnp.float64, name=name)
                x = x + dense(D, "down")(nn.gelu(dense(4 * D, "up")(x)))
                return dense(VOCAB, "head")(x)

        return LinenLM()

    class NNXLM(nnx.Module):
        def __init__(self, rngs):
            dense = lambda a, b: nnx.Linear(a, b, param_dtype=jnp.float64, rngs=rngs)
            self.embed = nnx.Embed(VOCAB, D, param_dtype=jnp.float64, rngs=rngs)
            self.positions = nnx.Param(jax.random.normal(rngs.params(), (SEQUENCE, D), jnp.float64))
            self.up, self.down, self.head = dense(D, 4 * D), dense(4 * D, D), dense(D, VOCAB)

        def __call__(self, ids):
            x = mix(self.embed(ids), self.positions[...])
            return self.head(x + self.down(nnx.gelu(self.up(x))))

    return NNXLM


def _prove_sequence_lm(api: str, way: str) -> None:
    ids = jax.random.randint(jax.random.key(5), (4, SEQUENCE), 0, VOCAB)
    loss = lambda logits, y: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1))
    check_sharded(_sequence_lm(api, way), (ids, ids), loss, {"data": 2, "tensor": 4},
                  tp_rules=SEQUENCE_RULES, steps=1)  # fmt: skip


@pytest.mark.parametrize("way", list(SEQUENCE_WAYS))
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_jitted_jnp_function_on_the_sequence_slices_is_refused_at_its_line_or_equal(api, way):
    """``jnp.roll`` and ``jnp.cumsum`` along the sequence a device holds a slice of are refused,
    naming the line that calls them (their traced bodies record none: read at the call) and
    where the sequence is whole; so are learned positions cut to a device's length, a slice
    the unsharded model does not make (the same rows on every device); along the features,
    whole there, the model equals unsharded."""
    if (line := _refused_at_line(SEQUENCE_WAYS[way])) is None:
        _prove_sequence_lm(api, way)
        return
    why = "each device makes the same" if way == "positions_by_length" else "dim 1 of"
    fix = "compute it where that dim is whole: a sequence split by the roles' sequence_dim"
    with pytest.raises(RuleError, match=rf"test_plan_check\.py:{line} \(.*{why} .*{fix}"):
        _prove_sequence_lm(api, way)


@pytest.mark.parametrize("way", [w for w in SEQUENCE_WAYS if w != "feature_sum"])
def test_negative_control_unchecked_a_jnp_function_on_the_sequence_slices_trains_another_model(way):
    with switched_off(), pytest.raises(AssertionError, match="output"):
        _prove_sequence_lm("linen", way)


class SlopesByHeads(nn.Module):
    """ALiBi's per-head slopes, cut to the heads q holds: on a device, the first heads' slopes."""

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        dense = lambda name: nn.Dense(D, param_dtype=jnp.float64, name=name)
        q, k, v = (heads_by_width(dense(name)(x)) for name in ("q", "k", "v"))
        slopes = self.param("slopes", nn.initializers.normal(1.0), (HEADS,), jnp.float64)
        distance = jnp.arange(s)[None, :] - jnp.arange(s)[:, None]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + slopes[: q.shape[2], None, None] * distance  # refused
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return dense("out")(out.reshape(b, s, -1))


def test_a_per_head_value_cut_to_a_devices_heads_is_refused_at_its_line():
    """``slopes[: q.shape[2]]`` is no operation unsharded and each device's first heads' slopes
    under the plan: refused at its line, with the fix; with the check off, another model."""
    x = jax.random.normal(jax.random.key(6), X)
    prove = lambda: check_sharded(SlopesByHeads(), (x, 0 * x), lambda out, y: jnp.mean((out - y) ** 2),
                                  {"data": 2, "tensor": 4}, tp_rules=RULES, steps=1)  # fmt: skip
    line = _refused_at_line(SlopesByHeads)
    said = rf"test_plan_check\.py:{line} .*each device makes the same \[1\] .*Fix: cut it"
    with pytest.raises(RuleError, match=said):
        prove()
    with switched_off(), pytest.raises(AssertionError, match="output"):
        prove()

"""Issue 84: ring attention over the ``context`` axis equals the unsharded attention, and sends
only the kv heads, the bytes the formulas say.

Each case compiles once (``_compiled``, cached per mesh and layout) and runs on several inputs:
document boundaries and padding are data, drawn by hypothesis, so the property costs one compile
per layout. The oracle is dense softmax attention over the whole sequence, written here in
float64, its mask the same rule (causal by token index; a document sees itself; 0 is padding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.analysis import parse_collectives
from fsdp_tp.context import (
    AttentionDropout,
    SequenceSplit,
    blocks_run,
    document_positions,
    ring_attention,
    ring_or_all_to_all,
)
from fsdp_tp.context import _ring as ring_module
from fsdp_tp.context import attention as across
from fsdp_tp.errors import IndivisibleShapeError, UnboundAxisNameError

B, D = 2, 4


DROP_KEY = jax.random.key(11)


def dense(q, k, v, segments, causal, dropout: AttentionDropout | None = None, window: int | None = None):
    """Softmax attention over the whole sequence, k and v repeated per query head (``dropout``:
    flax's, one ``bernoulli`` over the weights, the softmax's sum left whole; ``window``: the
    last ``window`` diagonals of the causal triangle, as transformers' sliding window)."""
    heads, groups, length = q.shape[2], k.shape[2], q.shape[1]
    k, v = jnp.repeat(k, heads // groups, axis=2), jnp.repeat(v, heads // groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.ones((1, length, length), bool)
    if causal:
        mask = jnp.tril(mask) & ~(jnp.tril(mask, -window) if window else jnp.zeros_like(mask))
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] != 0)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    total = p.sum(-1, keepdims=True)
    p = jnp.where(total > 0, p / jnp.where(total > 0, total, 1), 0)
    if dropout is not None:
        keep = jax.random.bernoulli(
            DROP_KEY, 1 - dropout.rate, (1, 1, *p.shape[2:]) if dropout.broadcast else p.shape
        )
        p = p * keep / (1 - dropout.rate)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@functools.cache
def _compiled(
    cp: int,
    balanced: bool,
    causal: bool,
    segmented: bool,
    check_vma: bool = True,
    strategy="ring",
    dropout=None,
    window=None,
):
    """The attention's output and its vjp on global arrays (laid out and back), jitted once."""
    mesh = fsdp_tp.make_mesh({"context": cp}, devices=jax.devices()[:cp])
    split, seq = SequenceSplit(balanced=balanced), P(None, "context")

    def attention(q, k, v, segments):
        options = dict(
            causal=causal, balanced=balanced, strategy=strategy, dropout=dropout, key=DROP_KEY, window=window
        )
        local = lambda q, k, v, s: across(q, k, v, s, **options)
        if not segmented:
            local = functools.partial(lambda f, q, k, v: f(q, k, v, None), local)
        specs = (seq,) * (4 if segmented else 3)
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=check_vma)
        laid = [split.to_devices(t, 1, cp) for t in (q, k, v, *([segments] if segmented else []))]
        return split.from_devices(run(*laid), 1, cp)

    @jax.jit
    def value_and_vjp(q, k, v, segments, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segments), q, k, v)
        return out, vjp(cotangent)

    return value_and_vjp


def _inputs(length: int, heads: int, groups: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, length, heads, D), jnp.float64)
    k, v = (jax.random.normal(key, (B, length, groups, D), jnp.float64) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape, jnp.float64)


def _equal(
    cp,
    balanced,
    causal,
    heads,
    groups,
    segments=None,
    check_vma=True,
    strategy="ring",
    dropout=None,
    window=None,
):
    length = segments.shape[1] if segments is not None else 8 * cp
    q, k, v, cotangent = _inputs(length, heads, groups)
    run = _compiled(cp, balanced, causal, segments is not None, check_vma, strategy, dropout, window)
    out, grads = run(q, k, v, segments, cotangent)
    want, vjp = jax.vjp(lambda q, k, v: dense(q, k, v, segments, causal, dropout, window), q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, vjp(cotangent), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize(
    "cp, balanced, causal, heads, groups",
    [(8, True, True, 4, 2), (4, True, False, 4, 1), (4, False, True, 2, 2), (2, True, True, 4, 4)],
)
def test_ring_attention_equals_the_unsharded_attention_and_its_gradients(cp, balanced, causal, heads, groups):
    with jax.enable_x64(True):
        _equal(cp, balanced, causal, heads, groups)


def test_ring_attention_equals_unsharded_without_vma_checks():
    with jax.enable_x64(True):
        _equal(4, True, True, 4, 2, check_vma=False)


@pytest.mark.parametrize("balanced", [True, False])
def test_all_to_all_attention_equals_the_unsharded_attention_and_its_gradients(balanced):
    """Ulysses: where cp divides the kv heads, the sequence split turned to a head split and back."""
    with jax.enable_x64(True):
        _equal(4, balanced, True, 8, 4, strategy="all_to_all")


@pytest.mark.parametrize(
    "strategy, balanced, window", [("ring", True, 3), ("ring", False, 8), ("all_to_all", True, 5)]
)
def test_a_sliding_window_across_devices_equals_the_unsharded_window(strategy, balanced, window):
    """Issue 100: Mistral's and Phi-3's sliding window (a query sees itself and the window - 1
    tokens before it), over chunks of 4 tokens on 4 devices: windows inside a chunk, across
    chunks and across devices, packed documents too; the ring skips blocks wholly outside it."""
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], [5, 11, 14, 2], axis=1).astype(np.int32))
    with jax.enable_x64(True):
        _equal(4, balanced, True, 8, 4, strategy=strategy, window=window)
        _equal(4, balanced, True, 8, 4, segments=segments, strategy=strategy, window=window)
        # (negative control: attention across without the window is not the windowed one)
        q, k, v, cotangent = _inputs(32, 8, 4)
        whole, _ = _compiled(4, balanced, True, False, True, strategy)(q, k, v, None, cotangent)
        assert not np.allclose(whole, dense(q, k, v, None, True, window=window))
    # The ring's work: the blocks a device computes fall with the window.
    assert sum(blocks_run(4, 32, balanced=balanced, window=window)) < sum(
        blocks_run(4, 32, balanced=balanced)
    )


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_packed_documents_with_padding_equal_unsharded(data):
    """Documents cut anywhere (across the chunks and devices), padding at the end: the ring's
    output and gradients are the unsharded attention's, the layout compiled once."""
    length, cp = 32, 4
    rows = []
    for _ in range(B):
        cuts = sorted(data.draw(st.lists(st.integers(1, length - 1), max_size=5, unique=True)))
        padding = data.draw(st.integers(0, 6))
        ids = np.zeros(length, np.int32)
        for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, length], strict=True)):
            ids[start:end] = doc + 1
        ids[length - padding :] = 0
        rows.append(ids)
    with jax.enable_x64(True):
        for strategy in ("ring", "all_to_all"):
            _equal(cp, True, True, 8, 4, segments=jnp.asarray(np.stack(rows)), strategy=strategy)


@pytest.mark.parametrize("strategy, broadcast", [("ring", False), ("all_to_all", True)])
def test_attention_dropout_is_the_unsharded_mask_on_packed_documents(strategy, broadcast):
    """Each block drops with its block of the one unsharded draw, forward and backward, over
    documents cut across chunks and devices, padding included."""
    ids = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]], np.int32), 8, axis=1)  # (2, 32)
    with jax.enable_x64(True):
        drop = AttentionDropout(0.3, broadcast)
        _equal(4, True, True, 8, 4, segments=jnp.asarray(ids), strategy=strategy, dropout=drop)


def test_negative_control_a_backward_that_keeps_the_first_hops_keys_is_caught(monkeypatch):
    """diffusers#14265: the ring backward reusing stale K/V, no error, no NaN. The oracle sees it."""
    monkeypatch.setattr(ring_module, "_backward_hop", lambda x, axis: x)
    with jax.enable_x64(True):
        q, k, v, cotangent = _inputs(16, 4, 2)
        out, grads = _compiled.__wrapped__(4, True, True, False)(q, k, v, None, cotangent)  # (traced anew)
        want, vjp = jax.vjp(lambda q, k, v: dense(q, k, v, None, True), q, k, v)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)  # (the forward is right)
        assert not all(np.allclose(g, e, atol=1e-3) for g, e in zip(grads, vjp(cotangent), strict=True))


def _sent(cp: int, heads: int, groups: int, backward: bool, repeat: bool = False, strategy="ring") -> dict:
    """The bytes a device sends in one compiled attention across ``context`` (float32, ``B``
    sequences of ``8·cp`` tokens), forward or forward and backward, by collective kind.
    ``repeat``: k and v repeated to the query heads first."""
    mesh = fsdp_tp.make_mesh({"context": cp}, devices=jax.devices()[:cp])
    seq, length = P(None, "context"), 8 * cp

    def local(q, k, v, cotangent):
        if repeat:
            k, v = (jnp.repeat(t, heads // groups, axis=2) for t in (k, v))
        out, vjp = jax.vjp(functools.partial(across, strategy=strategy), q, k, v)
        return (out, vjp(cotangent)) if backward else out

    outs = (seq, (seq, seq, seq)) if backward else seq
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 4, out_specs=outs))
    q = jax.ShapeDtypeStruct((B, length, heads, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, length, groups, D), jnp.float32)
    sent: dict = {}
    for c in parse_collectives(run.lower(q, kv, kv, q).compile().as_text()):
        sent[c.kind] = sent.get(c.kind, 0) + c.wire_bytes
    return sent


@pytest.mark.parametrize("cp, heads, groups", [(2, 4, 2), (4, 4, 2), (8, 8, 2)])
def test_the_ring_sends_the_kv_heads_the_formulas_say_and_gathers_nothing(cp, heads, groups):
    """Forward: ``2(n-1)/n · B·S·G·D·b`` (the all-gather's bytes, in ``n-1`` hops); backward: the
    same again plus ``n`` hops of the gradients' accumulators, ``2·B·S·G·D·b_acc``."""
    length, b = 8 * cp, 4
    kv_bytes = B * length * groups * D * b  # one of k, v over the whole sequence
    forward = 2 * (cp - 1) * kv_bytes // cp
    assert _sent(cp, heads, groups, backward=False) == {"collective-permute": forward}
    assert _sent(cp, heads, groups, backward=True) == {"collective-permute": 2 * forward + 2 * kv_bytes}
    # (negative control, torchtitan#1283) k and v repeated to the query heads: H/G the bytes
    repeated = _sent(cp, heads, groups, backward=False, repeat=True)
    assert repeated == {"collective-permute": forward * heads // groups} != {"collective-permute": forward}


def test_all_to_all_sends_the_bytes_the_formula_says_and_auto_picks_the_fewer():
    """Forward ``2(n-1)/n² · B·S·D·(H+G)·b`` (q, k, v in, the output back), backward the same;
    ``ring ÷ all-to-all = n·G/(H+G)``: 16/12 at n 4, H 8, G 4, where "auto" takes all-to-all."""
    cp, heads, groups, length, b = 4, 8, 4, 32, 4
    forward = 2 * (cp - 1) * B * length * D * (heads + groups) * b // cp**2
    assert _sent(cp, heads, groups, backward=False, strategy="all_to_all") == {"all-to-all": forward}
    assert _sent(cp, heads, groups, backward=True, strategy="all_to_all") == {"all-to-all": 2 * forward}
    ring = _sent(cp, heads, groups, backward=False)["collective-permute"]
    assert (
        ring / forward == cp * groups / (heads + groups)
        and ring_or_all_to_all(heads, groups, cp) == "all_to_all"
    )
    assert _sent(cp, heads, groups, backward=False, strategy="auto") == {"all-to-all": forward}
    assert ring_or_all_to_all(heads, 2, cp) == "ring"  # (4 does not divide 2 kv heads)
    assert ring_or_all_to_all(8, 4, 2) == "ring"  # (2·4 <= 8 + 4: the ring sends fewer)


def test_a_sequence_the_split_cannot_take_is_refused_with_a_fix_that_works():
    balanced = SequenceSplit()
    said = r"SequenceSplit: the sequence \(size 20\) is not divisible by the chunks of a balanced split over "
    said += r"mesh axis 'context' \(size 8\); .* pad it to 24 tokens, or pass balanced=False "
    said += r"\(then a multiple of 4\)"
    with pytest.raises(IndivisibleShapeError, match=said):
        balanced.to_devices(jnp.arange(20), 0, 4)
    assert sorted(balanced.to_devices(jnp.arange(24), 0, 4).tolist()) == list(range(24))  # padded
    assert SequenceSplit(balanced=False).to_devices(jnp.arange(20), 0, 4).tolist() == list(range(20))


def test_ring_attention_names_what_it_cannot_take_and_the_fix_runs():
    mesh = fsdp_tp.make_mesh({"context": 2}, devices=jax.devices()[:2])
    seq = P(None, "context")
    q, kv = jnp.ones((1, 6, 2, 4)), jnp.ones((1, 6, 1, 4))  # 3 tokens a device

    def run(f, *args):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(seq,) * len(args), out_specs=seq))(*args)

    with pytest.raises(
        IndivisibleShapeError, match=r"ring_attention: a device's tokens \(size 3\) .* pass balanced=False"
    ):
        run(ring_attention, q, kv, kv)
    contiguous = functools.partial(ring_attention, balanced=False)
    assert run(contiguous, q, kv, kv).shape == q.shape
    with pytest.raises(ValueError, match=r"segment_ids \(1, 2\); pass one document id per token, \(1, 3\)"):
        run(lambda q, k, v, s: contiguous(q, k, v, s[:, :2]), q, kv, kv, jnp.ones((1, 6), jnp.int32))
    with pytest.raises(ValueError, match=r"kv heads that divide the 2 query heads"):
        run(contiguous, q, jnp.ones((1, 6, 3, 4)), jnp.ones((1, 6, 3, 4)))
    with pytest.raises(UnboundAxisNameError, match="context"):
        ring_attention(q, kv, kv)  # (outside shard_map)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_balanced_split_gives_every_device_the_same_causal_work(cp):
    """Zigzag: ``2cp + 1`` blocks of ``(S/2cp)²`` scores on every device (max/mean 1); the
    contiguous split: device i runs ``i + 1`` blocks of ``(S/cp)²``, max/mean ``2cp/(cp+1)``."""
    length = 16 * cp
    balanced, contiguous = blocks_run(cp, length), blocks_run(cp, length, balanced=False)
    assert balanced == [2 * cp + 1] * cp
    assert contiguous == list(range(1, cp + 1))
    assert max(contiguous) / np.mean(contiguous) == 2 * cp / (cp + 1)
    # (full attention: every block on every device, nothing skipped)
    assert blocks_run(cp, length, causal=False) == [4 * cp] * cp


def test_a_devices_temporaries_fall_faster_than_one_over_cp():
    """The compiled forward and backward's temporaries for S tokens at cp = k are under 1/k of
    cp = 1's (the scores' blocks are (S/2k)²); all-gathered k, v hold (S/k)·S scores a head."""
    from fsdp_tp.bench.context_rows import temp_bytes

    ring = {cp: temp_bytes("ring", cp, 1024) for cp in (1, 2, 4, 8)}
    assert all(ring[cp] < ring[1] / cp for cp in (2, 4, 8)), ring
    # (negative control) the all-gathered baseline at cp 8 holds more than the ring at cp 1 / 8
    assert temp_bytes("gathered", 8, 1024) > ring[1] / 8


def test_the_benchmarks_long_sequence_section_at_small_sizes():
    """The section ``fsdp-tp bench`` writes, on small sizes: every figure the page reports."""
    from fsdp_tp.bench.context_rows import context_costs, context_section

    small = dict(step_lengths=(256,), step_start=256, step_budget=0)  # (the step's at 256 tokens)
    measured = context_costs(3, 1, lengths=(256,), cps=(1, 2), timed=(4, 256), **small)
    text = context_section(measured)
    step = measured.step_temps
    assert f"| 256 | {step[1, 256] / 2**20:,.2f} (1.000) | {step[2, 256] / 2**20:,.2f} (" in text, text
    assert (
        measured.step_longest == {1: 0, 2: 0}
        and "| longest sequence whose step fits | < 256 | < 256 |" in text
    )
    assert measured.sent[2][0] == measured.sent[2][1] and "| cp 2 | 0.26 | 0.26 | 1.00 |" in text, text
    assert measured.work[2] == ([5, 5], [1, 2]) and "| cp 2 | [5, 5] | 1.00 | [1, 2] | 1.33 |" in text
    assert measured.longest[("ring", 2)] >= measured.longest[("ring", 1)] > 0
    assert "ring ÷ all-gathered" in text and "ring ÷ all-to-all" in text
    assert [len(t) for t in measured.times.values()] == [3] * 4


def test_all_to_all_where_the_axis_does_not_divide_the_kv_heads_is_refused_and_the_ring_runs():
    mesh = fsdp_tp.make_mesh({"context": 4}, devices=jax.devices()[:4])
    seq = P(None, "context")
    q, kv = jnp.ones((1, 16, 4, 4)), jnp.ones((1, 16, 2, 4))
    run = lambda strategy: jax.jit(
        jax.shard_map(
            functools.partial(across, strategy=strategy), mesh=mesh, in_specs=(seq,) * 3, out_specs=seq
        )
    )(q, kv, kv)
    said = r"the kv heads a device holds \(size 2\) is not divisible by mesh axis 'context' \(size 4\); .* "
    said += r"pass strategy='ring'"
    with pytest.raises(IndivisibleShapeError, match=said):
        run("all_to_all")
    assert run("ring").shape == run("auto").shape == q.shape
    with pytest.raises(
        ValueError, match=r"strategy 'ulysses' is not one of \('ring', 'all_to_all', 'auto'\)"
    ):
        run("ulysses")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_document_positions_count_from_each_documents_first_token(ids):
    """Written out: a token's position is how many tokens of its document come before it in its
    run; padding's is 0."""
    want, run = [], 0
    for i, doc in enumerate(ids):
        run = 0 if i == 0 or ids[i - 1] != doc else run + 1
        want.append(0 if doc == 0 else run)
    assert document_positions(jnp.asarray(ids)).tolist() == want
    assert document_positions(jnp.asarray([ids, ids])).tolist() == [want, want]  # (a batch of rows)


def test_the_reference_attention_keeps_float64_for_a_float64_twin():
    """``attend(implementation="reference")`` computes its softmax in float32 for 16- and 32-bit
    inputs and in float64 for float64 ones, as the ring does (the dense oracle above agrees)."""
    from fsdp_tp.attention import attend

    with jax.enable_x64(True):
        q, k, v, _ = _inputs(16, 4, 2)
        np.testing.assert_allclose(attend(q, k, v), dense(q, k, v, None, True), rtol=1e-12, atol=1e-12)
        assert attend(*(t.astype(jnp.float32) for t in (q, k, v))).dtype == jnp.float32

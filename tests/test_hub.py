"""Issue 100: a Hugging Face checkpoint read straight into a sharded model's arrays, and back.

Each family (Llama 3, Qwen 2 and 3, Mistral, Phi-3, Gemma 3, Qwen 3 MoE) equal to the Hub's own
implementation: logits that transformers (torch) computed on a tiny checkpoint it wrote
(``examples/hub_checkpoints``, recorded once by ``record.py`` there) against the decoder loaded
from it, Linen and NNX, on one device and on data x fsdp x tensor and fsdp x context x tensor
meshes, the mixture's on fsdp x expert x tensor too (the library's Megatron, expert and FSDP
layouts, the sequence split by the step), scanned and with Dense projections too; a fine-tune
the library exported read by transformers as the library reads it; each process
reading each byte it holds once (two processes: each its half); exported back bit for bit; the
checkpoint's problems named tensor by tensor before anything is read (each named fix loads);
"auto" finding the hand-written plan. The format itself: ``tests/test_safetensors.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx
from fsdp_tp import TrainState, make_mesh, shard_step
from fsdp_tp.errors import CheckpointMismatchError, CheckpointSaveError
from fsdp_tp.hub import (
    Checkpoint,
    Decoder,
    DecoderConfig,
    NNXDecoder,
    Rule,
    fsdp_rules,
    load,
    mapping,
    tp_rules,
)
from fsdp_tp.hub.export import export
from fsdp_tp.hub.load import param_path
from fsdp_tp.hub.safetensors import write
from fsdp_tp.sharded_init import abstract_init
from tests.processes import free_port

HERE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "hub_checkpoints")
LLAMA = os.path.join(HERE, "llama")
# llama3 RoPE scaling and an untied head; q/k/v biases; per-head q/k norms, a tied head; a
# sliding window; fused qkv and gate_up weights and a window; Gemma 3's (1 + w) sandwich norms,
# scaled embeddings, tanh-GELU, query scalar, local and global layers and soft-capped logits; a
# mixture of experts (a dense layer, then one of four experts, each stored on its own)
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "qwen3_moe"]


def _assert_hubs(logits, directory: str, rows=lambda x: x) -> None:
    """``logits`` equal to the Hub's (float64) to float32 rounding: within twice the distance of
    transformers' own float32 run from its float64 run (measured: ours 3.3e-7 to 2.1e-6, theirs
    3.9e-7 to 1.7e-6, the largest Gemma 3's; logits up to 3). ``rows``: the batch as laid out."""
    want, theirs = (rows(np.load(os.path.join(directory, f))) for f in ("logits.npy", "float32_logits.npy"))
    rounding = np.abs(theirs.astype(np.float64) - want).max()
    assert 0 < rounding < 1e-5  # (float32's, not a model's difference)
    np.testing.assert_allclose(logits, want, rtol=0, atol=2 * rounding)


def _decoder_config(directory: str = LLAMA) -> DecoderConfig:
    return DecoderConfig.from_hub(Checkpoint(directory).config)


def _one_device(api: str, directory: str, config: DecoderConfig | None = None, rules=None):
    """The decoder loaded from ``directory`` on one device, and its logits on the recorded tokens."""
    config = config or _decoder_config(directory)
    tokens = _tokens()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if api == "linen":
        model = Decoder(config)
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
        apply = lambda params: model.apply({"params": params}, tokens)
    else:
        from flax import nnx

        graph, shapes = nnx.split(nnx.eval_shape(lambda: NNXDecoder(config, nnx.Rngs(0))))
        apply = lambda params: nnx.merge(graph, params)(tokens)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
    params, report = load(directory, target, *(rules or mapping(config)))
    return np.asarray(jax.jit(apply)(params)), report


def _tokens():
    return jnp.array(json.loads(open(os.path.join(HERE, "tokens.json")).read()))


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_loaded_gives_the_hubs_logits_on_one_device(family, api):
    for directory in (os.path.join(HERE, family), os.path.join(HERE, family, "bf16")):  # (bf16: its own)
        logits, report = _one_device(api, directory)
        _assert_hubs(logits, directory)
        # (Dense projections: the same tensors into (in, out) kernels, N * H flat)
        logits, _ = _one_device(api, directory, _variant(_decoder_config(directory), "dense"))
        _assert_hubs(logits, directory)
        assert report.blocks == len(
            jax.tree.leaves(_target(DecoderConfig.from_hub(Checkpoint(directory).config)))
        )
        assert report.bytes_read == report.bytes_stored  # (every byte once, a fused tensor's too)


def test_a_fine_tune_the_library_exported_reads_in_transformers_as_in_the_library():
    # examples/hub_checkpoints/llama_tuned: the tiny Llama fine-tuned 3 steps on data x fsdp x
    # tensor and exported by the library (tune.py there); its logits recorded by transformers
    # from that export (record.py). The library reads the file as transformers does.
    tuned = os.path.join(HERE, "llama_tuned")
    assert Checkpoint(tuned).config == Checkpoint(LLAMA).config
    for api in ("linen", "nnx"):
        logits, _ = _one_device(api, tuned)
        _assert_hubs(logits, tuned)
    moved = np.load(os.path.join(tuned, "logits.npy")) - np.load(os.path.join(LLAMA, "logits.npy"))
    assert np.abs(moved).max() > 0.1


def test_each_part_of_the_mapping_and_llama3_scaling_shows_in_the_logits():
    # Negative controls of the test above: what each would miss makes the logits differ.
    want = np.load(os.path.join(LLAMA, "logits.npy"))
    config = _decoder_config()
    rules, ignore = mapping(config)
    swapped = [
        dataclasses.replace(
            r, path=r.path.replace("/k/", "/v/") if "/k/" in r.path else r.path.replace("/v/", "/k/")
        )
        for r in rules
    ]
    for wrong in [
        dict(
            config=dataclasses.replace(config, rope_type="default", rope_scaling=())
        ),  # (llama3's scaling left out)
        dict(rules=(swapped, ignore)),  # (keys and values swapped)
    ]:
        logits, _ = _one_device("linen", LLAMA, **wrong)
        assert np.abs(logits - want).max() > 1e-3
    # The mixture's: experts stacked in another order; the top-k weights left unnormalized.
    moe = os.path.join(HERE, "qwen3_moe")
    want, config = np.load(os.path.join(moe, "logits.npy")), _decoder_config(moe)
    rules, ignore = mapping(config)
    expert = next(r for r in rules if r.at)  # (experts 0 and 1 swapped in the bank)
    swapped = [r for r in rules if not r.at] + [
        dataclasses.replace(
            expert, pattern=expert.pattern.replace(r"experts\.(\d+)", f"experts\\.({i})"), at=(j,)
        )
        for i, j in enumerate([1, 0, *range(2, config.experts)])
    ]
    for wrong in [
        dict(rules=(swapped, ignore)),
        dict(config=dataclasses.replace(config, normalize_top_k=False)),
    ]:
        logits, _ = _one_device("linen", moe, **wrong)
        assert np.abs(logits - want).max() > 1e-3


def _variant(config: DecoderConfig, variant: str) -> DecoderConfig:
    """``config`` scanned and/or with Dense projections: ``"scan"``, ``"dense"``, ``"scan-dense"``."""
    return dataclasses.replace(config, scan="scan" in variant, dense="dense" in variant)


def _step_logits(
    api: str, axes: dict, batch_axes: tuple, checkpoint: Checkpoint, tokens, out=None, variant=""
):
    """The logits the library's step computes on ``tokens`` with the decoder loaded from
    ``checkpoint`` into its layout on ``axes`` (Megatron's tensor split, FSDP over ``batch_axes``)."""
    config = _variant(DecoderConfig.from_hub(checkpoint.config), variant)
    mesh = make_mesh(axes)
    split = "context" in axes
    spec = P(batch_axes[0], "context") if split else P(batch_axes)
    batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)}
    # (FSDP over the batch's axes but expert, which the experts' own dim takes)
    over = tuple(axis for axis in batch_axes if axis != "expert")
    storage, roles = fsdp_rules(config, over if len(over) > 1 else over[0]), tp_rules(config, sizes=axes)
    if api == "linen":
        model = fsdp_tp.shard_by_rules(Decoder, storage, batch_axes=batch_axes, tp_rules=roles)(config)
        init = lambda key, b: model.init(key, b)["params"]
        apply = lambda params, b: model.apply({"params": params}, b)
    else:
        sharded = fsdp_tp.nnx.shard_by_rules(
            functools.partial(NNXDecoder, config), storage, batch_axes=batch_axes, tp_rules=roles
        )
        init = lambda key, b: sharded.init(key)[0]
        apply = lambda params, b: sharded.merge(params)(b)
    state_fn = lambda key, b: TrainState.create(
        apply_fn=None, params=init(key, b), tx=optax.set_to_zero(), rng=key
    )
    shapes, specs = abstract_init(state_fn, mesh, (P(), spec), jax.random.key(0), batch)
    params, report = load(checkpoint, shapes.params, *mapping(config))
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), shapes).replace(
        params=params
    )
    step_fn = lambda state, b: (jax.tree.map(jnp.zeros_like, state.params), apply(state.params, b))
    # (an untied head is column-parallel: logits come out split on their vocabulary over tensor;
    # the vocabulary-parallel embedding's tied logits come out whole)
    rows_and_sequence = (batch_axes[0], "context") if split else (batch_axes, None)
    vocabulary = None if config.tied else "tensor"
    step = shard_step(step_fn, mesh, specs, spec, metrics_specs=P(*rows_and_sequence, vocabulary))
    if out is not None:  # (the loaded parameters back to the Hub's layout, from this mesh's shards)
        export(params, *mapping(config)[:1], like=checkpoint, directory=out, ignore=mapping(config)[1])
    return np.asarray(step(state, batch)[1]), report


MESHES = {
    "data2-fsdp2-tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, ("data", "fsdp")),
    "fsdp2-context2-tensor2": ({"fsdp": 2, "context": 2, "tensor": 2}, ("fsdp", "context")),
    # (the experts over expert, each one's hidden dim over tensor; tokens sent to them)
    "fsdp2-expert2-tensor2": ({"fsdp": 2, "expert": 2, "tensor": 2}, ("fsdp", "expert")),
}
LAYOUTS = [(family, mesh, "") for family in FAMILIES for mesh in list(MESHES)[:2]] + [
    ("qwen3_moe", "fsdp2-expert2-tensor2", ""),
    # (scanned: each layer's tensors stacked into one parameter a weight, split alike; Dense
    # projections: heads flat in the kernels, q/k/v biases split with their columns)
    ("llama", "data2-fsdp2-tensor2", "scan"),
    ("phi3", "fsdp2-context2-tensor2", "scan-dense"),
    ("qwen2", "data2-fsdp2-tensor2", "dense"),
]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize(
    "family, mesh, variant", LAYOUTS, ids=[f"{f}-{m}" + (f"-{v}" if v else "") for f, m, v in LAYOUTS]
)
def test_a_checkpoint_loaded_into_the_librarys_layout_gives_the_hubs_logits(
    family, mesh, variant, api, tmp_path
):
    (axes, batch_axes), directory = MESHES[mesh], os.path.join(HERE, family)
    tokens, rows = _tokens(), lambda x: x
    if "context" not in axes:  # (a row a device of the batch's four)
        rows = lambda x: np.concatenate([x, x[::-1]])
        tokens = jnp.concatenate([tokens, tokens[::-1]])
    checkpoint = Checkpoint(directory, coalesce=0)
    logits, report = _step_logits(api, axes, batch_axes, checkpoint, tokens, tmp_path / "export", variant)
    _assert_hubs(logits, directory, rows)
    # One process holds every device here: it reads each byte of the checkpoint once (a block
    # that several of its devices hold, once), however the layout cuts the tensors.
    assert (
        report.bytes_read
        == report.bytes_stored
        == os.path.getsize(os.path.join(directory, "model.safetensors"))
        - (8 + struct.unpack("<Q", open(os.path.join(directory, "model.safetensors"), "rb").read(8))[0])
    )
    # Exported from the mesh's shards, the checkpoint is the one loaded, tensor for tensor, bit
    # for bit: what transformers reads from it is what it read from the original.
    exported = Checkpoint(tmp_path / "export")
    assert exported.names() == checkpoint.names() and exported.config == checkpoint.config
    for name in checkpoint.names():
        assert np.array_equal(exported.read(name), checkpoint.read(name)), name


def test_an_export_in_bf16_rounds_as_torch_does_and_never_leaves_half_a_directory(tmp_path):
    config = _decoder_config()
    rules, ignore = mapping(config)
    params, _ = load(LLAMA, _target(config), rules, ignore)
    export(params, rules, like=LLAMA, directory=tmp_path / "bf16", dtype="BF16")
    exported, torch_rounded = Checkpoint(tmp_path / "bf16"), Checkpoint(os.path.join(LLAMA, "bf16"))
    for name in torch_rounded.names():
        assert exported.dtype(name) == torch_rounded.dtype(name)
        assert np.array_equal(
            exported.read(name).view(np.uint16), torch_rounded.read(name).view(np.uint16)
        ), name
    with pytest.raises(CheckpointSaveError, match="exists; export writes a new directory whole"):
        export(params, rules, like=LLAMA, directory=tmp_path / "bf16")
    # A parameter the model lacks fails before anything is written: no directory, no temporary.
    with pytest.raises(
        CheckpointMismatchError, match=r"nothing was written(.|\n)*'head/kernel', which the model lacks"
    ):
        export(
            {k: v for k, v in params.items() if k != "head"}, rules, like=LLAMA, directory=tmp_path / "half"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]


def test_a_scan_over_layers_that_differ_is_refused_naming_them_and_unrolled_they_load():
    for family, says in [("gemma3", "sliding windows [5, None]"), ("qwen3_moe", "mixture layers [1] of 2")]:
        directory = os.path.join(HERE, family)
        config = dataclasses.replace(_decoder_config(directory), scan=True)
        with pytest.raises(CheckpointMismatchError, match=re.escape(says) + ".*unroll them"):
            _one_device("linen", directory, config)
        logits, _ = _one_device("linen", directory, dataclasses.replace(config, scan=False))  # (the fix)
        _assert_hubs(logits, directory)


def _target(config: DecoderConfig):
    """The Linen decoder's parameters' shapes, on one device."""
    shapes = jax.eval_shape(
        lambda: Decoder(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)


def test_what_does_not_fit_is_named_tensor_by_tensor_before_anything_is_read(tmp_path):
    config = _decoder_config()
    rules, ignore = mapping(config)
    target = _target(config)
    shutil.copytree(LLAMA, tmp_path / "ck")
    stored = Checkpoint(tmp_path / "ck")
    tensors = {name: stored.read(name) for name in stored.names()}
    cases = [
        # (what the checkpoint holds, the rules, what the message says)
        (
            {**tensors, "model.extra.weight": np.ones(2, np.float32)},
            rules,
            "tensor 'model.extra.weight' (model.safetensors) matches no rule: add a Rule for it, or its "
            "pattern to ignore=",
        ),
        (
            {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
            rules,
            "parameter 'block_1/mlp/up/kernel' of shape (32, 48): nothing fills it",
        ),
        (
            {**tensors, "model.layers.0.self_attn.q_proj.weight": np.ones((24, 32), np.float32)},
            rules,
            "tensor 'model.layers.0.self_attn.q_proj.weight' (model.safetensors) of shape (24, 32) gives "
            "(32, 4, 6)",
        ),
        (tensors, [Rule(r"model\.norm\.weight", "norm"), *rules], "maps to 'norm', which the model lacks"),
        (
            {**tensors, "model.norm.weight": np.ones(32, np.int32)},
            rules,
            "tensor 'model.norm.weight' (model.safetensors) is int32, but 'final_norm' is float32",
        ),
    ]
    for held, case_rules, said in cases:
        write(str(tmp_path / "ck" / "model.safetensors"), held)
        checkpoint = Checkpoint(tmp_path / "ck")
        with pytest.raises(CheckpointMismatchError, match="nothing was loaded") as refused:
            load(checkpoint, target, case_rules, ignore)
        assert said in str(refused.value), str(refused.value)
        assert checkpoint.bytes_read == 0
    # The fix the first names works: the pattern in ignore= (or a rule).
    write(
        str(tmp_path / "ck" / "model.safetensors"), {**tensors, "model.extra.weight": np.ones(2, np.float32)}
    )
    params, _ = load(tmp_path / "ck", target, rules, [*ignore, r"model\.extra\.weight"])
    assert np.array_equal(np.asarray(params["final_norm"]), tensors["model.norm.weight"])


def test_two_processes_each_read_the_blocks_their_devices_hold_and_export_them(tmp_path):
    # FSDP over 8 devices, 4 a process: each process holds half of every kernel and embedding
    # row block and the whole of each (replicated) norm, and reads exactly those bytes.
    port = free_port()
    script = os.path.join(os.path.dirname(__file__), "hub_process.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(port), str(i), str(tmp_path / "export")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    reads = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    checkpoint = Checkpoint(LLAMA)
    replicated = sum(checkpoint.read(n).nbytes for n in checkpoint.names() if n.endswith("norm.weight"))
    stored = reads[0]["bytes_stored"]
    assert [r["bytes_read"] for r in reads] == [(stored - replicated) // 2 + replicated] * 2
    assert replicated < (stored - replicated) // 2  # (so the equality above says half, not all)
    exported = Checkpoint(tmp_path / "export")  # (each block written by the process that holds it)
    for name in checkpoint.names():
        assert np.array_equal(exported.read(name), checkpoint.read(name)), name


def test_the_benchmarks_load_section_at_small_sizes():
    # Each loader in its own process, FSDP over 8 devices: each reads the file's data bytes exactly
    # once (orbax's by its own count) and leaves the same bytes on the devices (the norms' 8
    # copies included); the section names all three. (Its memory and seconds are the benchmark's,
    # measured at 1.25 GB.)
    from fsdp_tp.bench.hub_rows import HUB_CONFIG, hub_costs, hub_section

    small = dict(HUB_CONFIG, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    small |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    measured = hub_costs(small)
    norms = 3 * 64 * 4  # (two norms in the layer, the final one; float32)
    for run in measured.runs.values():
        assert run["read"] == measured.data_bytes
        assert run["held"] == measured.data_bytes + 7 * norms
    text = hub_section(measured)
    assert "| fsdp_tp | 1.00 |" in text and "| read_then_device_put | 1.00 |" in text
    assert "| orbax_safetensors_layout | 1.00 |" in text


def _roles(rules, modules: list[str]) -> dict:
    """Each module's role by ``rules`` (the first whose pattern ``re.search``es its path)."""
    return {m: next((role for pattern, role in rules if re.search(pattern, m)), None) for m in modules}


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "phi3", "qwen3_moe", "qwen2-dense"]
)  # (untied, tied, fused, experts, Dense projections with biases)
def test_auto_finds_the_hand_written_megatron_plan(family):
    from flax import nnx

    import fsdp_tp.linen

    family, _, variant = family.partition("-")
    config = _variant(_decoder_config(os.path.join(HERE, family)), variant)
    tokens = jax.ShapeDtypeStruct((2, 12), jnp.int32)
    modules = sorted({p.rsplit("/", 1)[0] for p in map(param_path, _paths(_target(config)))})
    abstract = nnx.eval_shape(lambda: NNXDecoder(config, nnx.Rngs(0)))
    # (a mixture's experts over tensor alone, then over expert with each one's hidden over tensor)
    for experts in (None, 2) if config.moe_layers else (None,):
        sizes = {"expert": experts or 1, "tensor": 2}
        hand = _roles(tp_rules(config, sizes=sizes), modules)
        assert sum(role is not None for role in hand.values()) == 7 * config.layers + 2 - config.tied
        find = dict(size=2, outputs_split=True, expert_size=experts)
        linen = fsdp_tp.linen.find_tp_rules(Decoder(config), tokens, **find)
        found_nnx = fsdp_tp.nnx.find_tp_rules(abstract, tokens, **find)
        assert _roles(linen.rules, modules) == hand == _roles(found_nnx.rules, modules)
    # (negative control: one role changed is seen)
    changed = [(r"attn/out$", tp_rules(config)[1][1]), *tp_rules(config)]
    assert _roles(changed, modules) != hand


def _paths(tree) -> list:
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


LLAMA_3_8B = {  # (Meta-Llama-3.1-8B's config.json, its sizes and RoPE)
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def test_plan_from_a_config_alone_says_what_each_of_4096_devices_holds_and_reads(tmp_path):
    # An 8B model on data 8 x fsdp 64 x tensor 8, no weights, no devices: every weight matrix is
    # split 512 ways (its D over fsdp, its heads, features or vocabulary over tensor), each norm
    # whole; a device reads its elements in the checkpoint's bfloat16.
    out = _planned(tmp_path, LLAMA_3_8B, "data=8,fsdp=64,tensor=8", 512)
    total, norms = 8_030_261_248, (2 * 32 + 1) * 4096  # (Llama 3 8B's parameters; its norms')
    elements = (total - norms) // 512 + norms
    assert f"reads per device: {2 * elements:,} B of the checkpoint ({elements:,} elements of 2 B" in out
    assert f"params {4 * elements:,} B" in out  # (float32 on the devices)


def _planned(tmp_path, config: dict, mesh: str, batch: int) -> str:
    """What ``fsdp-tp plan --from`` prints for a directory holding ``config`` alone."""
    from fsdp_tp.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    out = io.StringIO()
    assert main(["plan", "--from", str(tmp_path), "--mesh", mesh, "--batch", str(batch)], out=out) == 0
    return out.getvalue()


QWEN3_30B_A3B = {  # (Qwen3-30B-A3B's config.json: its sizes and its mixture)
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_plan_from_a_mixture_of_experts_config_splits_the_experts_over_expert(tmp_path):
    # Qwen3-30B-A3B on fsdp 16 x expert 8 x tensor 4: each expert kernel split 512 ways (its
    # experts over expert, D over fsdp, the expert's hidden over tensor), the attention, the
    # embedding and the head 64 ways (fsdp x tensor; expert splits the batch), routers and norms whole.
    out = _planned(tmp_path, QWEN3_30B_A3B, "fsdp=16,expert=8,tensor=4", 128)
    v, d, layers, heads, kv, h, e, f = 151936, 2048, 48, 32, 4, 128, 128, 768
    dense = 2 * v * d + layers * d * h * (2 * heads + 2 * kv)  # (embedding, head, q k v out)
    experts, whole = layers * 3 * e * d * f, layers * (d * e + 2 * d + 2 * h) + d  # (routers and norms)
    assert dense + experts + whole == 30_532_122_624  # (Qwen3-30B-A3B's parameters)
    elements = dense // 64 + experts // 512 + whole
    assert f"reads per device: {2 * elements:,} B of the checkpoint ({elements:,} elements" in out

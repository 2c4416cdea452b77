"""Writes the tiny Hugging Face checkpoints the hub tests load, and the logits the Hub's own
(torch) implementation computes on them: run once where torch and transformers install; the
suite reads the files and never needs torch.

    python -m venv /tmp/hub && /tmp/hub/bin/pip install torch==2.13.0 transformers safetensors tokenizers
    /tmp/hub/bin/python examples/hub_checkpoints/record.py [FAMILY ...]   # (none named: all)

Each family's directory: ``config.json``, ``model.safetensors`` (float32), a bfloat16 copy in
``bf16/``, and ``logits.npy`` on ``TOKENS``: each checkpoint loaded back by transformers in float64 (so
``bf16/logits.npy`` are the bfloat16 weights' logits), and ``float32_logits.npy``: the same in
float32, whose distance from the float64 logits is the rounding a float32 run is held to.
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers

HERE = pathlib.Path(__file__).parent
TOKENS = [[1, 5, 9, 13, 2, 60, 33, 7, 41, 19, 3, 50], [4, 8, 15, 16, 23, 42, 0, 63, 31, 12, 11, 10]]

# Every family's sizes: 2 layers of d 32, 4 query heads and 2 kv heads, an MLP of 48, 64 tokens.
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
DEFAULT_ROPE = lambda theta: {"rope_type": "default", "rope_theta": theta}

FAMILIES = {
    # llama3 RoPE scaling with its three regimes hit at head_dim 8 (wavelengths 6.3, 63, 628,
    # 6283 against 16 and 64), untied head.
    "llama": transformers.LlamaConfig(
        **SMALL,
        head_dim=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v biases; tied-free, default RoPE at another theta
    "qwen2": transformers.Qwen2Config(
        **SMALL, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=DEFAULT_ROPE(1000.0)
    ),
    # each head's query and key RMS-normed before RoPE, an explicit head_dim (not d / heads),
    # the head tied to the embedding
    "qwen3": transformers.Qwen3Config(
        **SMALL, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=DEFAULT_ROPE(1e6)
    ),
    # a sliding window of 5 tokens (the 12 tokens see past it), every layer
    "mistral": transformers.MistralConfig(
        **SMALL,
        head_dim=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=5,
        rope_parameters=DEFAULT_ROPE(1e6),
    ),
    # q, k and v in one weight (qkv_proj), gate and up in another (gate_up_proj); a window of 7
    "phi3": transformers.Phi3Config(
        **SMALL,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        original_max_position_embeddings=128,
        sliding_window=7,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=DEFAULT_ROPE(10000.0),
    ),
    # (1 + w) norms, four a block; sqrt(d) embedding scale; tanh-GELU; per-head q/k norms; a
    # query scalar other than head_dim; a local layer (window 5, theta 10k) then a global one
    # (theta 1M, linear scaling 4); tied logits soft-capped at 3
    "gemma3": transformers.Gemma3TextConfig(
        **SMALL,
        head_dim=8,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=16,
        sliding_window=5,
        final_logit_softcapping=3.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": DEFAULT_ROPE(10000.0),
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    ),
    # a mixture of experts: layer 0 a dense MLP (mlp_only_layers), layer 1 four experts of 24,
    # each token's top 2 renormalized; each expert's three weights stored on their own
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **SMALL,
        head_dim=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        rope_parameters=DEFAULT_ROPE(1e6),
    ),
}


def load(directory: pathlib.Path, dtype):
    """The checkpoint in ``directory`` as transformers loads it, in ``dtype``; a mixture of experts
    by its reference loop over the experts (the grouped kernel takes no float64)."""
    moe = {"experts_implementation": "eager"} if "qwen3_moe" in directory.parts else {}
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **moe).eval()


def main(names: list[str]):
    """Each family named (none: all) written and recorded; ``llama_tuned``, the library's export
    that ``tune.py`` writes, recorded as it is."""
    for name in names or FAMILIES:
        if name == "llama_tuned":
            record_logits(HERE / name)
            continue
        config = FAMILIES[name]
        torch.manual_seed(sorted(FAMILIES).index(name))  # (a family recorded alone: the same weights)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # A random init's norms are ones and its biases zeros: make every tensor random, so a
        # mapping that drops or swaps one shows.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn_like(parameter) * 0.3)
        directory = HERE / name
        model.save_pretrained(directory, safe_serialization=True)
        model.to(torch.bfloat16).save_pretrained(directory / "bf16", safe_serialization=True)
        for written in (directory, directory / "bf16"):
            (written / "generation_config.json").unlink(missing_ok=True)
            record_logits(written)
    (HERE / "tokens.json").write_text(json.dumps(TOKENS))
    write_tokenizer(HERE / "llama")


def record_logits(written: pathlib.Path) -> None:
    """The checkpoint's logits as a user of transformers gets them: the files loaded back, in
    float64 (the RoPE tables computed anew on load, as transformers computes them), and in
    float32: how far transformers' own float32 run is from float64, the rounding a float32
    implementation is held to."""
    loaded = load(written, torch.float64)
    with torch.no_grad():
        logits = loaded(torch.tensor(TOKENS)).logits.numpy()
    np.save(written / "logits.npy", logits)
    loaded = load(written, torch.float32)
    with torch.no_grad():
        np.save(written / "float32_logits.npy", loaded(torch.tensor(TOKENS)).logits.numpy())
    print(written, logits.shape, float(np.abs(logits).max()))


def write_tokenizer(directory: pathlib.Path) -> None:
    """A ``tokenizer.json`` of the tiny checkpoints' 64 tokens, for ``fsdp-tp finetune``'s text:
    byte-pair merges over the lowercase letters, space and punctuation, learnt from a few
    sentences (anything else is ``<unk>``, 0), written by the ``tokenizers`` package as the Hub's
    are."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = list("abcdefghijklmnopqrstuvwxyz.,'\u2581")
    trainer = trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<unk>"], initial_alphabet=alphabet, limit_alphabet=len(alphabet)
    )
    text = ["The cat sees the river at night.", "A dog follows the old man.", "My friend likes the moon."]
    tokenizer.train_from_iterator(text * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Loading a checkpoint (issue 100): :func:`fsdp_tp.hub.load` straight into FSDP's shards against
the obvious loader (every tensor read whole into host memory, then laid out and ``device_put``),
on a Llama-shaped float32 checkpoint written locally.

Each loader runs in a process of its own, on 8 CPU devices, FSDP over all of them. Measured there:
the bytes read from the file against its data bytes, and the host memory the load takes beyond
what the devices end up holding — the peak of the NumPy buffers alive at once during the load
(``tracemalloc``, which sees NumPy's allocations and not XLA's device buffers), against the
checkpoint's largest tensor. The same process's seconds are reported as a ratio.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

__all__ = ["HUB_CONFIG", "HubMeasured", "hub_costs", "hub_section", "write_llama"]

# 4 layers of a 1B-class Llama (d 2048, GQA 16/4 heads of 128, MLP 5632, vocabulary 32,000):
# 311 M parameters, 1.25 GB in float32.
HUB_CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    model_type="llama",
    rope_theta=10000.0,
)


def write_llama(directory: str, config: dict) -> int:
    """A random float32 checkpoint of ``config``'s shapes, Llama's names, in ``directory`` (one
    ``model.safetensors`` and ``config.json``); returns its data bytes."""
    from ..hub.safetensors import write

    d, f, v, layers = (
        config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    )
    q, kv = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
    )
    shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        at = f"model.layers.{i}."
        shapes |= {f"{at}input_layernorm.weight": (d,), f"{at}post_attention_layernorm.weight": (d,)}
        shapes |= {
            f"{at}self_attn.{n}_proj.weight": s
            for n, s in (("q", (q, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, q)))
        }
        shapes |= {
            f"{at}mlp.{n}_proj.weight": s for n, s in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))
        }
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape, np.float32) * 0.02 for name, shape in shapes.items()}
    os.makedirs(directory, exist_ok=True)
    write(os.path.join(directory, "model.safetensors"), tensors)
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out)
    return sum(t.nbytes for t in tensors.values())


# One loader in a fresh process: prints what it read, its peak of host buffers and the bytes
# its devices hold, as JSON.
_LOADER = textwrap.dedent(
    """
    import json, sys, time, tracemalloc
    import jax, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import NamedSharding
    import fsdp_tp
    from fsdp_tp.hub import Checkpoint, Decoder, DecoderConfig, fsdp_rules, load, mapping
    from fsdp_tp.hub.mapping import match
    from fsdp_tp.rules import specs_from_rules

    kind, directory = sys.argv[1], sys.argv[2]
    checkpoint = Checkpoint(directory, coalesce=0)
    config = DecoderConfig.from_hub(checkpoint.config)
    mesh = fsdp_tp.make_mesh({"fsdp": 8})
    tokens = np.zeros((1, 4), np.int32)
    shapes = jax.eval_shape(lambda: Decoder(config).init(jax.random.key(0), tokens)["params"])
    specs = specs_from_rules(shapes, fsdp_rules(config), mesh)
    laid = lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p))
    target = jax.tree.map(laid, shapes, specs)
    rules, ignore = mapping(config)
    tracemalloc.start()
    start = time.perf_counter()
    if kind == "fsdp_tp":
        params, report = load(checkpoint, target, rules, ignore)
    else:  # every tensor read whole, then laid out and put on the devices
        stored = {name: checkpoint.read(name) for name in checkpoint.names()}
        leaves = jax.tree_util.tree_flatten_with_path(target)[0]
        plan = match(rules, {n: checkpoint.shape(n) for n in checkpoint.names()},
                     {fsdp_tp.rules.path_of(p): t.shape for p, t in leaves}, ignore)
        params = {}
        for path, t in leaves:
            (source,) = plan[fsdp_tp.rules.path_of(path)]
            whole = source.block(stored[source.name], tuple((0, n) for n in t.shape))
            params[fsdp_tp.rules.path_of(path)] = jax.device_put(whole, t.sharding)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    read = checkpoint.bytes_read
    print(json.dumps(dict(read=read, peak=peak, held=held, seconds=seconds)))
    """
)


@dataclasses.dataclass(frozen=True)
class HubMeasured:
    data_bytes: int
    largest: int  # the checkpoint's largest tensor, bytes
    runs: dict  # loader: {read, peak, held, seconds}


def hub_costs(config: dict = HUB_CONFIG) -> HubMeasured:
    """Both loaders on a checkpoint of ``config`` written to a temporary directory."""
    with tempfile.TemporaryDirectory() as directory:
        data = write_llama(directory, config)
        d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
        largest = 4 * max(v * d, f * d)
        runs = {}
        for kind in ("fsdp_tp", "read_then_device_put"):
            done = subprocess.run(
                [sys.executable, "-c", _LOADER, kind, directory], capture_output=True, text=True, check=False
            )
            if done.returncode:
                raise RuntimeError(f"hub benchmark, {kind}: {done.stderr[-2000:]}")
            runs[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return HubMeasured(data, largest, runs)


def hub_section(m: HubMeasured) -> str:
    gb = lambda b: f"{b / 1e9:.3f} GB"
    rows = []
    for kind, run in m.runs.items():
        peak, seconds = gb(run["peak"]), run["seconds"] / m.runs["fsdp_tp"]["seconds"]
        rows.append(
            f"| {kind} | {run['read'] / m.data_bytes:.2f} | {peak} ({run['peak'] / m.largest:.2f}) | "
            f"{gb(run['held'])} | {seconds:.2f} |"
        )
    return (
        f"\n### Loading a downloaded checkpoint\n\n"
        f"A Llama-shaped float32 checkpoint of {gb(m.data_bytes)} ({HUB_CONFIG['num_hidden_layers']} "
        f"layers of d {HUB_CONFIG['hidden_size']}, vocabulary {HUB_CONFIG['vocab_size']:,}), loaded onto "
        f"FSDP over 8 CPU devices by `fsdp_tp.hub.load` and by reading every tensor whole then "
        f"`device_put`. Host buffers: the most NumPy held at once during the load (the devices' own "
        f"buffers not counted), and ÷ the largest tensor ({gb(m.largest)}).\n\n"
        "| loader | bytes read ÷ the file's data | host buffers at peak (÷ largest tensor) | the devices "
        "hold | seconds ÷ fsdp_tp's |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )

"""Loading a checkpoint (issue 100): :func:`fsdp_tp.hub.load` straight into FSDP's shards against
orbax's safetensors layout (``orbax.checkpoint.experimental.v1``, ``CheckpointLayout.SAFETENSORS``:
each stored tensor read into the shards that, viewed, are the parameter's; the views then run on
the devices) and the obvious loader (every tensor read whole into host memory, then laid out and
``device_put``), on a Llama-shaped float32 checkpoint written locally.

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
from jax.sharding import PartitionSpec as P

from ..hub.mapping import SplitDim, Transpose

__all__ = ["HUB_CONFIG", "HubMeasured", "hub_costs", "hub_section", "stored_spec", "write_llama"]

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


def stored_spec(views, shapes, spec) -> P:
    """The spec of a stored tensor whose shards, through ``views`` (its ``shapes`` before each
    and after the last), are a parameter's shards under ``spec``: a transpose's dims permuted
    back, a split dim's first part's axis for the whole dim (its other parts whole).

    >>> from fsdp_tp.hub.mapping import SplitDim, Transpose
    >>> stored_spec((Transpose(), SplitDim(1, (4, -1))), [(32, 8), (8, 32), (8, 4, 8)], P("fsdp"))
    P(None, 'fsdp')
    """
    entries = list(spec) + [None] * (len(shapes[-1]) - len(spec))
    for view, shape in zip(reversed(views), reversed(shapes[:-1]), strict=True):
        if isinstance(view, Transpose):
            perm = view._perm(len(shape))
            back = [None] * len(shape)
            for out_dim, in_dim in enumerate(perm):
                back[in_dim] = entries[out_dim]
            entries = back
        elif isinstance(view, SplitDim):
            count = len(view.sizes)
            if any(e is not None for e in entries[view.dim + 1 : view.dim + count]):
                raise ValueError(f"{view}: a split inside a dim's inner parts is no stored box")
            entries = [*entries[: view.dim + 1], *entries[view.dim + count :]]
    return P(*entries)


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
    if kind == "orbax_safetensors_layout":  # (its imports before the measure; its count of bytes)
        import orbax.checkpoint.experimental.v1
        reported = {}
        jax.monitoring.register_scalar_listener(lambda name, value, **_: reported.__setitem__(name, value))
    tracemalloc.start()
    start = time.perf_counter()
    if kind == "fsdp_tp":
        params, report = load(checkpoint, target, rules, ignore)
    elif kind == "orbax_safetensors_layout":  # orbax reads each stored tensor into the shards
        # that, viewed, are the parameter's; the views (transposes, heads) then run on the devices
        import orbax.checkpoint.experimental.v1 as ocp
        from fsdp_tp.bench.hub_rows import stored_spec
        leaves = jax.tree_util.tree_flatten_with_path(target)[0]
        plan = match(rules, {n: checkpoint.shape(n) for n in checkpoint.names()},
                     {fsdp_tp.rules.path_of(p): t.shape for p, t in leaves}, ignore)
        sources = {fsdp_tp.rules.path_of(p): (plan[fsdp_tp.rules.path_of(p)][0], t) for p, t in leaves}
        abstract = {
            source.name: jax.ShapeDtypeStruct(source.shape, t.dtype, sharding=NamedSharding(
                mesh, stored_spec(source.views, source.shapes(), t.sharding.spec)))
            for source, t in sources.values()
        }
        with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
            stored = ocp.load(directory, abstract_state=abstract)
        params = {
            path: jax.jit(lambda x, s=source, t=t: s.block(x, tuple((0, n) for n in t.shape)),
                          out_shardings=t.sharding)(stored.pop(source.name))
            for path, (source, t) in sources.items()
        }
        read = int(reported["/jax/orbax/read/safetensors/bytes_read"])  # (orbax's own count)
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
    read = read if kind == "orbax_safetensors_layout" else checkpoint.bytes_read
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
        for kind in ("fsdp_tp", "orbax_safetensors_layout", "read_then_device_put"):
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
        f"FSDP over 8 CPU devices by `fsdp_tp.hub.load`, by orbax's safetensors layout (orbax "
        f"0.12.8's `experimental.v1`, its defaults: each stored tensor read into the shards whose "
        f"transposes and head splits, run on the devices after, are the parameter's), and by reading "
        f"every tensor whole then `device_put`. Host buffers: the most NumPy held at once during the "
        f"load (the devices' own buffers not counted), and ÷ the largest tensor ({gb(m.largest)}).\n\n"
        "| loader | bytes read ÷ the file's data | host buffers at peak (÷ largest tensor) | the devices "
        "hold | seconds ÷ fsdp_tp's |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )

"""Every flag of ``fsdp-tp train`` and ``plan`` checked before anything starts or is written.

Each check raises ``UsageError`` with one line: the flag, what was passed, what would work.
``main`` turns it into exit status 2.

>>> import argparse
>>> check_ranges(argparse.Namespace(batch=0, lr=3e-3))
Traceback (most recent call last):
...
fsdp_tp.cli.checks.UsageError: --batch 0 is out of range: expected an integer >= 1 (sequences per step).
"""

from __future__ import annotations

import math

__all__ = [
    "UsageError",
    "check_attention",
    "check_nnx",
    "check_ranges",
    "check_schedule",
]


class UsageError(ValueError):
    """Options that cannot work (out of range, not dividing, a path that cannot be written)."""


# dest: (smallest value, what the flag counts). Flags absent from a command are skipped.
MINIMUM = {
    "batch": (1, "sequences per step"),
    "seq_len": (1, "tokens per sequence"),
    "d_model": (1, "model width"),
    "num_layers": (1, "layers"),
    "num_heads": (1, "attention heads"),
    "num_kv_heads": (1, "key/value heads"),
    "mlp_hidden": (1, "MLP width"),
    "vocab_size": (2, "token ids"),
    "min_weight_size": (0, "elements; smaller parameters stay whole"),
    "steps": (1, "train steps"),
    "microbatches": (1, "gradient accumulation steps"),
    "warmup": (0, "warmup steps"),
    "seed": (0, "the random seed"),
    "log_every": (1, "steps between progress lines"),
    "check": (0, "steps compared with the twin; 0 is off"),
    "eval_every": (0, "steps between held-out losses; 0 is off"),
    "eval_batches": (1, "held-out batches"),
    "checkpoint_every": (1, "steps between checkpoints"),
    "keep": (1, "checkpoints kept"),
    "resume_from": (0, "a checkpoint's step"),
    "cpu_devices": (1, "simulated devices per process"),
    "num_processes": (1, "processes"),
    "process_id": (0, "this process's index"),
    "coordinator_timeout": (1, "seconds to wait for the coordinator"),
    "peer_timeout": (1, "seconds without a heartbeat"),
    "experts": (1, "experts per MoE layer"),
    "top_k": (1, "experts each token is routed to"),
    "moe_every": (1, "layers between MoE layers"),
}
# dest: (largest value, why). optax and the train state count steps in int32.
MAXIMUM = {
    "steps": (2**31 - 1, "optax counts steps in int32"),
    "warmup": (2**31 - 1, "optax counts steps in int32"),
    "resume_from": (2**31 - 1, "a checkpoint's step is an int32 count"),
    "vocab_size": (2**31, "token ids are int32"),
    # XLA's CPU collectives meet every device's thread at a rendezvous and abort the process when
    # they do not all arrive in time: seen with 512 devices on 2 cores (SIGABRT after 73-88 s, 1,143
    # lines), not with 256. A larger mesh is what `fsdp-tp plan` is for (no devices).
    "cpu_devices": (
        256,
        "XLA's CPU collectives abort past that many simulated devices; fsdp-tp plan takes any mesh",
    ),
}
# dest: (smallest value, whether it may equal it, what it is). Refuses nan and inf too.
FLOAT_MINIMUM = {
    "lr": (0.0, False, "a learning rate"),
    "clip_norm": (0.0, True, "a norm; 0 turns clipping off"),
    "peak_tflops": (0.0, False, "a device's peak TFLOP/s"),
    "capacity_factor": (0.0, False, "a multiple of an expert's even share; --dropless for no limit"),
}

# dest: (largest value, why): past float32's largest, the value the optimizer reads is inf
# (and numpy's overflow warnings were printed before the one line of a non-finite step).
_FLOAT32_MAX = 3.4028234663852886e38
FLOAT_MAXIMUM = {
    "lr": (_FLOAT32_MAX, "the optimizer reads it as a float32"),
    "clip_norm": (_FLOAT32_MAX, "the clip reads it as a float32"),
}

# Flags whose dest is not their name (options.py: dest="num_layers" for --layers, ...).
_RENAMED = {"num_layers": "--layers", "num_heads": "--heads", "num_kv_heads": "--kv-heads"}


def _flag(dest: str) -> str:
    return _RENAMED.get(dest, "--" + dest.replace("_", "-"))


def check_ranges(args) -> None:
    """Raises ``UsageError`` for the first numeric flag outside its range."""
    for dest, (low, meaning) in MINIMUM.items():
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise UsageError(
                f"{_flag(dest)} {value} is out of range: expected an integer >= {low} ({meaning})."
            )
    for dest, (high, why) in MAXIMUM.items():
        value = getattr(args, dest, None)
        if value is not None and value > high:
            raise UsageError(f"{_flag(dest)} {value} is out of range: expected an integer <= {high} ({why}).")
    for dest, (bound, inclusive, meaning) in FLOAT_MINIMUM.items():
        number = getattr(args, dest, None)
        if number is None:
            continue
        if not math.isfinite(number) or number < bound or (number == bound and not inclusive):
            relation = ">=" if inclusive else ">"
            raise UsageError(
                f"{_flag(dest)} {number} is out of range: "
                f"expected a finite number {relation} {bound} ({meaning})."
            )
    for dest, (largest, why) in FLOAT_MAXIMUM.items():
        given = getattr(args, dest, None)
        if given is not None and given > largest:
            raise UsageError(
                f"{_flag(dest)} {given:g} is out of range: expected a number <= {largest:.4g} ({why})."
            )


def check_attention(attention: str, dtype: str, accelerated: bool) -> None:
    """``--attention cudnn`` is cuDNN's flash attention: an NVIDIA GPU and a 16-bit dtype."""
    if attention != "cudnn":
        return
    if not accelerated:
        raise UsageError(
            "--attention cudnn is cuDNN's flash attention, which needs an NVIDIA GPU; this run is on "
            "CPU devices: pass --attention auto (cuDNN where it runs, XLA's elsewhere) or xla."
        )
    if dtype != "bf16":
        raise UsageError(
            f"--attention cudnn computes in 16 bits; --dtype is {dtype}: pass --dtype bf16, or "
            f"--attention auto (XLA's attention for {dtype})."
        )


def check_schedule(args) -> None:
    """A warmup given that does not end before the last step trains at a fraction of ``--lr``
    (1000000 over 3 steps: about 2e-6 of it), without a word. The default's 20 steps stay:
    short demonstration runs warm up through all their steps, as they always have."""
    steps, warmup = getattr(args, "steps", None), getattr(args, "warmup", None)
    if steps is not None and warmup is not None and warmup >= steps:
        raise UsageError(
            f"--warmup {warmup} does not end before --steps {steps}: every step would train at most "
            f"{(steps - 1) / warmup:.2g} of --lr {args.lr:g}; pass --warmup below {steps} "
            f"(or 0), or more --steps."
        )


def check_nnx(args, tensor: int) -> None:
    """``--api nnx``: sequence parallelism without ``check_vma`` (a norm's scale reads sequence
    slices: JAX's checking sums its gradient), refused before anything starts."""
    if args.sequence_parallel is not False and tensor > 1 and not args.check_vma:
        raise UsageError(
            "--api nnx with sequence parallelism (its default) needs --check-vma: the norms read "
            "sequence slices and JAX's checking sums their gradients over tensor; drop "
            "--no-check-vma, or pass --no-sequence-parallel."
        )


def check_tensor_split(config, args, mesh: dict, sequence_parallel: bool) -> None:
    """The GPT's sizes the mesh's ``tensor`` axis splits (heads, kv heads, the MLP, the
    vocabulary; the sequence between layers under sequence parallelism), each refused naming
    its flag and values that work: the library's own refusal names a rule to drop, which no
    flag can."""
    tensor = mesh.get("tensor", 1)
    if tensor == 1:
        return
    up = lambda n: -(-n // tensor) * tensor
    # the same devices, none on tensor
    context = f",context={mesh['context']}" if mesh.get("context", 1) > 1 else ""  # (kept: the sequence's)
    whole = f"data={mesh.get('data', 1)},fsdp={mesh.get('fsdp', 1) * tensor}{context},tensor=1"
    cases = [
        ("num_heads", config.num_heads, config.num_heads % tensor, "each device computes whole heads"),
        (
            "num_kv_heads",
            config.num_kv_heads,
            config.num_kv_heads % tensor and tensor % config.num_kv_heads,
            "each device computes whole kv heads, or a block of one kv head's query heads",
        ),
        (
            "mlp_hidden",
            config.mlp_hidden,
            config.mlp_hidden % tensor,
            "each device computes a slice of the MLP",
        ),
        (
            "vocab_size",
            config.vocab_size,
            config.vocab_size % tensor,
            "the embedding and logits split the vocabulary",
        ),
    ]
    heads = config.num_heads if config.num_heads % tensor == 0 else up(config.num_heads)
    misfits, fixes = [], []  # (every misfit in one refusal: tensor=3 misfit five sizes, said one at a time)
    for dest, value, bad, why in cases:
        if not bad:
            continue
        said = f"{_flag(dest)} {value}" + ("" if getattr(args, dest, None) else " (not given: the default)")
        relation = "neither divides nor is a multiple of" if dest == "num_kv_heads" else "is not divisible by"
        misfits.append(f"{said} {relation} tensor={tensor} (--mesh): {why}")
        fix = [up(value)]
        if dest == "num_kv_heads":  # (the kv heads must also divide the query heads)
            fix = [
                n for n in range(1, up(value) + 1) if (n % tensor == 0 or tensor % n == 0) and heads % n == 0
            ]
        fixes.append((_flag(dest), fix))
    if sequence_parallel and config.seq_len % tensor:
        if not misfits:
            raise UsageError(
                f"--seq-len {config.seq_len} is not divisible by tensor={tensor} (--mesh): sequence "
                f"parallelism splits the sequence between layers; pass --seq-len {up(config.seq_len)}, or "
                f"--no-sequence-parallel."
            )
        misfits.append(f"--seq-len {config.seq_len} is not divisible by tensor={tensor} (--mesh): sequence "
                       f"parallelism splits the sequence between layers")  # fmt: skip
        fixes.append(("--seq-len", [up(config.seq_len)]))
    if misfits:
        # one misfit: its flag's values that work ("--kv-heads 1 or 2"); several: one command
        flags = (
            [f"{flag} {' or '.join(map(str, values))}" for flag, values in fixes]
            if len(fixes) == 1
            else [f"{flag} {values[-1]}" for flag, values in fixes]
        )
        raise UsageError(
            f"{'; '.join(misfits)}; pass {' '.join(flags)}, or --mesh {whole} (no tensor parallelism)."
        )

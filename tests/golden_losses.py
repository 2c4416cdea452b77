"""The main job's losses, bit for bit, per jax version: what ``test_golden_losses`` compares with.

A change that moves any number on the user's path (a refactor that reorders a sum, a new jax)
shows the day it lands. The job is ``fsdp-tp train --steps 30`` (the README's main job, ten
times shorter) in a fresh process with the user's XLA settings: none of the tests' cheaper
code generation, on the CPU.

XLA's CPU code depends on the instruction set it may use: measured here (jax 0.10.2, an
AVX-512 Xeon), capping it at AVX2 (``XLA_FLAGS=--xla_cpu_max_isa=AVX2``) moves step 1's loss by
1.4e-6 and 15 of the 30 losses in all; SSE4.2 differs from both; one core and two give the
same bits. So a jax version's file holds one run per cap this machine can apply, and a
machine's run must equal one of them bit for bit.

Record, after checking that the change in the numbers is intended (replaces the file of this
jax version; ``--add`` keeps its runs and adds this machine's, for a machine that computes
otherwise)::

    python -m tests.golden_losses [--add]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import flax
import jax
import jaxlib
import optax

__all__ = ["COMMAND", "golden_file", "main_job", "matching", "mismatch", "record", "recorded"]

COMMAND = ("train", "--steps", "30")
GOLDEN = Path(__file__).parent / "golden"
# XLA's names for the x86 instruction set caps; elsewhere only the machine's own is recorded.
X86_CAPS = ("AVX2", "SSE4_2")


def golden_file() -> Path:
    return GOLDEN / f"jax-{jax.__version__}.json"


def recorded() -> dict:
    """This jax version's file: the main job's runs, one per instruction set cap."""
    path = golden_file()
    assert path.is_file(), (
        f"no golden losses for jax {jax.__version__} ({path} is missing): run `python -m "
        "tests.golden_losses` on a machine where the suite passes, and commit the file"
    )
    return json.loads(path.read_text())


def main_job(where: Path, max_isa: str | None = None) -> dict:
    """The per-step losses and the held-out loss of ``fsdp-tp COMMAND`` run in ``where``, with
    XLA capped at instruction set ``max_isa`` (None: the machine's own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"  # the recorded numbers are the CPU's, on a GPU machine too
    if max_isa:
        env["XLA_FLAGS"] = f"--xla_cpu_max_isa={max_isa}"
    log = where / f"golden-{max_isa or 'uncapped'}.jsonl"
    argv = [sys.executable, "-m", "fsdp_tp", *COMMAND, "--log-file", str(log)]
    done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(argv)} ended with {done.returncode}:\n{done.stderr[-3000:]}"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {
        "losses": [r["loss"] for r in records if "loss" in r],
        "eval_loss": next(r["eval_loss"] for r in records if "eval_loss" in r),
    }


def matching(run: dict, recorded: dict) -> list[str]:
    """The names of the recorded runs ``run`` equals bit for bit (float == on the values JSON
    holds: repr round-trips every float, so no number is rounded on the way)."""
    return [name for name, golden in recorded["runs"].items() if golden == run]


def mismatch(run: dict, recorded: dict) -> str:
    """Where ``run`` leaves each recorded run, and ``run`` itself, to record or compare."""
    lines = []
    for name, golden in recorded["runs"].items():
        ours, theirs = run["losses"], golden["losses"]
        step = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)
        if step is not None:
            lines.append(f"  {name}: step {step + 1} loss {ours[step]!r}, recorded {theirs[step]!r}")
        elif len(ours) != len(theirs):
            lines.append(f"  {name}: {len(ours)} losses, recorded {len(theirs)}")
        else:
            lines.append(f"  {name}: eval loss {run['eval_loss']!r}, recorded {golden['eval_loss']!r}")
    return "\n".join(["this run differs from every recorded run:", *lines, f"this run: {json.dumps(run)}"])


def machine() -> str:
    """The CPU's name, and on x86 its widest vector instructions: one model name (``AMD EPYC``)
    is sold with and without AVX-512, and XLA's code, so the losses, differ between them."""
    info = _cpuinfo()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)
    return f"{platform.machine()} {cpu}{f' ({isa})' if isa else ''}".strip()


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def record(add: bool = False) -> Path:
    """Runs the main job once per instruction set cap and writes this jax version's file."""
    path = golden_file()
    kept = json.loads(path.read_text())["runs"] if add and path.is_file() else {}
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}
    recorded = {**versions, "optax": optax.__version__, "command": ["fsdp-tp", *COMMAND]}
    recorded["runs"] = kept
    caps = X86_CAPS if platform.machine() in ("x86_64", "AMD64") else ()
    with tempfile.TemporaryDirectory() as where:
        for cap in (None, *caps):
            run = main_job(Path(where), cap)
            if not matching(run, recorded):
                name = f"{machine()}, {f'XLA capped at {cap}' if cap else 'XLA uncapped'}"
                recorded["runs"][name] = run
    GOLDEN.mkdir(exist_ok=True)
    path.write_text(json.dumps(recorded, indent=1) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.golden_losses", description=__doc__.split("\n")[0])
    parser.add_argument("--add", action="store_true", help="keep the file's runs and add this machine's")
    print(f"wrote {record(parser.parse_args().add)}")

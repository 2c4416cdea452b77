"""The suite's time, cold and warm, per lane: the one command every report of it comes from.

For each lane (a Python with the project installed: by default ``.venv`` for Python 3.11 with
jax 0.10 and ``.venv312`` for 3.12 with jax 0.12, those that exist), the README's test command
runs twice over a new, empty compilation cache (``fsdp_tp.compile_cache``): **cold**, as on a
fresh machine (programs compiled twice in the run still compile once), then **warm**, the same
tree run again (CI after a developer's run). Then the programs compiled are added to the user's
own cache (``~/.cache/fsdp_tp/jax``; on CPU a cache is relocatable), which the runs did not read,
so the next run there is warm. Printed: each run's wall time, its tests, the programs read from
the cache and compiled, and warm ÷ cold::

    python tests/suite_time.py                      # both lanes, the whole suite (about 40 min)
    python tests/suite_time.py --lane .venv/bin/python -- tests/test_nnx.py   # one lane, one file

Arguments after ``--`` go to pytest in place of the whole suite; ``--log DIR`` keeps each run's
output (its per-file table says where the time went); ``--record`` writes the table into
``docs/benchmarks.md``'s section on the suite (``--record PAGE``: another page). Run it on an
idle machine:
the times are the machine's, and say nothing of another.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_tp import compile_cache
from fsdp_tp.bench.report import SUITE_END, SUITE_START

__all__ = ["Run", "main", "record", "run_suite"]

ROOT = Path(__file__).resolve().parents[1]
LANES = (ROOT / ".venv" / "bin" / "python", ROOT / ".venv312" / "bin" / "python")
# The per-file table's last row (conftest.py): seconds, trace, lower, compile, hits, misses.
_IN_ALL = re.compile(r"^\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+in all$", re.M)
_OUTCOME = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)  # ("2 failed, 9 passed in 3.1s")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the suite: wall seconds, pytest's outcome line, cache hits and misses."""

    wall: float
    outcome: str
    hits: int
    misses: int
    returncode: int


def run_suite(python: Path, cache: Path, pytest_args: list[str], log: Path | None = None) -> Run:
    """The README's test command (``python -m pytest``) on ``python``, through ``cache``; its
    output written to ``log``, if given."""
    # (a run started from inside pytest must not pass as one of its workers, nor take its cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_COMPILATION_CACHE"))}
    env["FSDP_TP_COMPILE_CACHE"] = str(cache)
    start = time.monotonic()
    done = subprocess.run(
        [str(python), "-m", "pytest", *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - start
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
    table, outcome = _IN_ALL.search(done.stdout), _OUTCOME.search(done.stdout)
    if table is None or outcome is None:
        raise SystemExit(f"{python}: no pytest summary (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return Run(wall, outcome.group(1), int(table.group(5)), int(table.group(6)), done.returncode)


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def record(page: Path, lanes: dict[str, dict[str, Run]]) -> None:
    """``lanes`` (each lane's cold and warm run) written as the table between ``page``'s suite
    markers (the section added at its end where it has none)."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores"
    rows = [
        SUITE_START,
        f"Measured {when} on {machine} by `python tests/suite_time.py --record`: each lane runs the "
        f"README's test command twice over a new compilation cache, **cold** (a fresh machine) then "
        f"**warm** (the same tree again: CI after a developer's run). Programs: compiled (misses), "
        f"and read from the cache (hits; cold, those compiled earlier in the same run).",
        "",
        "| lane | cold | warm | warm ÷ cold | cold: compiled, read | warm: compiled, read | tests |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for lane, runs in lanes.items():
        cold, warm = runs["cold"], runs["warm"]
        rows.append(
            f"| {lane} | {_minutes(cold.wall)} | {_minutes(warm.wall)} | {warm.wall / cold.wall:.2f} "
            f"| {cold.misses:,}, {cold.hits:,} | {warm.misses:,}, {warm.hits:,} | {warm.outcome} |"
        )
    rows.append(SUITE_END)
    table, text = "\n".join(rows), page.read_text()
    if SUITE_START in text and SUITE_END in text:
        head, rest = text.split(SUITE_START, 1)
        text = head + table + rest.split(SUITE_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n### The test suite\n\n" + table + "\n"
    page.write_text(text)


def _add_to(users: Path | None, cache: Path) -> None:
    """The entries of ``cache`` that ``users`` (the user's cache; ``None``: off) lacks, copied in."""
    if users is None:
        return
    users.mkdir(parents=True, exist_ok=True)
    for entry in cache.iterdir():
        if entry.is_file() and not (users / entry.name).exists():
            shutil.copy2(entry, users / entry.name)


def _versions(python: Path) -> str:
    probe = (
        "import sys, jax, flax; "
        "print(f'Python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}')"
    )
    return subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lane", action="append", type=Path, help="a Python with the project installed")
    parser.add_argument("--log", type=Path, help="a directory for each run's output")
    parser.add_argument(
        "--record", nargs="?", type=Path, const=ROOT / "docs" / "benchmarks.md", help="the page to write"
    )
    args = parser.parse_args(ours)
    lanes = args.lane or [p for p in LANES if p.exists()]
    failed, measured = False, {}
    print(f"{'lane':<45} {'run':<5} {'wall':>8} {'hits':>6} {'misses':>6}  tests")
    for python in lanes:
        label = _versions(python)
        with tempfile.TemporaryDirectory(prefix="fsdp_tp_suite_cache_") as cache:
            runs = measured[label] = {}
            for kind in ("cold", "warm"):
                log = args.log / f"{label.split(',')[0].replace(' ', '')}-{kind}.txt" if args.log else None
                run = runs[kind] = run_suite(python, Path(cache), pytest_args, log)
                minutes = f"{int(run.wall // 60)}:{run.wall % 60:04.1f}"
                print(
                    f"{label:<45} {kind:<5} {minutes:>8} {run.hits:>6} {run.misses:>6}  {run.outcome}",
                    flush=True,
                )
                failed |= run.returncode != 0
            _add_to(compile_cache.cache_dir(), Path(cache))
        print(f"{label:<45} warm / cold = {runs['warm'].wall / runs['cold'].wall:.2f}", flush=True)
    if args.record is not None:
        record(args.record, measured)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The compilation cache the suite and its CLI runs share across runs (fsdp_tp.compile_cache):
a program read from it computes the bits a fresh compile computes, a checkout in another folder
finds the same entries (CI runs a fresh clone elsewhere), and an entry that was cut short or
damaged is compiled again, never run.

Each run is a new process (a process's own jit cache would hide the disk's), in a folder of its
own holding its copy of the program's script: the source paths in the program's debug
information differ between the runs as a fresh clone's do."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_tp import compile_cache
from fsdp_tp.bench.report import suite_section

ROOT = Path(__file__).resolve().parents[1]

# A training step's worth of float work: a two-layer MLP's loss and gradient, and an update.
SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    from fsdp_tp import compile_cache
    compile_cache.enable()
    import jax, jax.numpy as jnp, numpy as np
    events = {"hits": 0, "asked": 0}
    def count(event, **_):
        if event == "/jax/compilation_cache/cache_hits": events["hits"] += 1
        if event == "/jax/compilation_cache/compile_requests_use_cache": events["asked"] += 1
    jax.monitoring.register_event_listener(count)
    SCALE = float(sys.argv[1])

    @jax.jit
    def step(w1, w2, x):
        loss = lambda w1, w2: jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2) * SCALE
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2, loss(w1, w2)

    keys = jax.random.split(jax.random.key(0), 3)
    w1, w2 = jax.random.normal(keys[0], (64, 128)), jax.random.normal(keys[1], (128, 32))
    x = jax.random.normal(keys[2], (16, 64))
    for _ in range(3):
        w1, w2, loss = step(w1, w2, x)
    digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in (w1, w2, loss))).hexdigest()
    print(json.dumps({"digest": digest, **events}))
    """
)


def _run(folder: Path, cache: Path, scale: float = 1.0) -> dict:
    """The script run from its own copy in ``folder``, through the cache in ``cache``: its
    result's digest, the compiles that asked the cache and those it answered, its stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "program.py").write_text(SCRIPT)
    env = {**os.environ, compile_cache.ENV: str(cache), "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "always"}
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_NUM_CPU_DEVICES"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "program.py", str(scale)], cwd=folder, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return {**json.loads(run.stdout.strip().splitlines()[-1]), "stderr": run.stderr}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A cold run: every program compiled and written to a new cache."""
    root = tmp_path_factory.mktemp("compile_cache")
    cache = root / "cache"
    cold = _run(root / "checkout_a", cache)
    return root, cache, cold


def test_a_cold_run_compiles_and_writes_each_program(first_run):
    _, cache, cold = first_run
    assert cold["asked"] > 0 and cold["hits"] == 0
    assert len(list(cache.iterdir())) == cold["asked"]


def test_a_program_from_the_cache_is_bit_identical_and_found_from_another_folder(first_run):
    root, cache, cold = first_run
    warm = _run(root / "elsewhere" / "checkout_b", cache)  # (another path in every debug location)
    assert warm["hits"] == warm["asked"] == cold["asked"]
    assert warm["digest"] == cold["digest"]


def test_a_cache_copied_elsewhere_is_still_warm(first_run, tmp_path):
    """On CPU the cache's own path is not in the key (no GPU autotuning cache named inside it):
    a cache restored to another place (a CI system's saved cache) is read as it was."""
    root, cache, cold = first_run
    copy = tmp_path / "restored"
    shutil.copytree(cache, copy)
    moved = _run(root / "checkout_d", copy)
    assert moved["hits"] == moved["asked"] == cold["asked"]
    assert moved["digest"] == cold["digest"]


def test_negative_control_another_program_misses(first_run):
    """The hits counted above are the cache's answers: a program that differs (one constant)
    compiles anew, and computes other bits."""
    root, cache, cold = first_run
    other = _run(root / "checkout_c", cache, scale=2.0)
    assert other["hits"] < other["asked"]
    assert other["digest"] != cold["digest"]


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_entry_is_compiled_again_not_trusted(first_run, damage, tmp_path):
    """An entry cut short (a process killed while writing it) or with bytes changed is refused
    with JAX's warning, the program compiled again, and the result the fresh compile's, bit for
    bit."""
    _, first_cache, cold = first_run
    cache = tmp_path / "cache"
    shutil.copytree(first_cache, cache)
    for entry in cache.iterdir():
        data = bytearray(entry.read_bytes())
        if damage == "truncated":
            data = data[: len(data) // 2]
        else:
            middle = len(data) // 2
            data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
        entry.write_bytes(bytes(data))
    run = _run(tmp_path / "checkout", cache)
    assert run["hits"] == 0 and run["asked"] == cold["asked"]
    assert run["digest"] == cold["digest"]
    assert run["stderr"].count("Error reading persistent compilation cache entry") == cold["asked"]


def test_off_compiles_without_a_cache_and_the_default_is_the_user_s_cache_directory(tmp_path):
    assert compile_cache.cache_dir({compile_cache.ENV: "off"}) is None
    assert compile_cache.cache_dir({compile_cache.ENV: str(tmp_path)}) == tmp_path
    assert compile_cache.cache_dir({}) == Path.home() / ".cache" / "fsdp_tp" / "jax"
    assert compile_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "fsdp_tp" / "jax"


def test_the_cache_is_trimmed_to_its_bound_least_recently_used_first(tmp_path):
    for age, name in enumerate(["used-long-ago", "written-long-ago-read-today", "new"]):
        (tmp_path / name).write_bytes(b"x" * 100)
        os.utime(tmp_path / name, (age, age))
    os.utime(tmp_path / "written-long-ago-read-today", (10**9, 0))  # (its access time: read later)
    removed = compile_cache.evict(tmp_path, max_bytes=250)
    assert [p.name for p in removed] == ["used-long-ago"]
    assert compile_cache.evict(tmp_path, max_bytes=200) == []
    assert sorted(p.name for p in compile_cache.evict(tmp_path, max_bytes=0)) == [
        "new",
        "written-long-ago-read-today",
    ]


def test_the_suite_s_timing_script_runs_a_lane_cold_then_warm(tmp_path):
    """tests/suite_time.py, the one command every report of the suite's time comes from, as it
    is typed, on one test of this lane: the cold run compiles through a new cache, the warm one
    reads from it every program the cold one asked for, both pass, what they compiled is added to
    the user's cache (here a directory of the test's), and --record writes the lane's row into
    the benchmarks page's section, which the bench carries over when it writes the page anew."""
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n" + suite_section(None) + "\n### After\n")
    one_test = "tests/test_fsdp_units.py::test_gather_inverts_shard"
    argv = [sys.executable, "tests/suite_time.py", "--lane", sys.executable, "--record", str(page)]
    argv += ["--", one_test, "-n", "0", "-q"]
    users = tmp_path / "users_cache"
    env = {**os.environ, compile_cache.ENV: str(users)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = dict(re.findall(r"(cold|warm) +\S+ +(\d+ +\d+) +1 passed$", done.stdout, re.M))
    (cold_hits, cold_misses), (warm_hits, warm_misses) = (map(int, rows[k].split()) for k in ("cold", "warm"))
    # (cold: a program the run compiles twice is read the second time)
    assert cold_misses > 0 and warm_misses == 0 and warm_hits == cold_hits + cold_misses, done.stdout
    assert "warm / cold = " in done.stdout
    assert len(list(users.iterdir())) == cold_misses
    written = page.read_text()
    assert "Not measured yet" not in written and written.endswith("\n### After\n")
    (row,) = [line for line in written.splitlines() if line.startswith(f"| Python {sys.version.split()[0]}")]
    assert row.endswith(f"| {cold_misses:,}, {cold_hits:,} | 0, {warm_hits:,} | 1 passed |"), row
    assert row in suite_section(written)  # (what the bench writes into the page anew)

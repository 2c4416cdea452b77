"""Test set-up shared by tests/ and the doctests in src/: 8 simulated CPU devices and
hypothesis profiles. It runs before any test module imports jax's backend."""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


# XLA's CPU backend generates cheaper code for the tests (and the CLI runs they start) than for a
# user. The XLA passes before code generation run either way, so every collective, byte and
# memory figure a test reads is the same; only LLVM's work and the emitted code differ.
# - LLVM -O0: compiling is 2.8x cheaper than at -O1 (the unsharded LM's gradient in
#   test_tp_rules: 0.55 s -> 0.20 s), and the suite compiles hundreds of small programs to run
#   each 1-3 steps.
# - The instruction set capped at AVX, below FMA: code generated at -O0 may fuse a multiply and
#   an add into one FMA in one program and not in another (seen: two programs' init values 1
#   ulp apart); without FMA every program rounds every op alike, as the bit-for-bit init,
#   equivalence and resume tests need.
# - XLA's elemental fusion emitter instead of its MLIR fusion emitters where this jaxlib still
#   has both (0.10; 0.11 has only the MLIR ones and rejects the flag).
# - LLVM's module compiled in one piece, not split for parallel code generation: the suite's
#   programs are small and its workers already fill the cores. Measured on jax 0.10.2 (2
#   cores), compiling four of test_tp_rules' AdamW steps: 1.54-1.65 s against 1.88 s split;
#   on jax 0.12.0.1 no difference beyond the noise (3.6-3.9 s against 3.5-3.8 s).
# Measured on the whole suite, 2 workers, 2 cores, jax 0.10.2: 943.9 s at -O2, 779.5 s at -O1,
# 593.8 s with the elemental emitter too (an earlier suite); then, back to back on today's suite,
# 917.8 s with those two and 669.9 s with these three. Every CLI process a test starts inherits
# them (a test may compare its run with theirs bit for bit); the golden-loss test's run does not
# (it runs what a user runs). A developer's own XLA_FLAGS are kept.
CHEAP_CODEGEN = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_max_isa=AVX",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag``. XLA aborts a process that names an unknown
    flag in XLA_FLAGS, so a child process (half a second) finds out."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return child.returncode == 0


def _with_cheap_codegen(flags: str) -> str:
    """``flags`` with each of CHEAP_CODEGEN this XLA knows and ``flags`` does not set."""
    for flag in CHEAP_CODEGEN:
        name = flag.split("=")[0]
        # (every XLA knows its optimization level: no child process to ask)
        if name not in flags and (name == "--xla_backend_optimization_level" or _xla_accepts(flag)):
            flags = f"{flags} {flag}".strip()
    return flags


os.environ["XLA_FLAGS"] = _with_cheap_codegen(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402  (after the environment above: jax reads it at import)
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from fsdp_tp import compile_cache  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# XLA's compiled programs kept across runs (fsdp_tp.compile_cache: ~/.cache/fsdp_tp/jax, or
# $FSDP_TP_COMPILE_CACHE; "off" compiles everything): the xdist workers and the CLI processes the
# tests start share it, so a program compiled twice anywhere (a twin's step, a CLI run two pages
# repeat) compiles once, and a second run of the tree, or CI after a developer's run, compiles
# only what changed. The tests still trace, lower and run every program. The controller trims
# the cache and sets JAX's environment before the xdist workers start; they inherit it.
if "PYTEST_XDIST_WORKER" not in os.environ:
    compile_cache.enable()


# Each test file's time (its tests' setup, call and teardown, summed over the workers that ran
# them), printed after every run, largest first: CI's log shows a file's growth the day it lands.
# Beside it, the seconds JAX spent in the test processes (not in the CLI processes a test
# starts) tracing jitted functions, lowering them to MLIR and compiling them with XLA: the suite
# is compile-bound (test_einsum_tp and test_tp_rules, -n 0: 124 s of XLA compiles, 45 s of
# tracing and 21 s of lowering in 206 s), so the columns say what a file's time is made of. A
# jit traced inside another's trace is counted in both: the trace column is an upper bound.
# The last two columns: the programs read from the compilation cache (hits) and compiled
# (misses: a compile that asked the cache and found nothing, or an entry it could not trust).
_JAX_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": 0,
    "/jax/core/compile/jaxpr_to_mlir_module_duration": 1,
    "/jax/core/compile/backend_compile_duration": 2,
}
_CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": 3,
    "/jax/compilation_cache/compile_requests_use_cache": 4,
}
# this process's, since its last test report: seconds tracing, lowering, compiling; hits, asked
_JAX_SINCE_REPORT = [0.0] * 5
_FILE_SECONDS: dict[str, list[float]] = {}  # file: [seconds, trace, lower, compile, hits, asked]


def _count_jax_durations(event: str, duration: float, **_) -> None:
    if (column := _JAX_EVENTS.get(event)) is not None:
        _JAX_SINCE_REPORT[column] += duration


def _count_cache_events(event: str, **_) -> None:
    if (column := _CACHE_EVENTS.get(event)) is not None:
        _JAX_SINCE_REPORT[column] += 1


jax.monitoring.register_event_duration_secs_listener(_count_jax_durations)
jax.monitoring.register_event_listener(_count_cache_events)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Made where the test ran (an xdist worker), then sent to the controller with its
    # user_properties: each phase's report carries the JAX seconds since the last one.
    report = (yield).get_result()
    report.user_properties.append(("jax_seconds", tuple(_JAX_SINCE_REPORT)))
    _JAX_SINCE_REPORT[:] = [0.0] * len(_JAX_SINCE_REPORT)


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::", 1)[0]
    file = "src/ (the doctests)" if file.startswith("src/") else file
    jax_seconds = dict(report.user_properties).get("jax_seconds", (0.0,) * len(_JAX_SINCE_REPORT))
    row = _FILE_SECONDS.setdefault(file, [0.0] * (1 + len(_JAX_SINCE_REPORT)))
    for i, seconds in enumerate((report.duration, *jax_seconds)):
        row[i] += seconds


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput") or not _FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "seconds per test file (summed over workers)")
    heading = f"{'all':>8}  {'trace':>7}  {'lower':>7}  {'compile':>7}  {'hits':>6}  {'misses':>6}"
    terminalreporter.write_line(f"{heading}  (jax's, in the test processes; programs from the cache)")
    rows = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1][0])
    total = [sum(column) for column in zip(*_FILE_SECONDS.values(), strict=True)]
    for file, (seconds, trace, lower, compiled, hits, asked) in [*rows, ("in all", total)]:
        counts = f"{hits:6.0f}  {asked - hits:6.0f}"
        terminalreporter.write_line(
            f"{seconds:8.1f}  {trace:7.1f}  {lower:7.1f}  {compiled:7.1f}  {counts}  {file}"
        )
    where = compile_cache.cache_dir()
    terminalreporter.write_line(f"compilation cache: {where or 'off'} ({compile_cache.ENV}=off: none)")


# Modules whose tests share a module-scoped fixture that takes a minute to build (the bench's
# compiled figures, an 8-step run's checkpoints). Under xdist each of these modules is one unit
# of work, so the fixture is built once per run, not once on every worker that gets one of its
# tests; every other test is its own unit, as under --dist load. (xdist's --dist loadgroup
# would do this by rewriting node ids, which pytest 9.2 no longer honours:
# pytest-dev/pytest-xdist#1386.)
SHARED_FIXTURE_MODULES = ("tests/test_bench.py", "tests/test_faults.py")
assert all((Path(__file__).parent / m).is_file() for m in SHARED_FIXTURE_MODULES), "a renamed module"


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in SHARED_FIXTURE_MODULES else nodeid

    return SharedFixtureModules(config, log)


_common = dict(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "ci": what the README's test command and .ci/run use (the suite stays near 10 min on 2 cores).
settings.register_profile("ci", max_examples=6, **_common)
# "thorough": for local runs before a release: HYPOTHESIS_PROFILE=thorough pytest
settings.register_profile("thorough", max_examples=60, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

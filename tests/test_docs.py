"""Every code block of the docs runs as written, and every public name is in the API reference.

``python`` blocks of a page run in order in one namespace (a page is one script);
``bash`` blocks run in a shell in a temporary directory, with this environment's
``fsdp-tp`` on the PATH. ``console`` blocks (installation, cluster launchers) and
``text`` blocks (sample output) are shown, not run: the test environment is installed.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_tp

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def test_every_page_fences_its_blocks_with_a_known_language():
    for page in PAGES:
        for lang, _ in FENCE.findall(page.read_text()):
            assert lang in ("python", "bash", "console", "text"), f"{page.name}: ```{lang} block"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path):
    """A page's blocks, in order, as one script in a fresh process, as a new user on a CPU
    machine runs them: one CPU device until the page makes more (a page that forgot
    ``simulate_cpu_devices`` failed for users and passed here, in the suite's 8 devices)."""
    script = tmp_path / f"{page.stem}.py"
    parts = (f"# {page.name} block {i + 1}\n{b}" for i, b in enumerate(blocks(page, "python")))
    script.write_text("\n".join(parts))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES",)}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    run_as_reader([sys.executable, str(script)], tmp_path, page.name, env)


def run_as_reader(argv: list[str], where: Path, label: str, env: dict | None = None) -> str:
    """Runs ``argv`` in ``where`` as the reader would (this environment's ``fsdp-tp`` on the
    PATH, ``examples/`` where a reader in the repository finds it); its standard output."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    (where / "examples").symlink_to(ROOT / "examples")  # paths as a reader in the repository types them
    done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{label}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def run_bash(source: str, where: Path, label: str, env: dict | None = None) -> str:
    """Runs ``source`` in a shell as the reader would, in ``where``; its standard output."""
    return run_as_reader(["bash", "-euo", "pipefail", "-c", source], where, f"{label}:\n{source}", env)


def bash_blocks() -> dict[str, list[str]]:
    """Each distinct ``bash`` block of the docs, and where it is (``page:n``, its n-th block).
    A block two pages show alike (the README repeats a tutorial's) runs once: the same
    commands, the same check."""
    where: dict[str, list[str]] = {}
    for page in PAGES:
        for i, source in enumerate(blocks(page, "bash")):
            where.setdefault(source, []).append(f"{page.name}:{i + 1}")
    return where


PRINTS = re.compile(r"^```bash\n(.*?)^```\n\nWhat it prints:\n\n```text\n(.*?)^```", re.S | re.M)


def printed(source: str) -> str | None:
    """The output a page shows under "What it prints:" right after ``source``'s block."""
    found = (text for page in PAGES for bash, text in PRINTS.findall(page.read_text()) if bash == source)
    return next(found, None)


def shape(text: str) -> list[str]:
    """``text``'s lines with every number a ``#``: what a run prints, whatever its speed."""
    return [re.sub(r"\d[\d,.]*", "#", line) for line in text.strip().splitlines()]


@pytest.mark.parametrize("source", [pytest.param(s, id="+".join(w)) for s, w in bash_blocks().items()])
def test_bash_blocks_run(source, request, tmp_path):
    out = run_bash(source, tmp_path, request.node.callspec.id)
    if (shown := printed(source)) is not None:  # (issue 61: the quickstart showed last year's lines)
        assert shape(out) == shape(shown), out


def test_the_readme_main_job_runs_as_written(tmp_path):
    """The README's first command: set-up (what this environment is) then the main job, as typed."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"\*\*Run the main job\*\*.*?\n\n    ([^\n]+)\n", readme, re.S).group(1)
    setup = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    assert command.startswith(setup), command
    # As typed by a reader, whose XLA compiles as a user's does, not as the tests' (conftest's
    # CHEAP_CODEGEN: its cheap code runs these 300 steps at half the speed).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = run_bash(command.removeprefix(setup), tmp_path, "README main job", env)
    # The console script in a fresh process, with its own 8 simulated devices, to the end.
    assert "mesh data=2 x fsdp=2 x tensor=2 on 8 cpu devices" in out and "done: loss" in out, out[-2000:]


def test_every_public_name_is_in_the_api_reference_with_an_example():
    reference = (ROOT / "docs" / "api.md").read_text()
    for name in fsdp_tp.__all__:
        assert f"::: fsdp_tp.{name}\n" in reference, f"fsdp_tp.{name} is missing from docs/api.md"
        obj = getattr(fsdp_tp, name)
        if isinstance(obj, (str, tuple)):  # constants: documented by their module's docstring
            obj = sys.modules["fsdp_tp.mesh"]
        doc = inspect.getdoc(obj) or ""
        assert ">>>" in doc, f"fsdp_tp.{name}: the docstring needs a runnable example"

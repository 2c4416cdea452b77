"""Faults (issue 16): corrupted checkpoints are never trained on and no good one is lost; a
failing save ends the run in seconds; a non-finite step is never saved; a missing coordinator
says so; the coordinator listens where it was told."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_tp.checkpoint import Checkpoints
from fsdp_tp.checkpoint._integrity import fingerprints
from fsdp_tp.cli import main
from fsdp_tp.cli.output import library_logs
from fsdp_tp.cli.workdir import saved_steps
from fsdp_tp.errors import CheckpointCorruptError, CheckpointSaveError
from fsdp_tp.recipe import trainer as trainer_module

pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
RUN = [
    "train",
    "--steps",
    "8",
    "--checkpoint-every",
    "2",
    "--keep",
    "4",
    "--eval-every",
    "0",
    "--log-every",
    "100",
]


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r}


def _largest_array_file(checkpoint: Path) -> Path:
    files = [p for p in (checkpoint / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _flip(checkpoint: Path) -> None:
    file = _largest_array_file(checkpoint)
    data = bytearray(file.read_bytes())
    for i in range(16):  # 16 bytes in the middle of the largest array file
        data[len(data) // 2 + i] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(checkpoint: Path) -> None:
    file = _largest_array_file(checkpoint)
    os.truncate(file, file.stat().st_size // 2)


def _delete_metadata(checkpoint: Path) -> None:
    (checkpoint / "state" / "_METADATA").unlink()


def _edit_meta(field: str, value):
    """Issue 34 point 12: meta/metadata was outside the fingerprints; its "step" edited from 30
    to 35 resumed step 30's state as step 35."""

    def edit(checkpoint: Path) -> None:
        path = checkpoint / "meta" / "metadata"
        meta = json.loads(path.read_text())
        meta[field] = value
        path.write_text(json.dumps(meta))

    return edit


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, Path]:
    """Checkpoints 2, 4, 6, 8 of an 8-step run, and its log."""
    root = tmp_path_factory.mktemp("good")
    log = root / "log.jsonl"
    assert run(*RUN, "--checkpoint-dir", str(root / "ckpt"), "--log-file", str(log))[0] == 0
    return root / "ckpt", log


@pytest.mark.parametrize(
    "damage",
    [_flip, _truncate, _delete_metadata, _edit_meta("step", 9), _edit_meta("seed", 1)],
    ids=["flip", "truncate", "metadata", "meta-step", "meta-seed"],
)
def test_a_damaged_newest_checkpoint_is_skipped_and_moved_aside(good, damage, tmp_path):
    source, whole_log = good
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    shutil.copytree(source, ckpt)
    damage(ckpt / "8")
    code, out = run(*RUN, "--checkpoint-dir", str(ckpt), "--resume", "--log-file", str(log))
    assert code == 0, out
    assert f"skipped checkpoint {ckpt / '8'}: " in out and "moved it to corrupt-8" in out
    assert f"resumed from {ckpt / '6'} at step 6" in out
    assert losses(log) == {s: loss for s, loss in losses(whole_log).items() if s > 6}  # exactly
    assert saved_steps(ckpt) == [2, 4, 6, 8] and (ckpt / "corrupt-8").is_dir()  # nothing good lost


def test_negative_control_orbax_alone_restores_a_silently_changed_checkpoint(good, tmp_path):
    """What only the fingerprints catch: valid bytes that are not the ones saved (checkpoint 6's
    arrays under checkpoint 8's name). orbax reads them without a word. Flipped bytes may or may
    not break a compressed chunk (orbax then fails loudly); this change never does."""
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "ckpt"
    shutil.copytree(good[0], ckpt)
    shutil.rmtree(ckpt / "8" / "state")
    shutil.copytree(ckpt / "6" / "state", ckpt / "8" / "state")
    with ocp.CheckpointManager(ckpt, item_handlers={"state": ocp.StandardCheckpointHandler()}) as manager:
        raw = manager.restore(8, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    meta = json.loads((ckpt / "8" / "meta" / "metadata").read_text())
    assert fingerprints(raw) != meta["fingerprints"]
    code, out = run(*RUN, "--checkpoint-dir", str(ckpt), "--resume", "--steps", "8")
    assert code == 0 and "differ from the fingerprints saved with them" in out
    assert f"resumed from {ckpt / '6'} at step 6" in out


def test_resume_from_picks_a_step_and_every_damaged_checkpoint_is_refused(good, tmp_path, capsys):
    source, whole_log = good
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    shutil.copytree(source, ckpt)
    code, out = run(*RUN, "--checkpoint-dir", str(ckpt), "--resume-from", "4", "--log-file", str(log))
    assert code == 0 and f"resumed from {ckpt / '4'} at step 4" in out
    assert "checkpoints [6, 8], newer than step 4, moved to superseded-6, superseded-8" in out
    assert losses(log) == {s: loss for s, loss in losses(whole_log).items() if s > 4}
    for step in saved_steps(ckpt):
        _flip(ckpt / str(step))
    assert run(*RUN, "--checkpoint-dir", str(ckpt), "--resume")[0] == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "verifies" in err
    assert saved_steps(ckpt) == [2, 4, 6, 8]  # refused, and nothing deleted or trained on


def test_a_save_that_does_not_read_back_keeps_the_older_checkpoints(tmp_path):
    """keep=1: checkpoint 1 is deleted only once a newer one verified; 2, damaged on disk
    before it was read back, never does."""
    state = {"w": jnp.arange(4096.0)}
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save(1, state)
    checkpoints.save(2, state)  # verified 1 first
    checkpoints.wait()
    _flip(tmp_path / "2")
    with pytest.raises(CheckpointSaveError, match=r"checkpoint .*2 was written but does not read back"):
        checkpoints.close()
    assert saved_steps(tmp_path) == [1] and (tmp_path / "corrupt-2").is_dir()
    shutil.copytree(tmp_path / "corrupt-2", tmp_path / "2")  # the bad one, put back under its step
    with Checkpoints(tmp_path) as again:
        assert again.restore(state, step=1)[1]["step"] == 1
        with pytest.raises(CheckpointCorruptError, match=r"1 array\(s\) differ from the fingerprints"):
            again.restore(state, step=2)
        assert again.restore(state)[1]["skipped"].keys() == {2}  # the newest that verifies: 1
    # Under another step's name its meta names the step it was saved as (issue 34 point 12).
    shutil.move(tmp_path / "corrupt-2", tmp_path / "3")
    with (
        Checkpoints(tmp_path) as again,
        pytest.raises(CheckpointCorruptError, match="says step 2, but it is checkpoint 3"),
    ):
        again.restore(state, step=3)


def test_keep_holds_across_a_resume(tmp_path):
    """Issue 61: a run kept 5, its resume with keep=3 saved one more and kept 6: only the saves
    read back in this process counted. The checkpoints older than the one restored were verified
    by their own run; they count too."""
    state = {"w": jnp.arange(64.0)}
    with Checkpoints(tmp_path, keep=5) as first:
        for step in range(1, 9):
            first.save(step, state)
    assert saved_steps(tmp_path) == [4, 5, 6, 7, 8]
    with Checkpoints(tmp_path, keep=3) as resumed:
        resumed.restore(state)
        resumed.save(9, state)
    assert saved_steps(tmp_path) == [7, 8, 9]
    with Checkpoints(tmp_path, keep=3) as unread:  # nothing verified here: nothing deleted
        unread.save(10, state)
        unread.wait()
        assert saved_steps(tmp_path) == [7, 8, 9, 10]


def test_a_checkpoint_directory_removed_during_the_run_is_one_line(tmp_path):
    """Issue 34 point 8: a directory deleted mid-run ended in a raw FileNotFoundError (the
    unreadable checkpoint could not be set aside)."""
    directory = tmp_path / "ckpt"
    checkpoints = Checkpoints(directory, keep=1)
    checkpoints.save(1, {"w": jnp.ones(8)})
    checkpoints.wait()
    shutil.rmtree(directory)
    with pytest.raises(
        CheckpointSaveError, match=r"1 was written but is gone: .* was deleted or moved during the run"
    ):
        checkpoints.save(2, {"w": jnp.ones(8)})


# --- a save that fails: its own process, since orbax leaves threads waiting in the process ---

FAILING_SAVE = textwrap.dedent(
    """
    import os, subprocess, sys
    from fsdp_tp.checkpoint import Checkpoints

    save = Checkpoints.save

    def save_then_fail(self, step, *args, **kwargs):
        if step == int(os.environ["FAIL_AT_STEP"]):
            self.wait()  # the earlier saves complete; the disk fails after them
            if os.environ["HOW"] == "raise":
                import orbax.checkpoint as ocp
                async def full(*a, **k):  # as orbax's own: a coroutine that raises when awaited
                    raise OSError(28, "No space left on device")
                ocp.StandardCheckpointHandler.async_save = full
            elif os.environ["HOW"] == "file-size-limit":
                # A real filesystem refusal, in the middle of tensorstore's concurrent writes:
                # no file may grow past 64 KB (the log stays under it), and EFBIG, not SIGXFSZ.
                import resource, signal
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
            elif os.environ["HOW"] == "cut-short":
                # What the file-size limit's run left under load: a write the failure cut short,
                # never awaited, alive until the interpreter's exit reports it (on stderr).
                async def write():
                    pass
                global CUT_SHORT
                CUT_SHORT = write()
                def refuse(*a, **k):
                    raise OSError(27, "File too large")
                self._manager.save = refuse
            else:
                subprocess.run(os.environ["HOW"], shell=True, check=True)
        return save(self, step, *args, **kwargs)

    Checkpoints.save = save_then_fail
    from fsdp_tp.cli import console
    sys.argv = ["fsdp-tp", *sys.argv[1:]]
    console()
    """
)


def _fail_a_save(ckpt: Path, how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAIL_AT_STEP": "4", "HOW": how}
    argv = [*RUN, "--steps", "40", "--checkpoint-dir", str(ckpt)]
    return subprocess.run(
        [sys.executable, "-c", FAILING_SAVE, *argv], env=env, capture_output=True, text=True, timeout=240
    )


def _read_only(directory: Path) -> str | None:
    """A shell command that makes ``directory`` read-only for this process's user, or ``None``."""
    if os.geteuid() != 0:
        return f"chmod -R a-w {directory}"
    # root ignores permission bits: a read-only bind mount is what refuses root's writes. Made
    # in the run's process at the failing step (its open lock file is on the mount below).
    probe = Path(tempfile.mkdtemp())
    command = "mount --bind {0} {0} && mount -o remount,bind,ro {0}"
    works = subprocess.run(command.format(probe), shell=True, capture_output=True).returncode == 0
    subprocess.run(["umount", str(probe)], capture_output=True)
    return command.format(directory) if works else None


@pytest.mark.parametrize("how", ["read-only", "raise", "file-size-limit", "cut-short"])
def test_a_failing_save_ends_the_run_in_seconds_with_one_line(tmp_path, how):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    command = how if how != "read-only" else _read_only(ckpt)
    if command is None:
        pytest.skip("no way to make a directory read-only for root here (no chmod effect, no mount)")
    try:
        began = time.monotonic()
        done = _fail_a_save(ckpt, command)
        seconds = time.monotonic() - began
        errors = [line for line in done.stderr.splitlines() if line.startswith("fsdp-tp: error:")]
        assert done.returncode == 1, done.stderr[-3000:]
        assert len(errors) == 1 and str(ckpt) in errors[0], done.stderr[-3000:]
        assert done.stderr.strip() == errors[0], done.stderr[-3000:]  # no orbax/absl logs (issue 34.11)
        cause = {
            "read-only": "Read-only file system",
            "file-size-limit": "File too large",
            "cut-short": "File too large",
        }
        assert cause.get(how, "No space left on device") in errors[0]
        assert seconds < 120 and "done: loss" not in done.stdout
        assert saved_steps(ckpt) == [2]  # the good checkpoint stays
    finally:
        subprocess.run(["umount", str(ckpt)], capture_output=True)
        subprocess.run(["chmod", "-R", "u+w", str(ckpt)], capture_output=True)


def test_only_the_echoes_of_a_failed_saves_abandoned_writes_are_kept_off_the_terminal(monkeypatch):
    """The filter behind the one line above: asyncio's closed-loop error from a tensorstore
    thread and orbax's unretrieved task are dropped; every other unraisable error and asyncio
    record still reaches the terminal (the negative controls), and ``--verbose`` keeps all."""
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])  # it stays for the process
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)  # what a tensorstore thread does after orbax's loop closed
    except RuntimeError as err:
        closed = err

    def unraisable(err):
        return types.SimpleNamespace(exc_type=type(err), exc_value=err, exc_traceback=err.__traceback__)

    try:
        raise RuntimeError("Event loop is closed")  # the same words from elsewhere
    except RuntimeError as err:
        elsewhere = err

    def task(coro_file):  # an orbax write's task names its coroutine's file
        message = f"Task exception was never retrieved\nfuture: <Task finished coro=<save() {coro_file}>>"
        return logging.LogRecord("asyncio", logging.ERROR, "", 0, message, None, None)

    def gathering(raised_in):  # asyncio.gather's future names no file: the error's frames do
        try:
            exec(compile("raise ValueError('File too large')", raised_in, "exec"))
        except ValueError as err:
            info = (ValueError, err, err.__traceback__)
        message = "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished>"
        return logging.LogRecord("asyncio", logging.ERROR, "", 0, message, None, info)

    for verbose in (True, False):
        seen.clear()
        with library_logs(verbose):
            for err in (closed, elsewhere):
                sys.unraisablehook(unraisable(err))
            records = [make(f) for make in (task, gathering) for f in ("orbax/x.py", "mine.py")]
            # bool: Logger.filter hands back the record itself from Python 3.12 on
            kept = [bool(logging.getLogger("asyncio").filter(record)) for record in records]
        assert [u.exc_value for u in seen] == ([closed, elsewhere] if verbose else [elsewhere])
        assert kept == ([True] * 4 if verbose else [False, True, False, True])


# --- non-finite steps ---


def _poisoned(when):
    """The CLI's step, with nan gradients and loss where ``when(state, windows)`` holds."""

    def step_fn(settings, model):
        real = _real_step_fn(settings, model)

        def step(state, windows):
            grads, loss = real(state, windows)
            scale = jnp.where(when(state, windows), jnp.nan, 1.0)
            return jax.tree.map(lambda g: g * scale, grads), loss * scale

        return step

    return step_fn


def _at_step_4(state, windows):
    return state.step == 3  # 0-based: the 4th update


def _odd_first_token(state, windows):  # some batches, whatever the state: an odd sum of the tokens
    return jax.lax.psum(windows.sum(), trainer_module.BATCH_AXES) % 2 == 1


_real_step_fn = trainer_module.step_fn


def test_a_nonfinite_step_stops_the_run_before_it_is_saved(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer_module, "step_fn", _poisoned(_at_step_4))
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = [*RUN, "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt), "--log-file", str(log)]
    code, _ = run(*argv)
    err = capsys.readouterr().err
    assert code == 1 and "not finite; stopped before saving it" in err, err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    bad = next(r["step"] for r in records if r.get("finite") is False)
    assert bad == 4 and f"step {bad}:" in err and saved_steps(ckpt) == list(range(1, bad))
    with Checkpoints(ckpt) as checkpoints:  # the newest checkpoint is good and finite
        state, meta = checkpoints.restore(_abstract_state(ckpt))
    assert meta["step"] == bad - 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def _abstract_state(ckpt: Path):
    """A restore target built from what the checkpoint says it holds (any mesh will do)."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(ckpt, item_handlers={"state": ocp.StandardCheckpointHandler()}) as m:
        tree = m.item_metadata(m.latest_step())["state"]
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), getattr(tree, "tree", tree))


def test_skip_goes_on_past_nonfinite_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "step_fn", _poisoned(_odd_first_token))
    log = tmp_path / "log.jsonl"
    code, out = run(*RUN, "--nonfinite", "skip", "--log-file", str(log))
    records = [json.loads(line) for line in log.read_text().splitlines() if "step" in json.loads(line)]
    skipped = [r["step"] for r in records if r.get("finite") is False]
    assert code == 0 and skipped and len(skipped) < 8, out
    assert all(f"step {s}: loss nan or its update is not finite; skipped it" in out for s in skipped)
    assert np.isfinite([r["loss"] for r in records if r.get("finite", True)]).all()


def test_a_run_whose_every_step_was_skipped_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue 42: ``--lr 1e308 --nonfinite skip`` skipped every step and exited 0 with
    'done: loss nan -> nan'."""
    monkeypatch.setattr(trainer_module, "step_fn", _poisoned(lambda state, windows: True))
    code, _ = run(*RUN, "--nonfinite", "skip", "--steps", "3")
    err = capsys.readouterr().err
    assert code == 1 and "none of the 3 steps was finite" in err and "nothing was trained" in err, err
    assert len(err.strip().splitlines()) == 1, err


# --- the coordinator ---


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners(port: int) -> list[str]:
    """``tcp 127.0.0.1`` / ``tcp6 ::`` for each socket listening on ``port`` (from /proc)."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(f"{table} {address}")
    return found


def test_the_coordinator_listens_on_the_host_it_was_given(tmp_path):
    port = _free_port()
    argv = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdp_tp",
            "train",
            "--cpu-devices",
            "4",
            "--coordinator-timeout",
            "60",
            *argv,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while not _listeners(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        # 127.0.0.1 as /proc writes it, on an IPv4 socket or IPv4-mapped on an IPv6 one; JAX's
        # default is tcp6 0000...0000 (::, every interface).
        loopback = {"tcp 0100007F", "tcp6 0000000000000000FFFF00000100007F"}
        assert _listeners(port) and set(_listeners(port)) <= loopback, _listeners(port)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_without_its_coordinator_gives_up_with_one_line():
    port = _free_port()  # nobody listens there
    argv = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"]
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_tp", "train", "--cpu-devices", "4", "--coordinator-timeout", "3", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and time.monotonic() - began < 60, done.stderr[-2000:]
    assert f"could not reach the coordinator at 127.0.0.1:{port} within 3 s" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("where", ["port-in-use", "not-this-machine"])
def test_process_0_refuses_a_coordinator_it_cannot_listen_on(where):
    """Issue 34 points 2 and 8: a second process 0 on a port in use took the first one's place,
    and both aborted (after 2 s and 300 s); a host that is not this machine's ended in a
    traceback. Now process 0 exits 2 with one line before joining."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        host = "127.0.0.1" if where == "port-in-use" else "192.0.2.1"  # TEST-NET-1: nobody's
        argv = ["--coordinator", f"{host}:{port}", "--num-processes", "2", "--process-id", "0"]
        done = subprocess.run(
            [sys.executable, "-m", "fsdp_tp", "train", "--cpu-devices", "4", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
    said = {
        "port-in-use": "something on this machine listens there already",
        "not-this-machine": "HOST must be an address of its own machine",
    }[where]
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"fsdp-tp: error: --coordinator {host}:{port}: process 0 cannot listen")
    assert said in done.stderr


# --- the data changed under a run ---


def test_a_token_file_truncated_during_a_run_ends_it_with_one_line(tmp_path):
    """Issue 34 point 8: truncating the .bin a run reads killed it with SIGBUS and no word (the
    memory map's pages were gone). Tokens are read with ``pread`` now: exit 1, one line."""
    from tests.processes import command

    data, log = tmp_path / "tokens.bin", tmp_path / "log.jsonl"
    np.random.default_rng(0).integers(0, 200, size=400_000, dtype=np.uint16).tofile(data)
    process = subprocess.Popen(
        [
            *command(),
            "train",
            "--steps",
            "100000",
            "--eval-every",
            "0",
            "--data",
            str(data),
            "--log-file",
            str(log),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    began = time.monotonic()
    while not (log.exists() and '"step": 3' in log.read_text()):
        assert process.poll() is None and time.monotonic() - began < 300, process.communicate()
        time.sleep(0.2)
    with open(data, "r+b") as file:
        file.truncate(4096)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1, (process.returncode, err[-3000:])
    assert err.strip() == (
        f"fsdp-tp: error: --data {data} was changed while the run read it (800,000 bytes when "
        "opened, 4,096 now); give a run a file nobody writes: write new data to another file."
    )


def test_a_truncation_between_the_check_and_the_read_is_an_error_not_sigbus(tmp_path, monkeypatch):
    """CI once saw the run above die with SIGBUS (-7): the file was truncated after the batch's
    check and before its read of a memory map. Tokens are now read by ``pread``, whose short read
    is an error even when the truncation lands after the check (the check is switched off here
    to put it there). Negative control: a memory map read after the same truncation is SIGBUS."""
    from fsdp_tp.recipe.data import load_tokens, windows_at
    from fsdp_tp.recipe.token_file import DataChangedError, TokenFile

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 200, size=100_000, dtype=np.uint16).tofile(data)
    tokens = load_tokens(str(data))
    first = windows_at(tokens, 0, 8, 64, seed=0)
    monkeypatch.setattr(TokenFile, "_check_unchanged", lambda self: None)
    os.truncate(data, 4096)
    with pytest.raises(DataChangedError, match="200,000 bytes when opened, 4,096 now"):
        for step in range(1, 50):  # some window of 8 x 49 starts past the first 2,048 tokens
            windows_at(tokens, step, 8, 64, seed=0)
    assert first.shape == (8, 65)

    np.random.default_rng(0).integers(0, 200, size=100_000, dtype=np.uint16).tofile(data)
    mapped = textwrap.dedent(f"""
        import os, numpy as np
        tokens = np.memmap({str(data)!r}, dtype=np.uint16, mode="r")
        os.truncate({str(data)!r}, 4096)
        print(int(tokens[90_000]))
    """)
    done = subprocess.run([sys.executable, "-c", mapped], capture_output=True, text=True, timeout=60)
    assert done.returncode == -7, (done.returncode, done.stderr[-2000:])


# --- asked to stop: SIGINT and SIGTERM ---


def test_a_signal_delivered_twice_at_once_stops_between_steps():
    """A scheduler signals every process of a job, and a supervised child's parent passes its own
    on: the copy within a second is the same request. A second signal later stops at once."""
    import signal

    from fsdp_tp.cli.stopping import COPY_WITHIN, Stopped, Stopping

    stopping = Stopping()
    stopping.note(signal.SIGTERM, None)
    stopping.note(signal.SIGTERM, None)  # the copy: noted, not raised
    with pytest.raises(Stopped):
        stopping.check()
    stopping.at -= COPY_WITHIN  # a second later: asked again
    with pytest.raises(Stopped):
        stopping.note(signal.SIGTERM, None)
    with pytest.raises(Stopped):  # another signal at once: not a copy
        stopping.note(signal.SIGINT, None)


@pytest.mark.parametrize("name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_between_steps_with_one_line_naming_the_checkpoint(tmp_path, name, code):
    """Issue 34 point 13: SIGINT printed a KeyboardInterrupt traceback and SIGTERM nothing. Now
    the run ends after the step under way, that step saved (issue 61: it kept only the last
    periodic checkpoint) and verified, with one line naming the step and the checkpoint
    --resume continues from, and the shell's code."""
    import signal

    from tests.processes import command

    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = [
        "train",
        "--steps",
        "100000",
        "--checkpoint-every",
        "5",
        "--eval-every",
        "0",
        "--log-every",
        "1000",
    ]
    process = subprocess.Popen(
        [*command(), *argv, "--checkpoint-dir", str(ckpt), "--log-file", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    began = time.monotonic()
    while not (log.exists() and any('"step": 7' in line for line in log.read_text().splitlines())):
        assert process.poll() is None and time.monotonic() - began < 300, process.communicate()
        time.sleep(0.2)
    process.send_signal(getattr(signal, name))
    _, err = process.communicate(timeout=120)
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    reached = max(r["step"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r)
    newest = max(saved_steps(ckpt))
    assert err.strip().splitlines()[-1] == (
        f"fsdp-tp: stopped by {name} after step {reached} of 100000; last checkpoint "
        f"{ckpt / str(newest)}; --resume continues from it."
    )
    assert newest == reached  # saved where it stopped, between two checkpoint steps (issue 61)

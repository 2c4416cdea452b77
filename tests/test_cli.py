"""``fsdp-tp``: trains with a falling loss, --check and its negative control, plan, bad input (issue 5)."""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fsdp_tp.linen._transform
from fsdp_tp.cli import console, main
from fsdp_tp.cli.main import _one_line
from fsdp_tp.errors import ReplicatedParameterWarning
from fsdp_tp.recipe import trainer as trainer_module

pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
SHORT = ["--steps", "40", "--log-every", "10"]


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_train_logs_a_falling_loss(tmp_path):
    log = tmp_path / "log.jsonl"
    code, out = run("train", *SHORT, "--log-file", str(log))
    assert code == 0, out
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 2.0  # bytes: ~ln(256) at first, words learned after
    assert "mesh data=2 x fsdp=2 x tensor=2 on 8 cpu devices" in out and "done: loss" in out


def test_eval_reports_a_held_out_loss(tmp_path):
    log = tmp_path / "log.jsonl"
    code, out = run(
        "train", "--steps", "20", "--eval-every", "10", "--eval-batches", "2", "--log-file", str(log)
    )
    assert code == 0, out
    evals = [r for r in map(json.loads, log.read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert "eval at step 10: held-out loss" in out


def test_bf16_compute_trains_f32_params_and_passes_check(tmp_path):
    log = tmp_path / "log.jsonl"
    code, out = run("train", *SHORT, "--dtype", "bf16", "--check", "2", "--log-file", str(log))
    assert code == 0 and "(bfloat16 compute)" in out and "-> ok" in out, out
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 2.0


@pytest.mark.parametrize(
    ("api", "flag", "name"),
    [
        ("linen", "bf16", "bfloat16"),
        ("nnx", "bf16", "bfloat16"),
        ("linen", "fp8", "float8_e4m3fn"),
        ("nnx", "fp8", "float8_e4m3fn"),
    ],
)
def test_narrow_gathers_pass_check_at_the_f32_tolerance(api, flag, name):
    """f32 compute on parameters gathered in bf16 or in 8 bits (issue 60), the Linen GPT
    (nn.scan over nn.remat) or the NNX one: the twin reads them rounded the same way
    (MixedPrecision.round; 8 bits: each row by its own scale), so the check holds at the f32
    tolerance."""
    code, out = run("train", "--steps", "3", "--gather-dtype", flag, "--check", "2", "--api", api)
    assert code == 0 and "(float32 compute)" in out and "-> ok" in out, out
    assert f"FSDP gathers in {name}, reduces in float32" in out


def test_a_resume_that_changes_the_gather_dtypes_is_named():
    from fsdp_tp.cli.options import parser
    from fsdp_tp.cli.resume import changes, record
    from fsdp_tp.cli.settings import settings_of

    def recorded(*flags):
        args = parser("").parse_args(["train", *flags])
        return record(settings_of(args, {"data": 2, "fsdp": 2, "tensor": 2}), {"name": "bytes"})

    assert changes(recorded(), recorded()) == []
    assert changes(recorded(), recorded("--gather-dtype", "bf16", "--reduce-dtype", "bf16")) == [
        "precision gather: float32 -> bfloat16",
        "precision reduce: float32 -> bfloat16",
    ]


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_checkpoint_of_the_other_api_is_named_by_the_flag(tmp_path, api, capsys):
    """Issue 46 point 5: a Linen checkpoint resumed with --api nnx printed 14 lines of shapes and
    never named --api, though the checkpoint records it. (Negative control: the same --api
    resumes.)"""
    ckpt = str(tmp_path / "ckpt")
    assert run("train", "--steps", "1", "--checkpoint-dir", ckpt, "--eval-every", "0")[0] == 0
    resume = ("--steps", "2", "--checkpoint-dir", ckpt, "--resume", "--allow-changes", "--eval-every", "0")
    code, _ = run("train", *resume, "--api", api)
    err = capsys.readouterr().err
    if api == "linen":
        assert code == 0, err
        return
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "was written with --api linen, and this run is --api nnx" in err and "Resume with --api linen" in err
    )


def test_unrolled_layers_train_and_pass_check():
    code, out = run("train", "--steps", "3", "--no-scan-layers", "--layers", "3", "--check", "2")
    assert code == 0 and "-> ok" in out, out


def test_bf16_computes_in_bf16_on_f32_parameters():
    from fsdp_tp.recipe.config import preset

    config = preset("tiny", dtype="bfloat16")
    ids = np.zeros((2, config.seq_len), np.int32)
    params = jax.eval_shape(config.model().init, jax.random.key(0), ids)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype("float32")}
    hlo = jax.jit(config.model().apply).lower(params, ids).as_text()
    assert "bf16" in hlo and jax.eval_shape(config.model().apply, params, ids).dtype == np.float32


def test_token_file_fits_the_vocabulary(tmp_path):
    """A nanoGPT-style uint16 .bin with ids beyond 256: the vocabulary grows to a multiple of 128."""
    tokens = (np.arange(20_000) * 7 % 1000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    code, out = run("train", "--steps", "2", "--data", str(path), "--eval-every", "0")
    assert code == 0 and re.search(r"done: loss .*, [1-9][\d,]* tokens/s", out), out  # step 2 timed
    code, _ = run("plan", "--vocab-size", "1024")
    assert code == 0


def test_check_passes_on_the_default_mesh_with_async_tp():
    code, out = run("train", "--steps", "1", "--check", "3", "--async-tp", "bidirectional")
    assert code == 0 and "check: 3 steps" in out and "-> ok" in out, out
    assert "(ran in" in out and "compiled by --check)" in out  # not "compiled and ran in 0.0s"
    assert "(one step, which compiled: no tokens/s)" in out and " 0 tokens/s" not in out, out


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "lamb", "lion", "sgd"])
def test_every_optimizer_clipped_passes_check(optimizer):
    """Clipping and the optimizer run on global arrays: the sharded run equals the twin's."""
    code, out = run("train", "--optimizer", optimizer, "--clip-norm", "1.0", "--check", "3", "--steps", "1")
    assert code == 0 and f"({optimizer}, clip 1)" in out and "-> ok" in out, out


def test_negative_control_check_fails_on_a_broken_build(monkeypatch):
    """Gradients left unsynced over the batch shards (the step check reads the forward only;
    without check_vma nothing else sees them): --check must notice and exit 1."""
    monkeypatch.setattr(trainer_module, "sync_gradients", lambda grads, axes: grads)
    code, out = run("train", "--steps", "1", "--check", "3", "--no-check-vma")
    assert code == 1 and "FAILED" in out, out


def test_check_1_compares_an_update_that_moves_the_parameters(monkeypatch):
    """Issue 99 point 7: warmup's first step is at learning rate 0, so ``--check 1`` compared an
    update that moved nothing; it starts one step into the schedule now. (negative control)
    gradients of the wrong sign (synced, so no check refuses them; Adam's update is blind to
    their scale) fail ``--check 1``."""
    code, out = run("train", "--steps", "1", "--check", "1")
    moved = float(out.split("largest parameter difference ")[1].split()[0])
    assert code == 0 and "-> ok" in out and moved > 0, out  # (the update moved the parameters: rounding)
    real = trainer_module.sync_gradients
    monkeypatch.setattr(
        trainer_module, "sync_gradients", lambda grads, axes: jax.tree.map(jnp.negative, real(grads, axes))
    )
    code, out = run("train", "--steps", "1", "--check", "1")
    assert code == 1 and "-> FAILED" in out, out


def test_plan_of_a_cluster_mesh_prints_the_table():
    code, out = run("plan", "--preset", "base", "--mesh", "data=8,fsdp=64,tensor=8", "--batch", "512")
    assert code == 0
    assert out.startswith("mesh data=8 x fsdp=64 x tensor=8 (4096 devices)")
    assert "blocks/mlp/wi/kernel" in out and "(12, 768, 3072)" in out
    # Megatron's plan, found from what the model computes, as the rules a user would write
    rules = out[out.index("tensor=8: Megatron's plan") :].splitlines()[1:]
    assert rules[:3] == [
        "tp_rules = [",
        '    (r"^embed$", VocabParallel()),',
        '    (r"^blocks/attn/query$", ColumnParallel()),',
    ]
    assert '    (r"^blocks/mlp/wo$", RowParallel()),' in rules and rules[-1] == "]"


def test_plan_prints_fsdps_wire_per_split_element():
    """Issue 60 point 2: ``fsdp-tp plan`` gives FSDP's bytes per device per step, per split
    parameter element, from the step's per-device program: over fsdp 4 a ring moves 3/4 of an
    array a device, so f32 gathers and reduce-scatters are 6 B exactly, and fp8 gathers with bf16
    reduce-scatters 3/4 x (1 + 2) B plus the scales (an f32 a row of 64): under 3 B."""
    lines = {}
    for flags in ((), ("--gather-dtype", "fp8", "--reduce-dtype", "bf16")):
        code, out = run("plan", "--mesh", "fsdp=4", "--remat", "none", *flags)
        assert code == 0 and out.count("FSDP over fsdp=4: ") == 1, out
        lines[flags] = out[out.index("FSDP over fsdp=4: ") :].splitlines()[0]
        assert "wire of one step's forward and backward, per device" in out
    f32, fp8 = lines.values()
    assert f32.startswith("FSDP over fsdp=4: 6.000 B per split parameter element per step (float32 gathers")
    figure = float(fp8.split()[3])
    assert 2.25 < figure < 3 and "(float8_e4m3fn gathers, bfloat16 reduce-scatters, remat none" in fp8


def test_narrow_gathers_on_a_mesh_with_no_fsdp_axis_are_refused_with_a_mesh_that_works(capsys):
    """Issue 82 point 5: ``--gather-dtype fp8 --mesh data=8`` printed "FSDP gathers in
    float8_e4m3fn", gathered nothing and trained on fp8-rounded weights. Refused in one line
    naming the flags, the mesh and the fix; the mesh it names plans its fp8 gathers."""
    code, _ = run("plan", "--mesh", "data=4,tensor=2", "--gather-dtype", "fp8", "--reduce-dtype", "bf16")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "--gather-dtype fp8 --reduce-dtype bf16 on --mesh data=4,tensor=2: the mesh has no fsdp axis" in err
    )
    fix = err.split("(--mesh ")[1].split(")")[0]
    assert fix == "fsdp=4,tensor=2"
    code, out = run("plan", "--mesh", fix, "--gather-dtype", "fp8", "--reduce-dtype", "bf16")
    assert code == 0 and "float8_e4m3fn gathers, bfloat16 reduce-scatters" in out, out


def test_every_size_a_tensor_axis_misfits_is_one_refusal_whose_command_plans(capsys):
    """Issue 82 point 8: tensor=3 misfits the heads, kv heads, MLP, vocabulary and sequence,
    refused one size at a time (five rounds). One refusal names them all and one set of flags;
    with them the plan is made."""
    code, _ = run("plan", "--mesh", "data=2,tensor=3")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for flag in ("--heads 4", "--kv-heads 2", "--mlp-hidden 256", "--vocab-size 256", "--seq-len 64"):
        assert f"{flag} " in err.split("; pass ")[0], (flag, err)
    flags = err.split("; pass ")[1].split(", or --mesh")[0].split()
    assert flags == [
        "--heads",
        "6",
        "--kv-heads",
        "3",
        "--mlp-hidden",
        "258",
        "--vocab-size",
        "258",
        "--seq-len",
        "66",
    ]
    code, out = run("plan", "--mesh", "data=2,tensor=3", *flags)
    assert code == 0 and "tp_rules = [" in out, out


def test_bad_data_files_exit_2(tmp_path, capsys):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("")
    short.write_text("too short")
    assert run("train", "--steps", "1", "--data", str(empty))[0] == 2
    assert "is empty" in capsys.readouterr().err
    assert run("train", "--steps", "1", "--data", str(short))[0] == 2
    assert "fewer than two windows" in capsys.readouterr().err
    held_out_too_short = tmp_path / "medium.txt"
    held_out_too_short.write_text("x" * 1000)  # enough to train on, but 5% of it is not two windows
    assert run("train", "--steps", "1", "--data", str(held_out_too_short))[0] == 2
    assert "(held-out part for --eval-every) has 50 tokens" in capsys.readouterr().err
    assert run("train", "--steps", "1", "--data", str(held_out_too_short), "--eval-every", "0")[0] == 0


def test_unknown_preset_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run("train", "--preset", "huge")
    assert exit_info.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_a_reader_that_stops_reading_is_not_an_error():
    """`fsdp-tp plan | head` must not end in a BrokenPipeError traceback (`true` reads nothing
    and has left before the plan's first line, so any preset's output meets a closed pipe)."""
    # The console script's own entry point (console()), from this interpreter's environment
    # whether or not that environment is on the PATH.
    command = f"{shlex.quote(sys.executable)} -m fsdp_tp plan --remat none | true"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("mesh", ["fsdp=8", "fsdp=4,tensor=2"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_fsdp_splits_every_large_parameter_and_passes_check(api, mesh):
    """FSDP splits every parameter above --min-weight-size, and the run equals its twin. On a
    mesh whose tensor axis has one device (a GPU run's default: every device on fsdp) the GPT
    has no Megatron layers: no spec names 'tensor', and the loss reads whole logits as the one
    device's slice. On fsdp=4,tensor=2 a column layer's bias is split over ('tensor', 'fsdp'):
    tensor's blocks, each over fsdp. Either bias stayed whole over fsdp, with a warning."""
    flags = ["--api", api, "--mesh", mesh, "--min-weight-size", "0"]
    code, out = run("plan", *flags, "--remat", "none")
    bias = {"fsdp=8": r"P\(None, 'fsdp'\)", "fsdp=4,tensor=2": r"P\(None, \('tensor', 'fsdp'\)\)"}[mesh]
    assert code == 0 and re.search(rf"blocks/mlp/wi/bias .* {bias} ", out), out
    assert mesh != "fsdp=8" or "'tensor'" not in out, out
    code, out = run("train", *flags, "--steps", "1", "--check", "2", "--eval-every", "0")
    assert code == 0 and "-> ok" in out, out


def test_the_command_prints_a_library_warning_in_one_line_as_it_prints_an_error(monkeypatch, capsys):
    """The executable (``console()``) prints a warning of the library's as ``fsdp-tp: warning:
    <kind>: <message>``, without the console script's file and line (the user of a command wrote
    no line to point at), its advice naming the command's flag; another warning keeps Python's
    form, and after the command Python's display is back. Negative control: ``main()`` in
    process leaves warnings to its caller (here the suite records it: nothing printed)."""
    argv = ["plan", "--mesh", "fsdp=3", "--batch", "12", "--remat", "none", "--min-weight-size", "0"]
    said = "fsdp-tp: warning: ReplicatedParameterWarning: shard_params: parameter embed/embedding"
    monkeypatch.setattr(sys, "argv", ["fsdp-tp", *argv])
    monkeypatch.setattr(fsdp_tp.linen._transform, "_warned", set())  # (said once a process: here)
    python_s = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as exit_info:
            console()
    err = capsys.readouterr().err
    assert exit_info.value.code == 0 and said in err and "sys.exit(console())" not in err, err[-2000:]
    assert "raise --min-weight-size above " in err and " min_weight_size" not in err, err[-2000:]
    assert warnings.showwarning is python_s
    others = []
    _one_line(lambda *shown: others.append(shown[1]))(UserWarning("x"), UserWarning, "f.py", 1)
    assert others == [UserWarning]
    monkeypatch.setattr(fsdp_tp.linen._transform, "_warned", set())
    with pytest.warns(ReplicatedParameterWarning):
        assert run(*argv)[0] == 0
    assert "fsdp-tp: warning" not in capsys.readouterr().err

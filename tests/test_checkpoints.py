"""Sharded checkpoints: resume exactly, reshard onto another mesh, survive SIGKILL mid-save (issue 5)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from fsdp_tp.checkpoint import Checkpoints
from fsdp_tp.cli import main
from fsdp_tp.cli.workdir import saved_steps
from fsdp_tp.errors import CheckpointMismatchError
from fsdp_tp.mesh import make_mesh
from fsdp_tp.recipe.config import preset
from fsdp_tp.recipe.trainer import Trainer
from tests.conftest import settings

pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")
RUN = ["train", "--steps", "12", "--checkpoint-every", "4", "--eval-every", "0", "--log-every", "100"]

# Runs the command, but SIGKILLs the process when orbax is about to commit checkpoint
# $KILL_AT_STEP: its bytes are written, the rename that publishes them has not happened.
KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from orbax.checkpoint._src.path import atomicity

    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def commit_or_die(self):
        if self.get_final().name == os.environ["KILL_AT_STEP"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return await commit(self)

    atomicity.AtomicRenameTemporaryPath.finalize = commit_or_die
    from fsdp_tp.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run(*argv: str) -> int:
    return main(list(argv), out=io.StringIO())


def losses(log) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r}


def test_sigkill_mid_save_keeps_the_last_checkpoint_and_resume_reproduces_the_losses(tmp_path):
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert run(*RUN, "--log-file", str(whole)) == 0
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "KILL_AT_STEP": "8"}
    argv = [*RUN, "--checkpoint-dir", str(ckpt)]
    died = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SAVE, *argv], env=env, capture_output=True, timeout=600
    )
    assert died.returncode == -9, died.stderr.decode()[-2000:]
    leftovers = sorted(p.name for p in ckpt.iterdir())
    assert "4" in leftovers and "8" not in leftovers and any("tmp" in name for name in leftovers), leftovers

    assert run(*argv, "--resume", "--log-file", str(resumed)) == 0
    after = losses(resumed)
    assert sorted(after) == list(range(5, 13))  # continued from checkpoint 4: steps 5 .. 12
    expected = losses(whole)
    assert [after[s] for s in after] == [expected[s] for s in after]  # exactly, not approximately
    assert saved_steps(ckpt) == [4, 8, 12]  # the half-written 8 is gone


def test_resume_on_another_mesh_restores_equal_parameters(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*RUN, "--steps", "4", "--checkpoint-dir", str(ckpt)]
    assert run(*argv, "--mesh", "data=1,fsdp=8,tensor=1") == 0
    saved_on = Trainer(settings(steps=4), make_mesh({"data": 1, "fsdp": 8, "tensor": 1}))
    other = Trainer(settings(steps=4), make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    with Checkpoints(ckpt) as checkpoints:
        saved_on.state, _ = checkpoints.restore(saved_on.state)
        other.state, meta = checkpoints.restore(other.state)
    assert meta["step"] == 4 and int(other.state.step) == 4
    for a, b in zip(jax.tree.leaves(saved_on.params()), jax.tree.leaves(other.params()), strict=True):
        np.testing.assert_array_equal(a, b)
    mu = [np.asarray(x) for x in jax.tree.leaves(other.state.opt_state)]
    assert any(np.abs(m).max() > 0 for m in mu)  # the optimizer state came back too, not a fresh one
    # and training goes on there, once the longer schedule is allowed
    assert run(*argv, "--steps", "6", "--resume", "--allow-changes") == 0


def test_negative_control_another_model_is_refused_naming_the_parameter(tmp_path, capsys):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    assert run(*RUN, "--steps", "4", "--checkpoint-dir", str(ckpt)) == 0
    code = run(*RUN, "--checkpoint-dir", str(ckpt), "--resume", "--d-model", "128", "--log-file", str(log))
    err = capsys.readouterr().err
    assert code == 2
    assert "params/embed/embedding: saved shape (256, 64), the model expects (256, 128)" in err
    assert not log.exists()  # nothing written
    assert saved_steps(ckpt) == [4]


def test_mismatch_lists_every_differing_leaf():
    small = Trainer(settings(), make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    wide = Trainer(
        settings(model=preset("tiny", mlp_hidden=512)), make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    )
    import tempfile

    with Checkpoints(tempfile.mkdtemp()) as checkpoints:
        checkpoints.save(0, small.state)
        checkpoints.wait()
        with pytest.raises(CheckpointMismatchError) as info:
            checkpoints.restore(wide.state)
    message = str(info.value)
    for leaf in (
        "params/blocks/mlp/wi/kernel",
        "params/blocks/mlp/wo/kernel",
        "opt_state/1/0/mu/blocks/mlp/wi/kernel",  # (clip_by_global_norm, adamw): adamw is the second
    ):
        assert leaf in message
    assert "d_model" not in message and "embed" not in message  # only the leaves that differ

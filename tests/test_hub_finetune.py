"""Issue 100, point 5: a downloaded checkpoint fine-tuned whole, ``fsdp_tp.hub.finetune`` and
``fsdp-tp finetune``.

The step on a mesh equal in float64 to the same fine-tune on one device, unsharded (losses and
the parameters after AdamW's steps), for the families and layouts a user meets: Megatron's
split, the sequence over ``context`` (sliding windows, Gemma 3's sandwich norms, NNX), the
experts over ``expert``; its negative control the double gradient sync a ``pmean`` inside the
loss makes (AdamW hides it from the losses). The command end to end: text tokenized by the
checkpoint's own ``tokenizer.json``, ``--check``, checkpoints, a resume equal to the run that
never stopped, the export read back; its bad input named with the fix, the fix applied.
"""

from __future__ import annotations

import io
import os

import jax
import numpy as np
import pytest

from fsdp_tp.cli import main
from fsdp_tp.hub.directory import Checkpoint
from fsdp_tp.hub.finetune import FineTune, Schedule

HERE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "hub_checkpoints")
TOKENS = (np.arange(4000) * 7 % 64).astype(np.int32)  # (every id of the tiny checkpoints' 64)


def _apart(family: str, sizes: dict, api: str, steps: int = 2, tune=FineTune, batch: int = 4):
    """The largest loss and parameter differences of ``steps`` float64 steps on ``sizes`` and on
    one device, unsharded (``api`` ``"linen-scan"``: Linen's blocks in a scan)."""
    with jax.enable_x64(True):
        api, scan = api.removesuffix("-scan"), api.endswith("-scan")
        kw = dict(batch=batch, seq_len=16, api=api, scan=scan, schedule=Schedule(lr=1e-3), dtype="float64")
        sharded = tune(os.path.join(HERE, family), sizes, **kw)
        twin = sharded.twin()
        losses = [
            (sharded.step(sharded.batch_at(TOKENS, i)), twin.step(twin.batch_at(TOKENS, i)))
            for i in range(steps)
        ]
        params = jax.tree.leaves(
            jax.tree.map(lambda a, b: np.abs(a - b).max(), sharded.params(), twin.params())
        )
    return max(abs(a - b) for a, b in losses), max(params)


@pytest.mark.parametrize(
    "family, sizes, api",
    [
        ("llama", {"data": 2, "fsdp": 2, "tensor": 2}, "linen"),
        ("gemma3", {"fsdp": 2, "context": 2, "tensor": 2}, "nnx"),  # (local and global layers)
        ("mistral", {"fsdp": 4, "context": 2}, "linen-scan"),  # (a window the ring skips past; scanned)
        ("qwen3_moe", {"fsdp": 2, "expert": 2, "tensor": 2}, "nnx"),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()),
)
def test_a_fine_tune_on_a_mesh_equals_the_unsharded_one_in_float64(family, sizes, api):
    loss, params = _apart(family, sizes, api)
    assert loss < 1e-13 and params < 1e-13, (loss, params)


class _SyncedTwice(FineTune):
    """The step with the loss ``pmean``-ed inside what is differentiated, then synced again."""

    def _step_fn(self, state, batch):
        grads, loss = super()._step_fn(state, batch)
        return jax.tree.map(lambda g: g / jax.lax.axis_size(self.axes), grads), loss


def test_negative_control_a_gradient_synced_twice_is_caught_where_the_losses_agree():
    # Each gradient 1/8 of the unsharded one: AdamW's update divides by the gradient's size, so
    # it moves all but the same way (a float32 run's losses agreed to 5e-7 over its steps);
    # the parameters after it, in float64, do not.
    loss, params = _apart("llama", {"data": 8}, "linen", steps=1, tune=_SyncedTwice, batch=8)
    assert loss < 1e-13 and params > 1e-6, (loss, params)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


LLAMA = os.path.join(HERE, "llama")
CORPUS = os.path.join(HERE, "corpus.txt")
SMALL = ["--batch", "4", "--seq-len", "16", "--lr", "1e-3"]


def test_finetune_text_check_checkpoints_resume_and_export(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--from", LLAMA, "--data", CORPUS, "--steps", "5", *SMALL, "--checkpoint-dir", ckpt]
    code, out = run(
        "finetune", *flags, "--check", "1", "--checkpoint-every", "3", "--export", str(tmp_path / "a")
    )
    assert code == 0, capsys.readouterr().err
    assert "llama from" in out and "float64" in out and "-> ok" in out and "step 5/5" in out, out
    # Continued from checkpoint 3, it is the run that never stopped, bit for bit; each export
    # is the checkpoint's layout, its names and config.json, with the tuned tensors.
    code, out = run("finetune", *flags, "--resume-from", "3", "--export", str(tmp_path / "b"))
    assert code == 0 and "resumed from checkpoint 3" in out and "step 5/5" in out, out
    original, a, b = Checkpoint(LLAMA), Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert a.names() == b.names() == original.names() and a.config == original.config
    assert all(np.array_equal(a.read(name), b.read(name)) for name in original.names())
    assert not np.array_equal(a.read("model.norm.weight"), original.read("model.norm.weight"))


@pytest.mark.parametrize(
    "argv, says, fixed",
    [
        # text where the checkpoint has no tokenizer.json: tokens pass
        (
            ["--from", os.path.join(HERE, "qwen3"), "--data", CORPUS],
            "has no tokenizer.json",
            ["--data", "@npy"],
        ),
        # a batch the rows' devices do not divide
        (["--batch", "6"], "pass a multiple of 4", ["--batch", "4"]),
        # ids past the checkpoint's vocabulary
        (["--data", "@big"], "vocabulary", ["--data", "@npy"]),
    ],
    ids=["no-tokenizer", "batch", "vocabulary"],
)
def test_bad_input_is_named_with_a_fix_that_runs(argv, says, fixed, tmp_path, capsys):
    np.save(tmp_path / "tokens.npy", TOKENS)
    np.save(tmp_path / "big.npy", TOKENS + 64)
    files = {"@npy": str(tmp_path / "tokens.npy"), "@big": str(tmp_path / "big.npy")}
    base = {"--from": LLAMA, "--data": CORPUS, "--steps": "1", "--batch": "4", "--seq-len": "16"}

    def command(changes: list[str]) -> list[str]:
        flags = dict(base, **dict(zip(changes[::2], changes[1::2], strict=True)))
        return ["finetune", *(x for k, v in flags.items() for x in (k, files.get(v, v)))]

    code, _ = run(*command(argv))
    assert code == 2 and says in capsys.readouterr().err
    code, out = run(*command([*argv, *fixed]))
    assert code == 0 and "step 1/1" in out, capsys.readouterr().err

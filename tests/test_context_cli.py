"""Issue 84 point 7: ``fsdp-tp train`` and ``plan`` with a ``context`` axis in ``--mesh``, and ``--packed``.

The GPT preset (causal attention through the library's ``attend``, no positions of its own)
trains with its sequence split over ``context``, Linen and NNX, equal to the unsharded twin
under ``--check``; ``plan`` prints the ring's bytes over ``context`` on a 4096-device mesh, and
over ``tensor`` the split adds nothing to Megatron's collectives; a
sequence or strategy the split cannot take is one line with the fix (exit 2), and the fix runs.
"""

from __future__ import annotations

import io

import pytest

from fsdp_tp.cli import main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.mark.parametrize(
    "api, mesh, strategy, packed",
    [
        ("linen", "data=2,context=2,tensor=2", "ring", ["--packed", "--microbatches", "2"]),  # (SP on)
        ("nnx", "fsdp=2,context=4", "auto", []),
        ("nnx", "context=2,expert=2,tensor=2", "ring", ["--experts", "4"]),  # (the MoE LM, dropless)
    ],
    ids=[
        "linen-data2-context2-tensor2-packed",
        "nnx-fsdp2-context4-auto",
        "nnx-moe-context2-expert2-tensor2",
    ],
)
def test_train_splits_the_sequence_over_context_and_passes_check(api, mesh, strategy, packed):
    """Packed: sentences of the corpus as documents, each microbatch's tokens counted against
    its batch's (the twin's loss the token-weighted mean of the whole batch)."""
    flags = ["--api", api, "--mesh", mesh, "--context-strategy", strategy, "--remat", "full", *packed]
    code, out = run("train", "--steps", "2", "--check", "2", "--eval-every", "0", *flags)
    assert code == 0, out
    assert "context=" in out.splitlines()[0] and "-> ok" in out, out
    # The header says what the step does with the sequence (issue 99 point 7)
    size = int(mesh.split("context=")[1].split(",")[0])
    said = f"sequence over context={size}: {64 // size} tokens a device (balanced: 2 chunks a device), "
    said += "attention across it by " + {"auto": "auto: ring"}.get(strategy, strategy)  # (4 heads, 2 kv)
    assert said in out.splitlines()[0], out.splitlines()[0]


def test_packed_documents_ignored_by_the_sharded_run_fail_check(monkeypatch):
    """(negative control) the sharded step given one document a row while the twin reads the
    packed ones: --check sees it."""
    from fsdp_tp.recipe import batches, trainer

    def one_document(settings, windows):
        inputs, targets, segments, weights = batches.split_windows(settings, windows)
        return inputs, targets, segments * 0 + 1, weights

    monkeypatch.setattr(trainer, "split_windows", one_document)  # (the sharded step's alone)
    flags = ["--api", "nnx", "--mesh", "data=2,context=2,tensor=2", "--packed", "--remat", "full"]
    code, out = run("train", "--steps", "2", "--check", "2", "--eval-every", "0", *flags)
    assert code == 1 and "-> FAILED" in out, out


def test_plan_prints_the_ring_s_bytes_over_context_on_4096_devices():
    flags = ["--heads", "8", "--kv-heads", "8", "--seq-len", "8192", "--batch", "64", "--remat", "full"]
    code, out = run("plan", "--mesh", "data=8,fsdp=8,context=8,tensor=8", *flags)
    assert code == 0, out
    assert out.startswith("mesh data=8 x fsdp=8 x context=8 x tensor=8 (4096 devices)")
    # the preset: 2 layers, 16 dims a head; a device's B·S·G·D = 1·8192·1·16 floats of k (or v);
    # remat full runs the forward's ring twice: per layer 2 · 2(n-1)/n · kv + (2(n-1)/n · kv + 2 · kv)
    kv = 1 * 8192 * 1 * 16 * 4
    forward, backward = 2 * 7 * kv // 8, 2 * 7 * kv // 8 + 2 * kv
    assert f"over context: collective-permute {2 * (2 * forward + backward):,} B" in out, out
    said = out.splitlines()[-1]  # (the ring per layer by the formula, and the program against it)
    assert said.startswith("context=8: attention across it by ring (balanced split), B=1 sequences"), said
    assert f"per layer and device, forward {forward:,} B (" in said and f"backward {backward:,} B (" in said
    assert said.endswith(
        f"sends {2 * (2 * forward + backward):,} B of collective-permute over context = 2 "
        "layers x (forward twice: remat recomputes it + backward)"
    ), said


def _over(axis: str, out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  over {axis}:"))


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_over_tensor_the_split_adds_nothing_to_megatron_s_collectives(api):
    """The step's program over ``tensor`` with the sequence split over context=2 is Megatron's
    (sequence parallel: all-gathers and reduce-scatters) at a device's tokens, byte for byte,
    as at context=1 with half the sequence; (negative control) twice the tokens, twice the bytes."""
    plan = lambda mesh, length: run(
        "plan", "--api", api, "--mesh", mesh, "--seq-len", length, "--remat", "full"
    )
    (code, split), (_, whole), (_, longer) = (
        plan("data=2,context=2,tensor=2", "256"),
        plan("data=2,tensor=2", "128"),
        plan("data=2,tensor=2", "256"),
    )
    assert code == 0 and "over context: collective-permute" in split, split
    assert _over("tensor", split) == _over("tensor", whole), (_over("tensor", split), _over("tensor", whole))
    assert _over("tensor", longer) != _over("tensor", whole)


def test_plan_counts_the_strategy_the_run_asks_for():
    flags = ["--heads", "8", "--kv-heads", "8", "--seq-len", "64", "--batch", "4", "--remat", "none"]
    code, out = run("plan", "--mesh", "data=2,context=4", "--context-strategy", "all_to_all", *flags)
    assert code == 0, out
    # per layer and device: q, k, v, out (8 heads of 16 dims, 2 rows) sent 2(n-1)/n² of S·D·b each way
    each = 2 * 3 * 2 * 64 * 16 * (8 + 8) * 4 // 16
    assert f"over context: all-to-all {2 * 2 * each:,} B" in out and "collective-permute" not in out, out
    assert out.splitlines()[-1].endswith("= 2 layers x (forward + backward)"), out


@pytest.mark.parametrize(
    "flags, said, fixed",
    [
        (
            ["--mesh", "fsdp=2,context=4", "--seq-len", "60"],
            "--seq-len 60 on --mesh context=4: the balanced split cuts each sequence in 2 x 4 = 8 chunks; "
            "use --seq-len 64.",
            ["--mesh", "fsdp=2,context=4", "--seq-len", "64"],
        ),
        (
            ["--mesh", "fsdp=2,context=2,tensor=2", "--context-strategy", "all_to_all"],
            "--context-strategy all_to_all on --mesh context=2: a device holds 1 kv heads (--kv-heads 2 "
            "over tensor 2), which 2 does not divide; use --context-strategy ring",
            ["--mesh", "fsdp=2,context=2,tensor=2", "--context-strategy", "ring"],
        ),
        (
            ["--mesh", "data=2,context=2,expert=2", "--experts", "4", "--capacity-factor", "1.25"],
            "--mesh context=2 with --capacity-factor 1.25: a device routes its own share of each sequence",
            ["--mesh", "data=2,context=2,expert=2", "--experts", "4"],
        ),
        (
            ["--mesh", "data=2,context=4", "--packed", "999"],
            "--packed 999: the end-of-document token is no token of the vocabulary (0 .. 255); pass the id",
            ["--mesh", "data=2,context=4", "--packed", "46"],
        ),
        (
            ["--mesh", "data=4,expert=2", "--experts", "4", "--packed"],
            "--packed 46 with --experts: the MoE LM takes no segment ids yet; drop --packed",
            ["--mesh", "data=4,expert=2", "--experts", "4"],
        ),
        (
            ["--mesh", "data=8", "--context-strategy", "all_to_all"],
            "--context-strategy all_to_all without a context axis in --mesh (data=8): nothing splits the "
            "sequence, so no attention crosses devices; add context=N to --mesh, or drop --context-strategy.",
            ["--mesh", "data=8"],
        ),
    ],
    ids=["seq-len", "all-to-all", "capacity", "packed-token", "packed-experts", "strategy-without-context"],
)
def test_a_split_the_run_cannot_take_is_one_line_and_its_fix_plans(flags, said, fixed, capsys):
    code, _ = run("plan", "--remat", "full", *flags)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err
    code, out = run("plan", "--remat", "full", *fixed)
    assert code == 0, out

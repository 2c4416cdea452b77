"""``fsdp-tp train --experts`` (issue 59 point 4): the MoE LM trained on meshes with an
``expert`` axis equal to its unsharded twin under ``--check``, with its negative control; the
plan's expert weights and buffers per device; every mismatch one line naming the fix."""

from __future__ import annotations

import io
import re

import pytest

import fsdp_tp.tp._experts as experts_module
from fsdp_tp.cli import main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


CHECKED = ["--steps", "2", "--check", "2", "--log-every", "1", "--eval-every", "0"]


@pytest.mark.parametrize(
    "flags, summary",
    [
        pytest.param(
            [
                *("--api", "linen", "--experts", "4", "--mesh", "data=2,expert=2,tensor=2"),
                *("--dtype", "bf16", "--remat", "full"),
            ],
            "mesh data=2 x fsdp=1 x expert=2 x tensor=2 on 8 cpu devices; model tiny MoE, 4 experts "
            "(top-2, dropless), vocab 256 (bfloat16 compute)",
            id="linen-data-expert-tensor-dropless-bf16",
        ),
        pytest.param(
            [
                *("--api", "nnx", "--experts", "4", "--top-k", "1", "--capacity-factor", "1.25"),
                *("--moe-every", "2", "--mesh", "fsdp=2,expert=2,tensor=2", "--remat", "dots"),
            ],
            "model tiny (NNX) MoE, 4 experts (top-1, capacity factor 1.25, every 2nd layer)",
            id="nnx-fsdp-expert-tensor-capacity-top1",
        ),
    ],
)
def test_train_with_experts_passes_check_against_its_unsharded_twin(flags, summary):
    """Expert parallelism over `expert` beside Megatron's attention over `tensor` (and FSDP),
    each block rematerialized (all of it, or all but its weight matmuls), from the Linen twin's
    init, equal to the twin after two AdamW steps at the tolerance of the compute dtype (bf16:
    the routers and the loss in f32)."""
    code, out = run("train", *CHECKED, *flags)
    assert code == 0 and "-> ok" in out, out
    assert summary in out and f"(remat {flags[flags.index('--remat') + 1]}," in out, out


def test_negative_control_experts_gradients_left_unscaled_fail_the_check(monkeypatch):
    """Without ExpertParallel's 1/n on the experts' gradients, --check fails (exit 1). Under
    SGD: Adam's update would hide a gradient twice too large (it divides by its scale)."""
    flags = [*CHECKED, "--optimizer", "sgd", "--lr", "0.5", "--warmup", "0", "--experts", "4"]
    flags += ["--mesh", "data=4,expert=2"]
    code, out = run("train", *flags)
    assert code == 0 and "-> ok" in out, out
    monkeypatch.setattr(experts_module, "_cotangent_times", lambda x, factor: x)
    code, out = run("train", *flags)
    assert code == 1 and "-> FAILED" in out, out


def test_the_plan_shows_the_experts_each_device_holds_and_the_rules():
    """On data x expert x tensor: each expert kernel over expert and its hidden dim over tensor
    (gate and up column, down row), the bytes a device holds, its buffers, the rules."""
    code, out = run("plan", "--experts", "8", "--mesh", "data=2,expert=2,tensor=2")
    assert code == 0, out
    rows = [line for line in out.splitlines() if "/moe/experts/" in line and "kernel" in line]
    hidden = {"gate": "P('expert', None, 'tensor')", "up": "P('expert', None, 'tensor')"}
    assert len(rows) == 6, rows  # (experts over expert, each one's hidden dim over tensor)
    assert all(hidden.get(row.split("/")[3], "P('expert', 'tensor', None)") in row for row in rows), rows
    assert (
        "experts: 8 in each of 2 MoE layers, 4 per device over expert=2, each one's hidden dim split over "
        "tensor=2: expert weights 0.75 MiB per device before FSDP, 0.75 MiB stored (of 3.00 MiB)"
    ) in out
    assert "dispatch buffers (groups, experts, capacity, d) = (4, 8, 64, 64) per MoE layer" in out
    assert '(r"experts/down$", ExpertParallel(returns=True, within=RowParallel())),' in out
    assert "over expert: all-to-all" in out and "not counted" not in out
    # --remat auto, the default: each policy's step measured, as the GPT's; full's below none's
    by_policy = r"activations per device by --remat: none ([\d,]+) B, dots [\d,]+ B, full ([\d,]+) B"
    (each,) = re.findall(by_policy, out)
    none, full = (int(figure.replace(",", "")) for figure in each)
    assert full < none, each


BAD = [
    (["--experts", "6", "--mesh", "expert=4"], "--experts 6 is not divisible by the mesh's expert=4"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 routes each token to more experts than the 2"),
    (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor 0.0 is out of range"),
    (["--experts", "0"], "--experts 0 is out of range: expected an integer >= 1"),
    (["--experts", "4", "--moe-every", "3"], "--moe-every 3 is more than the model's 2 layers"),
    (["--top-k", "1"], "--top-k 1 configures experts, but this run has none: pass --experts N."),
    (["--mesh", "data=4,expert=2"], "--mesh names expert=2, which splits experts, but this run has none"),
    (
        ["--experts", "4", "--mesh", "data=2,tensor=4", "--kv-heads", "2"],
        "--kv-heads 2 is not divisible by the mesh's tensor=4: the MoE LM's attention splits",
    ),
    (
        ["--experts", "4", "--mesh", "expert=4,data=2", "--batch", "4"],
        "--batch 4 is not divisible by the batch shards data x fsdp x expert = 8",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_a_moe_run_that_cannot_work_is_one_line_naming_the_fix(flags, message, capsys):
    assert main(["train", "--steps", "1", *flags], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("fsdp-tp: error: "), err


def test_capacity_and_dropless_are_one_choice(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--experts", "4", "--capacity-factor", "1.25", "--dropless"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mesh, named",
    [("data=2,expert=4", ", or --mesh data=4,expert=2."), ("data=2,expert=2,tensor=2", "pass --experts 4.")],
)
def test_the_mesh_an_expert_misfit_names_is_one_these_devices_form(mesh, named, capsys):
    """Issue 82 point 8: --experts 3 on data 2 x expert 2 x tensor 2 named expert=3, which 8
    devices cannot form beside tensor 2. The meshes named keep the devices and the other
    axes (none where none forms), and the run's settings accept them."""
    from fsdp_tp.cli.options import parser
    from fsdp_tp.cli.settings import mesh_sizes, settings_of

    experts = "6" if named.startswith(",") else "3"
    assert main(["train", "--steps", "1", "--experts", experts, "--mesh", mesh], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(named), err
    if "--mesh " in named:
        fix = named.split("--mesh ")[1].rstrip(".")
        args = parser("").parse_args(["train", "--experts", experts, "--mesh", fix])
        assert settings_of(args, mesh_sizes(fix, experts=int(experts))).model.experts == int(experts)

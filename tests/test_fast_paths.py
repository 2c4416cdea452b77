"""Issue 15: attention through jax.nn.dot_product_attention, remat policies, MFU in the CLI's
output, a CLI that fits the machine. Each choice computes the unsharded model's numbers."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_tp import make_mesh
from fsdp_tp.attention import attend
from fsdp_tp.cli import fit, machine, main
from fsdp_tp.cli.options import parser
from fsdp_tp.cli.settings import settings_of
from fsdp_tp.mesh import parse_mesh
from fsdp_tp.models import Layout, Transformer
from fsdp_tp.recipe.config import PRESETS
from tests.equivalence import check_equivalence, next_token_loss
from tests.transformer_case import CONFIG, transformer_case

pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")


# Each implementation as one program per shape, as a model's step runs it: op by op, every
# example compiled each of its ops (the 6 examples: 4.7 s alone, 2.1 s jitted).
_attended = jax.jit(attend, static_argnums=(3, 4))


@given(
    groups=st.sampled_from([1, 2, 4]),
    per_group=st.sampled_from([1, 3]),
    seq=st.integers(1, 9),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_xla_attention_equals_the_reference(groups, per_group, seq, causal, seed):
    """GQA included: jax.nn.dot_product_attention reads each kv head once, the reference repeats it."""
    q = jax.random.normal(jax.random.key(seed), (2, seq, groups * per_group, 8))
    k, v = jax.random.normal(jax.random.key(seed + 1), (2, 2, seq, groups, 8))
    reference = _attended(q, k, v, causal, "reference")
    np.testing.assert_allclose(_attended(q, k, v, causal, "xla"), reference, rtol=1e-5, atol=1e-6)
    if seq > 1:  # negative control: the mask matters, so the comparison can fail
        assert not np.allclose(_attended(q, k, v, not causal, "xla"), reference, atol=1e-3)


def test_auto_attention_is_xla_off_gpu_and_unknown_names_are_refused():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    from fsdp_tp.attention import resolved_implementation

    assert resolved_implementation("auto", q.dtype) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert resolved_implementation("auto", jnp.float32) == "xla"  # cuDNN takes 16-bit inputs only
    with pytest.raises(ValueError, match=r"'flash' is not one of \('reference', 'xla', 'cudnn', 'auto'\)"):
        attend(q, q, q, implementation="flash")


@pytest.mark.parametrize(
    ("attention", "remat", "check_vma"),
    # The reference attention under full remat is test_transformer's default case, both modes.
    [("xla", "dots", True), ("xla", "none", False)],
)
def test_attention_and_remat_choices_equal_the_unsharded_twin(attention, remat, check_vma):
    """FSDP x TP x SP on 2x2x2: init, loss, gradients and steps equal to the plain model's."""
    layout = Layout("tensor", "fsdp", sequence_parallel=True, min_weight_size=0)
    model = Transformer(**CONFIG, layout=layout, attention=attention, remat=remat)
    check_equivalence(transformer_case(model, check_vma))


def test_remat_policies_give_the_same_gradient():
    """Recomputing is the same arithmetic (up to XLA fusing it differently: ~1e-7 relative)."""
    ids = jax.random.randint(jax.random.key(0), (4, 8), 0, CONFIG["vocab_size"])
    params = Transformer(**CONFIG).init(jax.random.key(1), ids)["params"]

    def grad(remat):
        model = Transformer(**CONFIG, remat=remat)
        return jax.jit(jax.grad(lambda p: next_token_loss(model, p, ids, ids)))(params)

    full = grad("full")
    for remat in ("dots", "none"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad(remat), full)
    with pytest.raises(ValueError, match=r"remat='some' is not one of \['dots', 'full', 'none'\]"):
        Transformer(**CONFIG, remat="some").init(jax.random.key(1), ids)


@pytest.mark.parametrize("name", ["tiny", "125m", "1b"])
def test_flops_per_token_counts_every_weight_but_the_embedding(name):
    config = dataclasses.replace(PRESETS[name], vocab_size=1000)
    shapes = jax.eval_shape(config.model().init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    # Every kernel, the output head's included; the input embedding ("embedding") is a lookup.
    matmul_weights = sum(
        math.prod(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
        if path[-1].key == "kernel"
    )
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * config.seq_len
    assert config.flops_per_token() == 6 * matmul_weights + attention


def test_the_fastest_remat_that_fits_is_chosen(monkeypatch):
    # Long enough sequences that activations, not the weights' temporaries, set the order.
    args = ["train", "--remat", "auto", "--batch", "32", "--seq-len", "128"]
    settings = settings_of(parser("").parse_args(args), {"data": 2, "fsdp": 2, "tensor": 2})
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    needed = {
        p: fit.needed_bytes(fit.plan_of(fit._with_remat(settings, p), mesh)) for p in ("none", "dots", "full")
    }
    assert needed["none"] > needed["dots"] > needed["full"]  # the order the choice relies on
    for policy in ("none", "dots", "full"):
        room = math.ceil(needed[policy] / (1 - fit.HEADROOM))
        monkeypatch.setattr(fit, "memory_per_device", lambda sharing=None, room=room: (room, "test"))
        assert fit.choose_remat(settings, mesh)[0].model.remat == policy
    monkeypatch.setattr(fit, "memory_per_device", lambda sharing=None: (needed["full"] - 1, "test"))
    with pytest.raises(fit.UsageError, match=r"more than the .* available"):
        fit.check_fits(fit.choose_remat(settings, mesh)[1])


def test_progress_and_log_carry_tflops_and_mfu(tmp_path):
    log = tmp_path / "log.jsonl"
    out = io.StringIO()
    argv = ["train", "--steps", "3", "--log-every", "1", "--eval-every", "0", "--peak-tflops", "0.5"]
    assert main([*argv, "--log-file", str(log)], out=out) == 0, out.getvalue()
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    flops = PRESETS["tiny"].flops_per_token()
    for record in steps[1:]:  # the first step has no rate (it compiled)
        tflops = flops * record["tokens_per_s"] / 8 / 1e12
        assert record["tflops_per_device"] == pytest.approx(tflops, rel=1e-12)
        assert record["mfu"] == pytest.approx(tflops / 0.5, rel=1e-12)
    assert "TFLOP/s/device, MFU" in out.getvalue()
    # Without --peak-tflops a CPU has no peak: TFLOP/s, no MFU.
    out = io.StringIO()
    assert main(["train", "--steps", "2", "--log-every", "1", "--eval-every", "0"], out=out) == 0
    assert "TFLOP/s/device" in out.getvalue() and "MFU" not in out.getvalue()


@pytest.mark.parametrize(
    ("environ", "cpu_devices", "plugin", "expected"),
    [
        ({"JAX_PLATFORMS": "cpu"}, None, True, False),  # the issue: a CUDA plugin and JAX_PLATFORMS=cpu
        ({}, 8, True, False),
        ({}, None, False, False),
        ({}, None, True, True),
        ({"JAX_PLATFORMS": "cuda,cpu"}, None, True, True),  # negative control: the GPU is wanted
    ],
)
def test_accelerator_or_simulated_cpus(monkeypatch, environ, cpu_devices, plugin, expected):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(machine.importlib.util, "find_spec", lambda name: object() if plugin else None)
    args = type("Args", (), {"cpu_devices": cpu_devices})()
    assert machine.uses_accelerator(args) is expected


@settings(max_examples=30, deadline=None)
@given(
    devices=st.sampled_from([1, 2, 4, 6, 8, 16]),
    heads=st.sampled_from([1, 2, 4, 6, 8]),
    batch=st.integers(1, 64),
)
def test_every_suggested_mesh_fits(devices, heads, batch):
    for text in machine.fitting_meshes(devices, heads, heads, batch, limit=100):
        sizes = {"data": 1, "fsdp": 1, "tensor": 1, **parse_mesh(text)}
        assert math.prod(sizes.values()) == devices
        assert batch % (sizes["data"] * sizes["fsdp"]) == 0 and heads % sizes["tensor"] == 0


def _console_in_a_fresh_process(argv: list[str]) -> subprocess.CompletedProcess:
    """``fsdp-tp`` as a user types it: a new process, its own simulated CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    code = "from fsdp_tp.cli import console; console()"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_mesh_that_does_not_fit_the_devices_names_those_that_would():
    """In a fresh process: 4 simulated devices, the default 2x2x2 mesh asked for."""
    argv = ["--cpu-devices", "4", "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "1"]
    done = _console_in_a_fresh_process(argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "fsdp-tp: error: --mesh data=2,fsdp=2,tensor=2 needs 8 devices, but 4 are here; meshes that fit: "
        "fsdp=4, data=2,fsdp=2, data=4, fsdp=2,tensor=2, data=2,tensor=2 (or leave out --mesh to use them "
        "all on fsdp)."
    ]


def test_cpu_devices_without_a_mesh_put_every_device_on_fsdp_and_say_so():
    """Issue 32: ``--cpu-devices 2`` with no ``--mesh`` was refused for not fitting the default
    2 x 2 x 2 mesh, whose --mesh the user had not given. In a fresh process, as typed."""
    done = _console_in_a_fresh_process(["--cpu-devices", "2", "--steps", "1", "--eval-every", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no --mesh given: chose fsdp=2, every cpu device on fsdp" in done.stdout, done.stdout
    assert "mesh data=1 x fsdp=2 x tensor=1 on 2 cpu devices" in done.stdout, done.stdout
    assert "done: loss" in done.stdout, done.stdout


def test_plan_of_a_realistic_preset_shows_each_remat_policy():
    out = io.StringIO()
    assert (
        main(
            [
                "plan",
                "--preset",
                "125m",
                "--vocab-size",
                "32768",
                "--mesh",
                "data=8,fsdp=64",
                "--batch",
                "512",
            ],
            out=out,
        )
        == 0
    )
    *_, activations, wire = out.getvalue().splitlines()
    assert activations.startswith("activations per device by --remat: none ")
    assert "not estimated" not in out.getvalue()
    # the wire is full's, as the table is: its blocks' weights gathered again in the backward pass
    assert wire.startswith("FSDP over fsdp=64: ") and "remat full;" in wire


def test_the_accelerator_benchmark_runs_its_command(tmp_path, capsys):
    """The GPU page's command, at the tiny preset on one CPU device: every column filled, a row
    per gather precision (issue 60: fp8 beside f32), MFU left out (no peak for a CPU), and the
    command that regenerates it printed on the page."""
    argv = ["bench", "--accelerator", "--presets", "tiny:8", "--vocab-size", "256", "--remat", "none"]
    argv += ["--precisions", "f32/f32,fp8/bf16", "--blocks", "3"]
    out = io.StringIO()
    assert main([*argv, "--steps", "1", "--out", str(tmp_path)], out=out) == 0, out.getvalue()
    page = (tmp_path / "benchmarks_accelerator.md").read_text()
    params = sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(
            jax.eval_shape(PRESETS["tiny"].model().init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        )
    )
    rows = [line for line in page.splitlines() if line.startswith("| tiny")]
    for row, precision in zip(rows, ["f32 / f32", "fp8 / bf16"], strict=True):
        assert row.startswith(f"| tiny ({params / 1e6:,.0f}M params) | {precision} | 8 x 64 | ")
        assert "| — |" in row
    assert f"fsdp-tp {' '.join(argv[:-2])}" in page
    assert "remat none, scan_layers False;" in page  # the layers unrolled unless --scan-layers
    assert main(["bench", "--accelerator", "--presets", "huge:8"], out=out) == 2
    assert "--presets item 'huge:8': write PRESET:BATCH" in capsys.readouterr().err
    bad = ["bench", "--accelerator", "--presets", "tiny:8", "--precisions", "bf16/bf16,fp8"]
    assert main(bad, out=out) == 2
    assert (
        "--precisions item 'fp8': write GATHER/REDUCE with GATHER one of ['bf16', 'f32', 'fp8', "
        "'fp8-e5m2'] and REDUCE one of ['bf16', 'f32'], e.g. fp8/bf16." in capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["train", "plan", "bench"])
def test_every_help_default_is_printed_once(command, capsys):
    """Issue 32: ``--help`` printed "(default: the preset's) (default: None)" on several flags."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    flags = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    assert "(default: None)" not in " ".join(text.split())
    twice = [f.split()[0] for f in flags if " ".join(f.split()).count("default") > 1]
    assert not twice, f"flags whose default is said twice: {twice}"

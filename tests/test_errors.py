"""Bad input fails at the boundary with a message that names it and the fix (acceptance 7)."""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.errors import (
    IndivisibleShapeError,
    MeshShapeError,
    SpecError,
    SpecTreeMismatchError,
    UnboundAxisNameError,
)
from tests.models import MLP


def test_unknown_axis_name_in_sync_gradients():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    f = jax.shard_map(
        lambda g: fsdp_tp.sync_gradients(g, ("data", "batch")), mesh=mesh, in_specs=P(), out_specs=P()
    )
    with pytest.raises(
        UnboundAxisNameError, match=r"sync_gradients: mesh axis 'batch' .* binds \['data', 'fsdp'\]"
    ):
        f(jnp.ones(3))


def test_unknown_axis_name_in_module_transform():
    mesh = fsdp_tp.make_mesh({"fsdp": 8})
    dense = fsdp_tp.shard_module_params(nn.Dense, axis="fsdpp", min_weight_size=0)
    init = jax.shard_map(
        lambda x: dense(8).init(jax.random.key(0), x),
        mesh=mesh,
        in_specs=P("fsdp"),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(
        UnboundAxisNameError,
        match=r"(shard|gather)_params: mesh axis 'fsdpp' is not bound here; "
        r"the enclosing jax.shard_map binds \['fsdp'\]",
    ):
        jax.eval_shape(init, jnp.ones((8, 4)))


def test_axis_name_outside_shard_map():
    with pytest.raises(UnboundAxisNameError, match=r"outside jax\.shard_map"):
        fsdp_tp.dropout.fold_rng_over_axis(jax.random.key(0), "data")


def test_module_instance_is_rejected_with_the_fix():
    with pytest.raises(TypeError, match=r"pass the class .*shard_module_params\(Dense, \.\.\.\)"):
        fsdp_tp.shard_module_params(nn.Dense(4))


def _train_step(model):
    def step(state, batch):
        grads = jax.grad(lambda p: (model.apply({"params": p}, batch) ** 2).mean())(state.params)
        return fsdp_tp.sync_gradients(grads, ("data", "fsdp")), ()

    return step


def _state(mesh, model, tx):
    def init_fn(rng, x):
        return fsdp_tp.TrainState.create(
            apply_fn=model.apply, params=model.init(rng, x)["params"], tx=tx, rng=rng
        )

    return fsdp_tp.init_sharded(
        init_fn, mesh, (P(), P(("data", "fsdp"))), jax.random.key(0), jnp.ones((8, 4))
    )


def test_batch_not_divisible_by_batch_axes():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    model = MLP((8,), True, fsdp_tp.shard_module_params(nn.Dense, min_weight_size=0))
    state, specs = _state(mesh, model, optax.sgd(0.1))
    step = fsdp_tp.shard_step(_train_step(model), mesh, specs, P(("data", "fsdp")))
    with pytest.raises(
        IndivisibleShapeError, match=r"batch: dim 0 \(size 12\) .* \('data', 'fsdp'\) \(size 8\)"
    ):
        step(state, jnp.ones((12, 4)))


def test_spec_tree_that_does_not_match_the_state():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    model = MLP((8,), True, fsdp_tp.shard_module_params(nn.Dense, min_weight_size=0))
    _, sgd_specs = _state(mesh, model, optax.sgd(0.1))
    adam_state, _ = _state(mesh, model, optax.adam(0.1))
    step = fsdp_tp.shard_step(_train_step(model), mesh, sgd_specs, P(("data", "fsdp")))
    with pytest.raises(SpecTreeMismatchError, match="specs given for the state do not match") as err:
        step(adam_state, jnp.ones((8, 4)))
    assert "\n" not in str(err.value) and "PyTreeDef" not in str(err.value) and len(str(err.value)) < 400


def test_spec_naming_an_axis_not_in_the_mesh():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    with pytest.raises(SpecError, match="names mesh axis 'model'"):
        fsdp_tp.partitioning.check_specs({"w": jnp.ones((8, 8))}, {"w": P("model")}, mesh, "params")


def test_a_layout_check_lists_every_failing_leaf_with_one_wording_per_mistake():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    tree = {"a": jnp.ones((6, 8)), "b": jnp.ones((8,)), "c": jnp.ones((8, 8)), "ok": jnp.ones((8, 8))}
    specs = {"a": P("fsdp"), "b": P("model"), "c": P("fsdp", "fsdp"), "ok": P("data", "fsdp")}
    with pytest.raises(IndivisibleShapeError) as caught:
        fsdp_tp.partitioning.check_specs(tree, specs, mesh, "params")
    lines = str(caught.value).splitlines()
    assert lines[0] == "3 arrays do not fit their specs:"
    assert lines[1].startswith(
        "  params['a']: dim 0 (size 6) of shape (6, 8) is not divisible by mesh axis 'fsdp'"
    )
    assert lines[2].startswith(
        "  params['b']: spec P('model',) names mesh axis 'model', but the mesh has axes"
    )
    assert lines[3].startswith("  params['c']: spec P('fsdp', 'fsdp') uses mesh axis 'fsdp' on dims 0 and 1")
    assert len(lines) == 4  # 'ok' fits


def test_microbatches_not_dividing_the_batch():
    loss = lambda w, x, rng: ((w * x).mean(), None)
    with pytest.raises(
        IndivisibleShapeError,
        match=r"dim 0 \(the per-device batch\) \(size 6\) .* not divisible by num_microbatches \(size 4\)",
    ):
        fsdp_tp.accumulate_gradients(loss, jnp.float32(1.0), jnp.ones((6, 2)), 4)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"data": 3, "fsdp": 2}, r"multiply to 6 devices, but 8 are available"),
        ({"data": 3, "fsdp": -1}, r"8 devices are not divisible by the other axes' product 3"),
        ({"data": -1, "fsdp": -1}, r"only one axis may be -1"),
        ({"data": 0, "fsdp": 8}, r"positive integers"),
    ],
)
def test_mesh_sizes_not_matching_the_devices(sizes, message):
    with pytest.raises(MeshShapeError, match=message):
        fsdp_tp.make_mesh(sizes)


@pytest.mark.parametrize("text", ["data=2,fsdp", "data=x", "data=2,data=4", ""])
def test_malformed_mesh_text(text):
    with pytest.raises(MeshShapeError, match="mesh"):
        fsdp_tp.mesh.parse_mesh(text)


def test_simulating_devices_after_the_backend_started():
    assert jax.device_count() == 8  # starts the backend, if no earlier test in this worker did
    fsdp_tp.simulate_cpu_devices(8)  # what the backend already has: nothing to do
    with pytest.raises(RuntimeError, match=r"already started with 8 cpu device\(s\).*XLA_FLAGS="):
        fsdp_tp.simulate_cpu_devices(4)
    assert jax.device_count() == 8  # and the running backend is left as it was (jax 0.11 would not)


def test_simulating_devices_in_a_fresh_process():
    code = "import fsdp_tp, jax; fsdp_tp.simulate_cpu_devices(4); print(jax.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"


def test_every_divisibility_error_is_worded_in_one_place():
    """Issue 32 point 3: an ``IndivisibleShapeError`` is built only by the layout core
    (``_layout.not_divisible``), so every "does not divide" reads alike: the path, what, its
    size, the axis or count, its size, and the fix."""
    import ast
    from pathlib import Path

    package = Path(fsdp_tp.__file__).parent
    builders = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "IndivisibleShapeError"
    )
    assert builders == ["_layout.py"], builders

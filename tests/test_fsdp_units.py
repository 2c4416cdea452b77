"""The pure pieces of the FSDP transform, alone."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp._layout import fsdp_dim
from fsdp_tp.errors import ReplicatedParameterWarning
from fsdp_tp.linen.fsdp import shard_params

dims = st.lists(st.integers(1, 48), min_size=0, max_size=4)


@given(shape=dims, size=st.sampled_from([1, 2, 3, 4, 8]), data=st.data())
def test_shard_dim_is_the_largest_unsplit_divisible_dim(shape, size, data):
    """The largest unsplit dim the size divides; where none, the largest a layer splits (its
    block's size, ``shape`` being the layer's block); ties go to the later dim."""
    names = tuple(data.draw(st.sampled_from([None, "tensor"])) for _ in shape)
    dim = fsdp_dim(tuple(shape), names, size)
    ok = [i for i, n in enumerate(shape) if names[i] is None and n % size == 0]
    ok = ok or [i for i, n in enumerate(shape) if n % size == 0]
    if not ok:
        assert dim is None
    else:
        assert dim in ok and shape[dim] == max(shape[i] for i in ok)
        assert dim == max(i for i in ok if shape[i] == shape[dim])  # ties: the later dim


@given(
    shape=st.lists(st.sampled_from([2, 4, 8, 16]), min_size=1, max_size=3), min_size=st.sampled_from([0, 32])
)
def test_gather_inverts_shard(shape, min_size):
    mesh = fsdp_tp.make_mesh({"fsdp": 8})
    full = {"w": jax.random.normal(jax.random.key(0), shape)}

    def roundtrip(full):
        return fsdp_tp.linen.fsdp.gather_params(
            fsdp_tp.linen.fsdp.shard_params(full, "fsdp", min_size), "fsdp"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedParameterWarning)
        back = jax.shard_map(roundtrip, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(full)
    np.testing.assert_array_equal(back["w"], full["w"])


def test_existing_splits_on_other_axes_are_kept():
    mesh = fsdp_tp.make_mesh({"fsdp": 4, "tensor": 2})
    captured = {}

    def probe(w):
        out = fsdp_tp.linen.fsdp.shard_params(
            {"w": nn.Partitioned(w, ("tensor", None))}, "fsdp", min_weight_size=0
        )["w"]
        captured.update(names=out.names, shape=out.value.shape)
        return ()

    jax.eval_shape(
        jax.shard_map(probe, mesh=mesh, in_specs=P("tensor"), out_specs=(), check_vma=False),
        jnp.ones((8, 16)),
    )
    # dim 0 is already split over tensor (local 4 of 8); dim 1 (16) is split over fsdp.
    assert captured == {"names": ("tensor", "fsdp"), "shape": (4, 4)}


def test_gathering_the_minor_axis_of_a_shared_dim():
    mesh = fsdp_tp.make_mesh({"data": 2, "fsdp": 4})
    w = jnp.arange(16.0)

    def gather(local):
        out = fsdp_tp.linen.fsdp.gather_params({"w": nn.Partitioned(local, (("data", "fsdp"),))}, "fsdp")["w"]
        assert out.names == ("data",)
        return out.value

    got = jax.shard_map(
        gather, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P("data"), check_vma=False
    )(w)
    np.testing.assert_array_equal(got, w)
    with pytest.raises(ValueError, match=r"only be gathered after \('fsdp',\)"):
        jax.shard_map(
            lambda local: fsdp_tp.linen.fsdp.gather_params(
                {"w": nn.Partitioned(local, (("data", "fsdp"),))}, "data"
            ),
            mesh=mesh,
            in_specs=P(("data", "fsdp")),
            out_specs=P(),
            check_vma=False,
        )(w)


def test_a_large_indivisible_parameter_is_reported_once_by_path_and_shape():
    mesh = fsdp_tp.make_mesh({"fsdp": 8})
    dense = fsdp_tp.shard_module_params(nn.Dense, "fsdp", min_weight_size=0)
    init = jax.shard_map(
        lambda x: dense(3).init(jax.random.key(0), x),
        mesh=mesh,
        in_specs=P("fsdp"),
        out_specs=P(),
        check_vma=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(init, jnp.ones((8, 7)))
        jax.eval_shape(init, jnp.ones((8, 7)))
    messages = [str(w.message) for w in caught if issubclass(w.category, ReplicatedParameterWarning)]
    assert len(messages) == 2, messages  # kernel (7, 3) and bias (3,), each once
    assert any("parameter kernel of shape (7, 3)" in m and "'fsdp' (size 8)" in m for m in messages)


def test_a_dim_a_layer_splits_is_split_further_where_no_unsplit_dim_divides():
    """A bias a Megatron layer splits over tensor (its one dim): FSDP splits each device's block
    further over fsdp, the dim then over ('tensor', 'fsdp'): tensor's blocks, each in fsdp's
    (it stayed whole over fsdp, with a warning, before). Gathered over fsdp it is the layer's
    block again. Negative control: read as ('fsdp', 'tensor') the blocks are another bias."""
    mesh = fsdp_tp.make_mesh({"fsdp": 4, "tensor": 2})
    bias = jnp.arange(16.0)
    names: list = []

    def stored_and_gathered(b):
        stored = shard_params({"b": nn.Partitioned(b, ("tensor",))}, "fsdp", min_weight_size=0)["b"]
        back = fsdp_tp.linen.fsdp.gather_params({"b": stored}, "fsdp")["b"]
        names.extend([stored.names, back.names])
        return stored.value, back.value

    specs = (P(("tensor", "fsdp")), P("tensor"))
    stored, back = jax.shard_map(stored_and_gathered, mesh=mesh, in_specs=P("tensor"), out_specs=specs,
                                 check_vma=False)(bias)  # fmt: skip
    assert names == [(("tensor", "fsdp"),), ("tensor",)], names
    np.testing.assert_array_equal(stored, bias)
    np.testing.assert_array_equal(back, bias)
    swapped = jax.shard_map(lambda b: stored_and_gathered(b)[0], mesh=mesh, in_specs=P("tensor"),
                            out_specs=P(("fsdp", "tensor")), check_vma=False)(bias)  # fmt: skip
    assert not np.array_equal(swapped, bias)


def test_a_parameter_no_dim_of_which_divides_is_told_to_pad_a_dim():
    """The warning names the parameter's block and the axis, and says to pad: a dim no layer
    splits (7) and a layer's block (6 over tensor 2: 3) that fsdp's 4 does not divide alike."""

    def warned(shape: tuple, names: tuple, tensor: int) -> str:
        def probe(w):
            shard_params({"w": nn.Partitioned(w, names)}, "fsdp", min_weight_size=0)
            return ()

        mesh = fsdp_tp.make_mesh({"fsdp": 4, "tensor": tensor}, devices=jax.devices()[: 4 * tensor])
        local = P(*names)  # (the layer's split: each device holds its block of the dim)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=local, out_specs=()), jnp.ones(shape))
        (said,) = [w for w in caught if issubclass(w.category, ReplicatedParameterWarning)]
        assert said.filename == __file__, said.filename  # the user's line (probe's), not the library's
        return str(said.message)

    block = warned((6,), ("tensor",), tensor=2)
    assert "parameter w of shape (3,)" in block and "Pad a dim to a multiple of 4" in block, block
    indivisible = warned((7,), (None,), tensor=1)
    assert "Pad a dim to a multiple of 4" in indivisible and "'tensor'" not in indivisible, indivisible


def test_shard_module_params_keeps_flax_auto_names():
    dense = fsdp_tp.shard_module_params(nn.Dense)
    assert dense.__name__ == "Dense"

"""Partition rules and ``shard_by_rules`` (issue 4, acceptance 1, 2 and 6)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import fsdp_tp
from fsdp_tp.errors import IndivisibleShapeError, RuleError, SpecError, UnmatchedRuleWarning
from tests.conftest import BATCH_AXES, mesh_of
from tests.equivalence import Case, check_equivalence
from tests.refusals import named_fix

MESHES = [(2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 4, 2)]
ENTRIES = [None, "data", "fsdp", "tensor", ("fsdp", "tensor"), ("data", "fsdp")]
PATHS = [
    "encoder/layers_0/attn/query/kernel",
    "encoder/layers_0/attn/query/bias",
    "encoder/layers_1/mlp/wi/kernel",
    "encoder/layers_1/mlp/wo/kernel",
    "decoder/embed/embedding",
    "decoder/norm/scale",
]
PATTERNS = ["kernel", "bias$", "attn/", "layers_[01]/mlp", "^decoder", "embed", ".*", "query/(kernel|bias)"]
unmatched_ok = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.UnmatchedRuleWarning")


def nest(flat: dict) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = leaf
    return tree


@unmatched_ok
@given(
    mesh=st.sampled_from(MESHES),
    shapes=st.dictionaries(
        st.sampled_from(PATHS), st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), min_size=1, max_size=3)
    ),
    rules=st.lists(
        st.tuples(st.sampled_from(PATTERNS), st.lists(st.sampled_from(ENTRIES), max_size=3).map(tuple)),
        max_size=5,
    ),
)
def test_specs_divide_or_raise_and_the_first_match_wins(mesh, shapes, rules):
    mesh = mesh_of(*mesh)
    tree = nest({path: jax.ShapeDtypeStruct(tuple(shape), jnp.float32) for path, shape in shapes.items()})
    first = {
        path: next((P(*spec) for pattern, spec in rules if re.search(pattern, path)), P()) for path in shapes
    }
    valid = all(fits(tuple(shapes[path]), spec, mesh) for path, spec in first.items())
    if not valid:
        with pytest.raises((SpecError, IndivisibleShapeError)):
            fsdp_tp.rules.specs_from_rules(tree, rules, mesh)
        return
    specs = fsdp_tp.rules.specs_from_rules(tree, rules, mesh)
    leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    assert {fsdp_tp.rules.path_of(p): spec for p, spec in leaves} == first


def fits(shape, spec, mesh) -> bool:
    """Written apart from the library: at most one dim per axis, and every split dim divides."""
    if len(spec) > len(shape):
        return False
    used = []
    for dim, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else entry or ()
        used += list(axes)
        parts = 1
        for a in axes:
            parts *= mesh.shape[a]
        if shape[dim] % parts:
            return False
    return len(used) == len(set(used))


class Stack(nn.Module):
    """Two dense layers and an embedding-like table: kernels, biases and a 1-d scale."""

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16, name="wi")(x))
        h = h * self.param("scale", nn.initializers.normal(1.0), (16,))
        return nn.Dense(8, name="wo")(h)


KERNEL_SPECS = [
    P("fsdp", "tensor"),
    P("tensor", "fsdp"),
    P(None, ("fsdp", "tensor")),
    P(("data", "fsdp"), None),
    P("tensor"),
    P(),
]
VECTOR_SPECS = [P("tensor"), P("fsdp"), P(("fsdp", "tensor")), P()]


@unmatched_ok
@given(
    mesh=st.sampled_from(MESHES),
    check_vma=st.booleans(),
    kernels=st.lists(st.sampled_from(KERNEL_SPECS), min_size=2, max_size=2),
    vector=st.sampled_from(VECTOR_SPECS),
    seed=st.integers(0, 2**16),
)
def test_a_model_sharded_by_rules_trains_equal_to_unsharded(mesh, check_vma, kernels, vector, seed):
    rules = [("wi/kernel", kernels[0]), ("kernel$", kernels[1]), ("bias|scale", vector)]
    model = fsdp_tp.shard_by_rules(Stack, rules)()
    check_equivalence(
        Case(model, Stack(), mesh_of(*mesh), BATCH_AXES, check_vma, in_dim=8, out_dim=8, seed=seed)
    )


class Logical(nn.Module):
    """Annotated only with flax logical axis names; ``annotate=False`` is the plain twin."""

    annotate: bool = True

    def init_for(self, names):
        init = nn.linear.default_kernel_init
        return nn.with_logical_partitioning(init, names) if self.annotate else init

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(16, kernel_init=self.init_for(("embed", "mlp")), name="wi")(x))
        return nn.Dense(8, kernel_init=self.init_for(("mlp", "embed")), name="wo")(h)


@pytest.mark.parametrize("check_vma", [True, False])
def test_logical_axis_names_alone_shard_and_train_equal(check_vma):
    model = fsdp_tp.shard_by_rules(Logical)()
    with nn.logical_axis_rules([("embed", "fsdp"), ("mlp", "tensor")]):
        case = Case(
            model, Logical(annotate=False), mesh_of(2, 2, 2), BATCH_AXES, check_vma, in_dim=8, out_dim=8
        )
        check_equivalence(case)
        _, specs = fsdp_tp.init_sharded(
            lambda r, x: model.init(r, x)["params"],
            case.mesh,
            (P(), P(BATCH_AXES)),
            jax.random.key(0),
            jnp.ones((8, 8)),
        )
    assert specs["wi"]["kernel"] == P("fsdp", "tensor") and specs["wo"]["kernel"] == P("tensor", "fsdp")


def test_bad_rules_each_get_a_clear_message():
    mesh = mesh_of(2, 2, 2)
    tree = {"wi": {"kernel": jnp.ones((8, 6))}}
    with pytest.warns(
        UnmatchedRuleWarning, match=r"rules matching no parameter: \['wq/kernel'\]; .* wi/kernel"
    ) as caught:
        fsdp_tp.rules.specs_from_rules(tree, [("wi/kernel", P()), ("wq/kernel", P("fsdp"))], mesh)
    assert caught[0].filename == __file__
    with pytest.raises(SpecError, match=r"wi/kernel: spec .* names mesh axis 'model', but the mesh has axes"):
        fsdp_tp.rules.specs_from_rules(tree, [("kernel", P("model"))], mesh)
    with pytest.raises(
        IndivisibleShapeError,
        match=r"wi/kernel: dim 1 \(size 6\) of shape \(8, 6\) .* \('fsdp', 'tensor'\) \(size 4\)",
    ):
        fsdp_tp.rules.specs_from_rules(tree, [("kernel", P(None, ("fsdp", "tensor")))], mesh)
    with pytest.raises(SpecError, match=r"wi/kernel: spec .* uses mesh axis 'fsdp' on dims 0 and 1"):
        fsdp_tp.rules.specs_from_rules(tree, [("kernel", P("fsdp", "fsdp"))], mesh)
    with pytest.raises(RuleError, match=r"rule pattern 'wi/\[kernel' is not a regular expression") as refused:
        fsdp_tp.rules.specs_from_rules(tree, [("wi/[kernel", P())], mesh)
    named_fix(refused, "match its text literally: ('wi/\\\\[kernel', ...)")
    assert fsdp_tp.rules.specs_from_rules({"wi/[kernel": jnp.ones(2)}, [(r"wi/\[kernel", P())], mesh)
    with pytest.raises(SpecError, match=r"names 3 dims, but the array has shape \(8, 6\)"):
        fsdp_tp.rules.specs_from_rules(tree, [("kernel", P(None, None, "fsdp"))], mesh)


def test_shard_by_rules_is_keyword_only_after_rules_and_warns_for_0_1s_positional_form():
    """Issue 83 point 3: Linen's shard_by_rules took default, logical_axis_rules, batch_axes,
    mixed_precision and tp_rules positionally; like NNX's, they are keyword-only now. 0.1's
    form still builds the same model, with a DeprecationWarning naming the call to write."""
    rules, default = [("kernel", P("fsdp"))], P("fsdp")  # (the bias takes the default)
    mesh = mesh_of(2, 2, 2)
    init = lambda model: fsdp_tp.init_sharded(
        lambda r, x: model.init(r, x)["params"], mesh, (P(), P()), jax.random.key(0), jnp.ones((4, 8))
    )[1]
    named = fsdp_tp.shard_by_rules(nn.Dense, rules, default=default, batch_axes=("data",))
    with pytest.warns(
        DeprecationWarning, match=r"rules, default, logical_axis_rules, batch_axes\) position"
    ) as said:
        positional = fsdp_tp.shard_by_rules(nn.Dense, rules, default, None, ("data",))
    assert (
        "write shard_by_rules(target, rules, default=..., logical_axis_rules=..., batch_axes=...)"
        in str(said[0].message)
        and said[0].filename == __file__
    )
    assert init(positional(16)) == init(named(16)) and init(named(16))["bias"] == P("fsdp")
    with pytest.raises(TypeError, match=r"got default= positionally and by name"):
        fsdp_tp.shard_by_rules(nn.Dense, rules, default, default=P("fsdp"))
    with pytest.raises(TypeError, match=r"then default, .*tp_rules by name; got 8 positional"):
        fsdp_tp.shard_by_rules(nn.Dense, rules, *[None] * 6)


RULES_ON_A_LAYERS_DIM = {"kernel": ("wi/kernel", P(None, "fsdp")), "bias": ("wi/bias", P(("tensor", "fsdp")))}


@unmatched_ok
@pytest.mark.parametrize("on", list(RULES_ON_A_LAYERS_DIM))
def test_a_rule_on_a_dim_a_tensor_parallel_layer_splits_is_refused(on):
    """Also with the layer's axis first (('tensor', 'fsdp'), as FSDP's own choice stores a
    column layer's bias): the axes a rule names are the axes its transform gathers."""
    path, spec = RULES_ON_A_LAYERS_DIM[on]

    def init(rule):
        model = fsdp_tp.shard_by_rules(fsdp_tp.MLPBlock, [rule])(16, out_features=8)
        apply = lambda r, x: model.init(r, x)["params"]
        return fsdp_tp.init_sharded(apply, mesh_of(2, 2, 2), (P(), P()), jax.random.key(0), jnp.ones((4, 8)))

    said = rf"{path}: the rule splits dim {len(spec) - 1} over {re.escape(repr(spec[-1]))}, but its layer"
    with pytest.raises(RuleError, match=said) as refused:
        init(RULES_ON_A_LAYERS_DIM[on])
    named_fix(refused, "give that dim None in the rule")
    init((path, P(*spec[:-1], None)))


@unmatched_ok
def test_negative_control_a_rule_naming_a_layers_axis_accepted_trains_another_model(monkeypatch):
    """Accepted as FSDP's own choice is, the bias rule has the rules' transform gather 'tensor'
    too, so every layer computes on whole kernels and sums them over tensor: another model."""
    merge = fsdp_tp.linen._transform._merge
    monkeypatch.setattr(
        fsdp_tp.linen._transform, "_merge", lambda path, names, spec, _: merge(path, names, spec, True)
    )
    model = fsdp_tp.shard_by_rules(fsdp_tp.MLPBlock, [RULES_ON_A_LAYERS_DIM["bias"]])(16, out_features=8)
    twin = fsdp_tp.MLPBlock(16, out_features=8, axis=None)
    with pytest.raises(AssertionError, match="output"):
        check_equivalence(Case(model, twin, mesh_of(2, 2, 2), BATCH_AXES, True, in_dim=8, out_dim=8))


@unmatched_ok
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_add_fsdp_to_a_tensor_parallel_block(check_vma):
    model = fsdp_tp.shard_by_rules(
        fsdp_tp.MLPBlock, [("wi/kernel", P("fsdp")), ("wo/kernel", P(None, "fsdp"))]
    )
    check_equivalence(
        Case(
            model(16, out_features=8),
            fsdp_tp.MLPBlock(16, out_features=8, axis=None),
            mesh_of(2, 2, 2),
            BATCH_AXES,
            check_vma,
            in_dim=8,
            out_dim=8,
        )
    )


@unmatched_ok
def test_negative_control_gathering_fsdp_without_the_mean_is_caught(monkeypatch):
    """With fsdp left out of the batch axes (and the check that refuses it, test_batch_axes,
    patched out), the fsdp gather slices the gradient instead of averaging it."""
    monkeypatch.setattr(fsdp_tp._batch, "require_step_batch", lambda *args: None)
    model = fsdp_tp.shard_by_rules(Stack, [("kernel", P("fsdp"))], batch_axes=("data",))()
    with pytest.raises(AssertionError, match="grads"):
        check_equivalence(Case(model, Stack(), mesh_of(1, 4, 2), BATCH_AXES, False, in_dim=8, out_dim=8))


LOGICAL = ["batch", "embed", "heads", "mlp", "vocab", None]
MESH_AXES = st.sampled_from([None, "data", "fsdp", "tensor", ("fsdp", "tensor"), ("data", "fsdp")])


@settings(max_examples=200)
@given(
    names=st.lists(st.sampled_from(LOGICAL), min_size=0, max_size=4).filter(
        lambda ns: len([n for n in ns if n]) == len({n for n in ns if n})
    ),
    rules=st.lists(st.tuples(st.sampled_from(LOGICAL[:-1]), MESH_AXES), max_size=6),
)
def test_the_cores_logical_names_map_as_flax_maps_them(names, rules):
    """The core's ``logical_spec`` (no Linen) is flax's ``nn.logical_to_mesh_axes``, so every
    front end lays out a logically named parameter as Linen would."""
    assert fsdp_tp.rules.logical_spec(names, rules) == nn.logical_to_mesh_axes(names, rules)


def test_logical_spec_negative_control_rule_order_matters():
    # The first rule for a name wins, and a mesh axis serves one dim: swapping them changes the spec.
    rules = [("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor")]
    assert fsdp_tp.rules.logical_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert fsdp_tp.rules.logical_spec(("embed", "mlp"), rules[1:] + rules[:1]) == P(None, "fsdp")

"""Every mistake on the tensor-parallel surfaces is one error naming what was passed, what
was expected and the fix (issue 61): ``tp_rules="auto"`` and ``find_tp_rules``, the einsum and
sequence roles, ``register_einsum``, the NNX constructor, ``init_sharded``, ``merge``,
``Checkpoints.save`` and ``vocab_parallel_cross_entropy``. For each fix a message names, a
test that following it works."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_tp
import fsdp_tp.nnx as fsdp_nnx
from fsdp_tp.errors import RuleError, UnboundAxisNameError
from fsdp_tp.linen import find_tp_rules
from fsdp_tp.tp import ColumnParallel, RowParallel, _registered
from tests.refusals import named_fix, role_named

pytestmark = pytest.mark.filterwarnings("ignore::fsdp_tp.errors.ReplicatedParameterWarning")

X = jnp.ones((8, 16, 32))


class MLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="down")(nn.relu(nn.Dense(self.hidden, name="up")(x)))


class Chain(nn.Module):
    """up, mid, down: a column, then a row where the user wrote a second column."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="down")(nn.Dense(64, name="mid")(nn.relu(nn.Dense(64, name="up")(x))))


class NormBetween(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="down")(nn.LayerNorm(name="ln")(nn.Dense(64, name="up")(x)))


class Keyword(nn.Module):
    @nn.compact
    def __call__(self, x, *, train):
        return MLP()(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


class NNXNormBetween(nnx.Module):
    def __init__(self, rngs):
        self.up, self.ln = nnx.Linear(32, 64, rngs=rngs), nnx.LayerNorm(64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.down(self.ln(self.up(x)))


def _mesh(tensor: bool = True):
    return fsdp_tp.make_mesh({"data": 2, "tensor": 4} if tensor else {"data": 2, "fsdp": 4})


def _linen(model, tp_rules, mesh=None, x=X):
    """``model``'s class under ``tp_rules``, initialized on ``mesh`` (which checks the plan)."""
    sharded = fsdp_tp.shard_by_rules(type(model), tp_rules=tp_rules)(
        **{f: getattr(model, f) for f in ("hidden",) if hasattr(model, f)}
    )
    init = lambda rngs, x: sharded.init(rngs, x)["params"]
    return fsdp_tp.init_sharded(init, mesh or _mesh(), (P(), P("data")), jax.random.key(0), x)


def _nnx(make, tp_rules, x=X, **kwargs):
    """``make``'s model under ``tp_rules``, initialized and called once on ``x``."""
    sharded = fsdp_nnx.shard_by_rules(make, [], tp_rules=tp_rules, **kwargs)
    mesh = _mesh()
    (params, rest), (specs, rest_specs) = fsdp_tp.init_sharded(sharded.init, mesh, P(), jax.random.key(0))
    call = jax.shard_map(
        lambda p, r, x: sharded.merge(p, r)(x),
        mesh=mesh,
        in_specs=(specs, rest_specs, P("data")),
        out_specs=P("data"),
    )
    return jax.jit(call)(params, rest, x)


# --- tp_rules="auto" and find_tp_rules ---


@pytest.mark.parametrize("size", ["4", 0, -2, 2.0, True])
def test_find_tp_rules_refuses_a_size_that_is_not_an_axis_size(size):
    for find in (
        lambda: find_tp_rules(MLP(), X, size=size),
        lambda: fsdp_nnx.find_tp_rules(NNXMLP(nnx.Rngs(0)), X, size=size),
    ):
        with pytest.raises(
            RuleError, match=rf"size={size!r} is not an axis size: .* a whole number >= 1 \(e\.g\. size=4\)"
        ) as refused:
            find()
    named_fix(refused, "(e.g. size=4)")
    assert find_tp_rules(MLP(), X, size=4).roles.keys() == {"up", "down"}


def test_find_tp_rules_names_the_keyword_arguments_a_call_requires():
    """A model whose ``__call__`` requires a keyword-only argument: a raw TypeError before."""
    with pytest.raises(
        RuleError,
        match=r"Keyword's call .* missing 1 required keyword-only argument: 'train'.*"
        r"find_tp_rules\(model, x, train=False\)",
    ) as refused:
        find_tp_rules(Keyword(), X, size=4)
    named_fix(refused, "its keyword arguments by name after them (find_tp_rules(model, x, train=False)")
    assert find_tp_rules(Keyword(), X, size=4, train=False).roles


def test_wrong_shaped_inputs_are_named_with_their_shapes():
    with pytest.raises(
        RuleError,
        match=r"NNXMLP's call on the inputs it is given, and it fails on positional "
        r"\(\(8, 16, 31\),\) .* contracting dimensions",
    ):
        fsdp_nnx.find_tp_rules(NNXMLP(nnx.Rngs(0)), jnp.ones((8, 16, 31)), size=4)
    with pytest.raises(RuleError, match=r"fails on positional \(\(8, 16, 31\),\)") as refused:
        _nnx(NNXMLP, "auto", inputs=(jnp.ones((8, 16, 31)),))
    named_fix(refused, "the inputs positionally, with the shapes the model trains on")
    assert _nnx(NNXMLP, "auto", inputs=(X,)).shape == (8, 16, 32)


@pytest.mark.parametrize(
    "given, said",
    [
        (NNXMLP, "got the class NNXMLP: build it"),
        (MLP(), "got a MLP: a Linen module's plan is fsdp_tp.linen.find_tp_rules"),
    ],
    ids=["a class", "a Linen module"],
)
def test_nnx_find_tp_rules_takes_a_built_nnx_model(given, said):
    with pytest.raises(
        RuleError, match=rf"fsdp_tp.nnx.find_tp_rules takes a built NNX model .*; {said}"
    ) as refused:
        fsdp_nnx.find_tp_rules(given, X, size=4)
    if isinstance(given, type):
        named_fix(refused, "build it")
        assert fsdp_nnx.find_tp_rules(given(nnx.Rngs(0)), X, size=4).roles.keys() == {"up", "down"}
    else:
        named_fix(refused, "a Linen module's plan is fsdp_tp.linen.find_tp_rules'")
        assert find_tp_rules(given, X, size=4).roles.keys() == {"up", "down"}
    with pytest.raises(
        RuleError, match=r"fsdp_tp.linen.find_tp_rules takes a Linen module .*; got the class MLP"
    ) as refused:
        find_tp_rules(MLP, X, size=4)
    named_fix(refused, "build it: find_tp_rules(Model(...), x)")


def test_auto_on_a_mesh_without_tensor_names_the_axis_not_a_rule():
    """It named tp rule '^up$', which the user never wrote."""
    for run in (lambda mesh: _linen(MLP(), "auto", mesh),):
        with pytest.raises(
            RuleError,
            match=r"shard_by_rules\(MLP, tp_rules='auto'\) splits over mesh axis "
            r"'tensor', which this mesh does not have \(its axes: data, fsdp\): add a 'tensor' axis",
        ) as refused:
            run(_mesh(tensor=False))
    sharded = fsdp_nnx.shard_by_rules(NNXMLP, [], tp_rules="auto", inputs=(X,))
    with pytest.raises(RuleError, match=r"which this mesh does not have") as refused_nnx:
        fsdp_tp.init_sharded(sharded.init, _mesh(tensor=False), P(), jax.random.key(0))
    for said in (refused, refused_nnx):
        named_fix(said, "add a 'tensor' axis to the mesh")
    params, _ = _linen(MLP(), "auto", _mesh())
    assert params["up"]["kernel"].value.shape == (32, 64)
    fsdp_tp.init_sharded(sharded.init, _mesh(), P(), jax.random.key(0))


# --- sequence_dim, einsum letters, a column's and a row's inputs ---


@pytest.mark.parametrize("dim", [-1, True, 1.0])
def test_a_sequence_dim_that_is_not_a_dim_is_refused_when_the_role_is_made(dim):
    """-1 was the features: a ScopeParamShapeError and the advice to make the layer before it
    ColumnParallel."""
    with pytest.raises(
        RuleError,
        match=rf"ColumnParallel\(sequence_dim={dim!r}\): sequence_dim is the "
        r"activations' sequence dim counted from the front, a whole number >= 0 \(1 for",
    ) as refused:
        ColumnParallel(sequence_dim=dim)
    named_fix(refused, "(1 for (batch, sequence, features))")
    assert ColumnParallel(sequence_dim=1).sequence_dim == 1


def test_a_sequence_dim_past_the_input_is_named_with_its_shape():
    """``TPPlan.scheduled(sequence_dim=5)``: numpy's 'axis 5 is out of bounds' before."""
    plan = find_tp_rules(MLP(), X, size=4).scheduled(sequence_dim=5)
    said = (
        r"up: ColumnParallel\(sequence_dim=5\) names dim 5 of its input, of shape \(4, 16, 32\) on "
        r"this device, whose sequence dim is one of 0..1 \(the last is the features\)"
    )
    with pytest.raises(RuleError, match=said) as refused:
        _linen(MLP(), plan.rules)
    with pytest.raises(RuleError, match=said):
        _nnx(NNXMLP, fsdp_nnx.find_tp_rules(NNXMLP(nnx.Rngs(0)), X, size=4).scheduled(sequence_dim=5).rules)
    named_fix(refused, "pass the dim the sequence is on (1 for (batch, sequence, features))")
    params, _ = _linen(MLP(), find_tp_rules(MLP(), X, size=4).scheduled(sequence_dim=1).rules)
    assert params["down"]["kernel"].value.shape == (64, 32)


def test_a_column_fed_a_column_is_told_to_end_the_split():
    """column -> column -> row: the second column was told to "make this one ColumnParallel"."""
    with pytest.raises(
        RuleError,
        match=r"mid \(ColumnParallel\) reads its input whole, and it arrived split .* "
        r"Fix: make mid RowParallel, so the split ends here",
    ) as refused:
        _linen(Chain(), [(r"^(up|mid)$", ColumnParallel()), (r"^down$", RowParallel())])
    named_fix(refused, "make mid RowParallel")
    _linen(Chain(), [(r"^up$", ColumnParallel()), (r"^mid$", RowParallel())])


def test_a_row_alone_with_a_sequence_dim_is_told_what_feeds_it():
    with pytest.raises(
        RuleError,
        match=r"down \(RowParallel\) takes the split features a ColumnParallel .* "
        r"arrived whole .* Fix: make the layer that feeds down ColumnParallel, or drop down's rule",
    ) as refused:
        _linen(MLP(), [(r"^down$", RowParallel(sequence_dim=1))])
    named_fix(refused, "make the layer that feeds down ColumnParallel")
    _linen(MLP(), [(r"^up$", ColumnParallel(sequence_dim=1)), (r"^down$", RowParallel(sequence_dim=1))])


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_norm_between_a_column_and_its_row_is_named(api):
    """A ScopeParamShapeError (Linen) or a reshape's TypeError (NNX) with advice about head counts."""
    said = (
        r"a LayerNorm the rules leave whole fails on a device's slice of the features a column layer "
        r"splits at .*test_bad_input_tp.py:\d+ .* Fix: leave the column and row layers around it whole "
        r"\(drop its tp rule\)"
    )
    rules = [(r"^up$", ColumnParallel()), (r"^down$", RowParallel())]
    with pytest.raises(RuleError, match=said) as refused:
        _linen(NormBetween(), rules) if api == "linen" else _nnx(NNXNormBetween, rules)
    named_fix(refused, "leave the column and row layers around it whole (drop its tp rule)")
    _linen(NormBetween(), []) if api == "linen" else _nnx(NNXNormBetween, [])


class StackedKV(nn.Module):
    """Gemma's stacked k/v einsum (C: k or v), unpacked by the model."""

    @nn.compact
    def __call__(self, x):
        k, v = nn.Einsum((2, 32, 4, 8), "BSD,CDKH->CBSKH", name="kv")(x)
        return nn.DenseGeneral(32, axis=(-2, -1), name="out")(k * v)


def test_an_einsum_letter_that_cannot_work_names_the_one_that_does():
    """``letter="C"`` on the stacked k/v dim the model unpacks: refused before the first step,
    naming the kv-head letter."""
    mesh = fsdp_tp.make_mesh({"data": 4, "tensor": 2})
    with pytest.raises(
        RuleError,
        match=r"Einsum letters: kv: ColumnParallel\(letter='C'\) splits letter 'C' of "
        r"'BSD,CDKH->CBSKH', one of 'C', 'K', 'H'; the plan found gives ColumnParallel\(letter='K'\)",
    ) as refused:
        _linen(StackedKV(), [(r"^kv$", ColumnParallel(letter="C")), (r"^out$", RowParallel())], mesh)
    found = role_named(refused, r"ColumnParallel\(letter='K'\)")
    _linen(StackedKV(), [(r"^kv$", found), (r"^out$", RowParallel())], mesh)


class IndexedKV(nn.Module):
    """The same einsum, its k and v read by index: JAX clamps an index past a split dim, so
    nothing fails on a device's slice, and the check refuses it."""

    @nn.compact
    def __call__(self, x):
        kv = nn.Einsum((2, 32, 4, 8), "BSD,CDKH->CBSKH", name="kv")(x)
        return nn.DenseGeneral(32, axis=(-2, -1), name="out")(kv[0] * kv[1])


class NNXIndexedKV(nnx.Module):
    def __init__(self, rngs):
        self.kv = nnx.Einsum("BSD,CDKH->CBSKH", (2, 32, 4, 8), rngs=rngs)
        self.out = nnx.LinearGeneral((4, 8), 32, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
        kv = self.kv(x)
        return self.out(kv[0] * kv[1])


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_refused_einsum_letter_the_rule_left_out_names_the_one_that_works(api):
    """Issue 57 point 1: a column role without letter= takes the first output letter ('C', the
    stacked k/v); the refusal names the letters and the one the plan finder gives."""
    mesh = fsdp_tp.make_mesh({"data": 4, "tensor": 2})

    def init(letter):
        rules = [(r"^kv$", ColumnParallel(letter=letter)), (r"^out$", RowParallel())]
        if api == "linen":
            return _linen(IndexedKV(), rules, mesh)
        sharded = fsdp_nnx.shard_by_rules(NNXIndexedKV, [], tp_rules=rules, inputs=(X,))
        return fsdp_tp.init_sharded(sharded.init, mesh, P(), jax.random.key(0))

    said = (
        r"Einsum letters: kv: ColumnParallel\(\) splits letter 'C' of 'BSD,CDKH->CBSKH', the first of "
        r"'C', 'K', 'H'; the plan found gives ColumnParallel\(letter='K'\)"
    )
    with pytest.raises(RuleError, match=said) as refused:
        init(None)
    init(role_named(refused, r"ColumnParallel\(letter='K'\)").letter)


# --- register_einsum ---


class Projection(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return jnp.einsum(
            "...i,io->...o", x, self.param("w", nn.initializers.normal(), (x.shape[-1], self.width))
        )


class TwoProjections(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Projection(32, name="down")(nn.relu(Projection(64, name="up")(x)))


@pytest.fixture
def registry():
    """The registry as it was, after the test (a refused registration leaves it unchanged)."""
    before = dict(_registered._REGISTERED)
    yield _registered.register_einsum
    _registered._REGISTERED.clear()
    _registered._REGISTERED.update(before)


ROLES = [(r"^up$", ColumnParallel()), (r"^down$", RowParallel())]


@pytest.mark.parametrize(
    "equation, said, fix",
    [
        ("...i,io->...q", r"its output names 'q', which neither operand has", "each output letter is a dim"),
        ("...i->...o", r"a tp role reads an explicit two-operand equation", "'inputs,kernel->output'"),
        ("...i,ii->...i", r"its kernel 'ii' must name each dim with its own letter", "its own letter"),
    ],
)
def test_register_einsum_refuses_an_equation_it_cannot_read(registry, equation, said, fix):
    with pytest.raises(RuleError, match=said) as refused:
        registry(Projection, equation, kernel="w", sizes={"width": "o"})
    assert Projection not in _registered._REGISTERED
    named_fix(refused, fix)  # (the equation the module computes, written so: accepted)
    registry(Projection, "...i,io->...o", kernel="w", sizes={"width": "o"})
    assert Projection in _registered._REGISTERED


def test_register_einsum_names_a_kernel_or_size_attribute_the_module_lacks(registry):
    registry(Projection, "...i,io->...o", kernel="kern", sizes={"width": "o"})
    with pytest.raises(
        RuleError,
        match=r"up, a Projection registered with kernel='kern', and it makes the "
        r"parameters \['w'\]: register it with kernel= the name of its einsum's kernel",
    ) as refused:
        _linen(TwoProjections(), ROLES)
    named_fix(refused, "register_einsum(Projection, '...i,io->...o', kernel=..., replace=True)")
    registry(Projection, "...i,io->...o", kernel="w", sizes={"features": "o"}, replace=True)
    with pytest.raises(
        RuleError,
        match=r"sizes=\{'features': ...\} names an attribute Projection does not have "
        r"\(it has width\); register it again with the name the module uses",
    ) as refused:
        _linen(TwoProjections(), ROLES)
    named_fix(refused, "register it again with the name the module uses (register_einsum(..., replace=True))")
    registry(Projection, "...i,io->...o", kernel="w", sizes={"width": "o"}, replace=True)
    params, _ = _linen(TwoProjections(), ROLES)
    assert params["up"]["w"].value.shape == (32, 64)


def test_register_einsum_takes_a_class_once_and_never_flax_s_own(registry):
    with pytest.raises(
        RuleError,
        match=r"register_einsum takes the module class; got an instance of "
        r"Projection: pass Projection",
    ) as refused:
        registry(Projection(3), "...i,io->...o", kernel="w")
    named_fix(refused, "pass Projection")
    registry(Projection, "...i,io->...o", kernel="w", sizes={"width": "o"})
    registry(Projection, "...i,io->...o", kernel="w", sizes={"width": "o"})  # the same again: nothing changes
    with pytest.raises(
        RuleError,
        match=r"Projection is already registered as '...i,io->...o' \(kernel='w', "
        r"sizes=\{'width': 'o'\}\); pass replace=True",
    ) as refused:
        registry(Projection, "...o,io->...i", kernel="w", sizes={"width": "i"})
    named_fix(refused, "pass replace=True to register it anew")
    registry(Projection, "...o,io->...i", kernel="w", sizes={"width": "i"}, replace=True)
    registry(Projection, "...i,io->...o", kernel="w", sizes={"width": "o"}, replace=True)
    for cls in (nn.Dense, nnx.Linear):
        with pytest.raises(
            RuleError,
            match=rf"register_einsum\(flax\..*{cls.__name__}\): a Flax layer the tp roles "
            rf"already compute .* Register a class of your own \(a subclass of {cls.__name__} is one\)",
        ) as refused:
            registry(cls, "...i,io->...o")
        named_fix(refused, f"Register a class of your own (a subclass of {cls.__name__} is one)")
    # (nn.Dense registered in 0.2 made every nn.Dense column rule in the process refused)
    params, _ = _linen(MLP(), ROLES)
    assert params["up"]["kernel"].value.shape == (32, 64)
    Subclass = type("Subclass", (Projection,), {})
    registry(Subclass, "...i,io->...o", kernel="w", sizes={"width": "o"})


# --- the NNX constructor, init_sharded, merge ---


@pytest.mark.parametrize(
    "make, said",
    [
        (
            nnx.Linear,
            r"called as make_model\(rngs\) with an nnx.Rngs alone, and it needs more \(missing a "
            r"required argument: 'in_features'\); pass a function of the rngs .* lambda rngs: "
            r"Linear\(..., rngs=rngs\)",
        ),
        (
            lambda rngs, width: NNXMLP(rngs),
            r"missing a required argument: 'width'\); .* lambda rngs: Model\(..., rngs=rngs\)",
        ),
    ],
    ids=["a layer class", "a constructor of two"],
)
def test_a_constructor_that_needs_more_than_the_rngs_is_named(make, said):
    with pytest.raises(TypeError, match=said):
        fsdp_tp.init_sharded(fsdp_nnx.shard_by_rules(make, []).init, _mesh(), P(), jax.random.key(0))


def test_a_constructor_that_takes_rngs_by_keyword_only_is_accepted():
    """``def make(*, rngs)``: 'takes 0 positional arguments but 1 was given' before."""

    def make(*, rngs):
        return NNXMLP(rngs)

    (by_keyword, _), _ = fsdp_tp.init_sharded(
        fsdp_nnx.shard_by_rules(make, []).init, _mesh(), P(), jax.random.key(0)
    )
    (by_position, _), _ = fsdp_tp.init_sharded(
        fsdp_nnx.shard_by_rules(NNXMLP, []).init, _mesh(), P(), jax.random.key(0)
    )
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), by_keyword, by_position))


def test_init_sharded_names_what_to_pass_for_a_sharded_model_or_its_inputs():
    sharded = fsdp_nnx.shard_by_rules(NNXMLP, [])
    with pytest.raises(
        TypeError,
        match=r"init_fn must be a function each device runs; got a ShardedModel: pass "
        r"sharded.init \(its parameters and other state\) or sharded.state_init_fn\(tx\)",
    ):
        fsdp_tp.init_sharded(sharded, _mesh(), P(), jax.random.key(0))
    with pytest.raises(TypeError, match=r"got a int \(42\): pass the per-device init"):
        fsdp_tp.init_sharded(42, _mesh(), P(), jax.random.key(0))
    state_init = sharded.state_init_fn(optax.sgd(0.1))
    with pytest.raises(
        TypeError,
        match=r"state_init_fn\(tx\) is called with the rng alone, and init_sharded passed "
        r"1 more argument\(s\): .* init_sharded\(sharded.state_init_fn\(tx\), mesh, P\(\), rng\)",
    ):
        fsdp_tp.init_sharded(state_init, _mesh(), (P(), P("data")), jax.random.key(0), X)
    state, _ = fsdp_tp.init_sharded(state_init, _mesh(), P(), jax.random.key(0))  # the fix
    assert state.params["up"]["kernel"].shape == (32, 64)


def test_merge_names_the_parameters_a_tree_lacks():
    sharded = fsdp_nnx.shard_by_rules(NNXMLP, [])
    mesh = _mesh()
    (params, _), (specs, _) = fsdp_tp.init_sharded(sharded.init, mesh, P(), jax.random.key(0))
    lacking = {"up": params["up"]}

    def call(p):
        return sharded.merge(p)(jnp.ones((4, 32)))

    with pytest.raises(
        ValueError,
        match=r"merge: the params given lack 2 of the model's 4 parameters "
        r"\(down/bias, down/kernel\): pass the whole tree init_sharded made \(state.params\)",
    ):
        jax.shard_map(call, mesh=mesh, in_specs=({"up": specs["up"]},), out_specs=P())(lacking)
    assert jax.shard_map(call, mesh=mesh, in_specs=(specs,), out_specs=P())(params).shape == (4, 32)


# --- checkpoints and the vocab-parallel loss ---


def test_a_checkpoint_of_a_string_names_the_leaf(tmp_path):
    state = {"w": jnp.ones(3), "note": "hello"}
    with fsdp_tp.Checkpoints(tmp_path) as checkpoints:
        with pytest.raises(
            TypeError,
            match=r"Checkpoints.save\(1, ...\): the state's leaf at \['note'\] is a str "
            r"\('hello'\); a checkpoint holds arrays. Put it in meta=",
        ):
            checkpoints.save(1, state)
        checkpoints.save(1, {"w": state["w"]}, meta={"note": state["note"]})  # the fix
        restored, meta = checkpoints.restore({"w": jnp.zeros(3)})
    assert meta["note"] == "hello" and restored["w"].tolist() == [1.0, 1.0, 1.0]


def test_the_vocab_parallel_loss_outside_shard_map_says_where_to_call_it():
    logits, labels = jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(
        UnboundAxisNameError,
        match=r"vocab_parallel_cross_entropy: mesh axis 'tensor' is not "
        r"bound here; it was called outside jax.shard_map",
    ):
        fsdp_tp.vocab_parallel_cross_entropy(logits, labels)
    inside = jax.shard_map(
        fsdp_tp.vocab_parallel_cross_entropy, mesh=_mesh(), in_specs=(P(None, "tensor"), P()), out_specs=P()
    )
    assert inside(logits, labels).shape == (4,)

"""The core does not know Linen (issue 32 point 2): the seam a second front end plugs into.

``import flax`` itself imports ``flax.linen`` (flax's ``__init__``), and so does flax's
``train_state``; so which modules a process has loaded cannot show what *our* code depends
on. What is proved here is the property that matters for a second front end: no core
module, and no fsdp_tp module it imports (transitively), imports ``flax.linen`` or a Linen
front-end module of this package. Read off the source's import statements (the AST).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import fsdp_tp
import fsdp_tp.linen
import fsdp_tp.nnx
from fsdp_tp.tp._role import TPRole

PACKAGE = Path(fsdp_tp.__file__).parent

# The framework-free core: layout, rule grammar, collectives, Megatron's pieces (tp), the trace,
# the sharded-init programs, the optimizer on global arrays, the step, the plan, checkpoints,
# and what they share.
CORE = (
    "_aliases",
    "_renamed",
    "_axes",
    "_batch",
    "_check",
    "_check.blocks",
    "_check.driver",
    "_check.failures",
    "_check.partners",
    "_check.plain",
    "_check.refusals",
    "_check.round_trips",
    "_check.step",
    "_context",
    "_init_watch",
    "_layout",
    "_optimizer",
    "_sequence_split",
    "_trace",
    "_trace.graph",
    "_trace.ops",
    "_trace.rebind",
    "_trace.per_device",
    "_trace.relations",
    "_trace.sites",
    "_trace.walk",
    "_tree",
    "_types",
    "analysis",
    "analysis._hlo",
    "analysis._step_memory",
    "analysis._step_wire",
    "attention",
    "checkpoint",
    "checkpoint._files",
    "checkpoint._integrity",
    "checkpoint._state_tree",
    "collective_matmul",
    "collectives",
    "compile_cache",
    "collectives._gather",
    "collectives._mean_grad_gather",
    "context",
    "context._across",
    "context._all_to_all",
    "context._blocks",
    "context._dropout",
    "context._flax",
    "context._ring",
    "context._schedule",
    "dropout",
    "dropout._activation_split",
    "dropout._block_key",
    "errors",
    "gradients",
    "mesh",
    "partitioning",
    "plan",
    "precision",
    "routing",
    "rules",
    "sharded_init",
    "tp",
    "tp._around",
    "tp._einsum",
    "tp._expert_call",
    "tp._experts",
    "tp._find",
    "tp._find.driver",
    "tp._find.finder",
    "tp._find.experts",
    "tp._find.mesh",
    "tp._find.plan",
    "tp._find.regions",
    "tp._front",
    "tp._heads",
    "tp._matmul",
    "tp._region",
    "tp._protocol",
    "tp._registered",
    "tp._role",
    "tp._role_plan",
    "tp._roles",
    "tp._rules",
    "tp._storage",
    "tp._vocab",
    "tp._vocab_pieces",
    "tp.auto",
    "tp.pieces",
    "tp.roles",
    "tp_roles",
    "tp_rules",
    "train",
    "train._sequence_layout",
    "train._microbatches",
)


# The package's own __init__ is named by this, so that every module has a name.
TOP = "__init__"


def _module_file(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split(".")) if name != TOP else PACKAGE
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _all_modules() -> list[str]:
    """Every module of the package, dotted, the package's own ``__init__`` as ``TOP``."""
    names = (".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py"))
    return sorted(n if n == TOP else n.removesuffix(".__init__") for n in names)


def _imports(name: str) -> tuple[set[str], set[str]]:
    """``(fsdp_tp modules, other modules)`` that module ``name`` (dotted, inside the package)
    imports at any level of its source, docstrings excluded."""
    path = _module_file(name)
    # The package a relative import starts from: the module's own for an __init__, else its parent's.
    package = [] if name == TOP else name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.startswith("fsdp_tp") else others).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if node.module:
                    ours.add(".".join([*base, *node.module.split(".")]))
                else:  # from . import a, b
                    ours.update(".".join([*base, a.name]) for a in node.names)
            elif node.module:
                mod = node.module
                if mod.startswith("fsdp_tp"):
                    ours.add(mod.removeprefix("fsdp_tp").strip("."))
                else:
                    others.update([mod, *(f"{mod}.{a.name}" for a in node.names)])
    return {m for m in ours if _module_file(m).exists()}, others


def _closure(roots) -> dict[str, set[str]]:
    """Every fsdp_tp module reachable from ``roots``, with its non-fsdp_tp imports."""
    seen: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        ours, others = _imports(name)
        seen[name] = others
        todo += sorted(ours - seen.keys())
    return seen


def _linen(imports: set[str]) -> list[str]:
    return sorted(m for m in imports if m == "flax.linen" or m.startswith("flax.linen."))


def _nnx(imports: set[str]) -> list[str]:
    return sorted(m for m in imports if m == "flax.nnx" or m.startswith("flax.nnx."))


def test_no_core_module_imports_linen_directly_or_through_another():
    reached = _closure(CORE)
    assert not [name for name in reached if name.startswith("linen")], "the core reaches the Linen front end"
    assert set(CORE) <= set(reached)
    offenders = {name: _linen(others) + _nnx(others) for name, others in reached.items()}
    offenders = {name: flax for name, flax in offenders.items() if flax}
    assert not offenders, f"core modules (or their imports) importing flax.linen or flax.nnx: {offenders}"


def test_the_two_front_ends_stand_side_by_side_over_the_core():
    """The NNX front end reaches the core only (no Linen module, no flax.linen import), the
    Linen front end never reaches it, and the core reaches neither."""
    nnx_reach = _closure(["nnx"])
    assert {name for name in nnx_reach if name.startswith("nnx")} >= {"nnx", "nnx._model", "nnx._read"}
    assert not [n for n in nnx_reach if n.startswith("linen")], "fsdp_tp.nnx reaches the Linen front end"
    assert not {n: _linen(o) for n, o in nnx_reach.items() if _linen(o)}, "fsdp_tp.nnx imports flax.linen"
    linen_reach = _closure(["linen"])
    assert not [n for n in linen_reach if n.startswith("nnx")], "the Linen front end reaches fsdp_tp.nnx"
    assert not {n: _nnx(o) for n, o in linen_reach.items() if _nnx(o)}, "fsdp_tp.linen imports flax.nnx"
    assert not [n for n in _closure(CORE) if n.startswith("nnx")], "the core reaches fsdp_tp.nnx"


# Outside linen/ and the core, modules that need no Linen: the NNX GPT (it attends with the
# core's attention and remats by the shared policies). Before these lived in the core, it
# reached the Linen layers through `attend` and the Linen GPT through `REMAT_POLICIES`.
NEED_NO_LINEN = ("models.nnx_transformer", "models.remat")


@pytest.mark.parametrize("module", NEED_NO_LINEN)
def test_framework_free_pieces_do_not_live_in_the_linen_front_end(module):
    """Attention, the vocabulary-parallel loss and the remat policies are core: a module that
    needs no Linen reaches neither the Linen front end nor flax.linen through them."""
    reached = _closure([module])
    assert not [name for name in reached if name.startswith("linen")], f"{module} reaches the Linen front end"
    assert not {n: _linen(o) for n, o in reached.items() if _linen(o)}, module


@pytest.mark.parametrize("module", ["linen._transform", "linen.layers.dense", "linen.tp_rules"])
def test_negative_control_a_linen_module_is_seen(module):
    # The same walk finds Linen where it is: it could fail.
    assert any(_linen(others) for others in _closure([module]).values())


def test_bench_and_the_cli_share_the_recipe_not_each_other():
    """``bench/`` reads the main job's presets, data, trainer and throughput from ``recipe/``;
    nothing in ``bench/`` or ``recipe/`` imports ``cli/`` (whose ``main`` only dispatches the
    ``bench`` command)."""
    modules = [
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for folder in ("bench", "recipe")
        for p in (PACKAGE / folder).glob("*.py")
    ]
    offenders = {m: sorted(o for o in _imports(m)[0] if o.startswith("cli")) for m in modules}
    assert modules and not any(offenders.values()), offenders


# Above the core and the two front ends: the model zoo, the main job's recipe, the CLI, the
# benchmarks and the equivalence proof users and the suite share (each may use both front
# ends), the package's own __init__ and __main__.
APPLICATIONS = ("models", "hub", "recipe", "cli", "bench", "testing")
TOP_LEVEL = (TOP, "__main__")


def _tier(module: str) -> str | None:
    if module in CORE:
        return "core"
    if module.split(".")[0] in ("linen", "nnx"):
        return "front end"
    if module.split(".")[0] in APPLICATIONS or module in TOP_LEVEL:
        return "application"
    return None


def test_every_module_of_the_package_has_its_tier():
    """A new module is placed: in CORE (then the tests above prove it knows neither Flax API),
    in a front end's folder, or among the applications. None is left out of the checks."""
    unplaced = [m for m in _all_modules() if _tier(m) is None]
    assert not unplaced, f"modules in no tier: {unplaced}; add each to CORE (framework-free) or move it"
    assert set(CORE) <= set(_all_modules()), sorted(set(CORE) - set(_all_modules()))


ARCHITECTURE = PACKAGE.parents[1] / "docs" / "architecture.md"
_TIERS = {"core": "core", "front ends": "front end", "applications": "application"}


def _mapped(text: str) -> dict[str, tuple[int, int, list[str]]]:
    """``{tier: (count in the intro, count in the section's heading, modules in its rows)}``
    read off architecture.md's map: a ``### The <tier> (N modules)`` section per tier, one row
    per module, its path in the first cell (``_check/driver.py``, ``cli/__init__.py``), or one
    row per folder of the applications (``bench/``: every module under it, one concept)."""
    found = {}
    for title, tier in _TIERS.items():
        intro = re.search(rf"\*\*The {title}\*\* (?:\([^)]*?)?\(?(\d+) modules\)", text)
        section = re.search(rf"^### The {title} \((\d+) modules\)\n(.*?)(?=^#)", text, re.S | re.M)
        if not (intro and section):
            raise AssertionError(f"architecture.md has no count or no map section for the {title}")
        rows = re.findall(r"^\| `([\w/]+(?:\.py|/))` \|", section.group(2), re.M)
        names = [
            TOP if r == "__init__.py" else r.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for r in rows
            if not r.endswith("/")
        ]
        for folder in (r.removesuffix("/").replace("/", ".") for r in rows if r.endswith("/")):
            if tier != "application":
                raise AssertionError(f"architecture.md maps the {title} by folder ({folder}/): list each")
            names += [m for m in _all_modules() if m == folder or m.startswith(folder + ".")]
        found[tier] = (int(intro.group(1)), int(section.group(1)), names)
    return found


def _map_problems(text: str) -> list[str]:
    problems = []
    for tier, (intro, heading, names) in _mapped(text).items():
        modules = sorted(m for m in _all_modules() if _tier(m) == tier)
        if sorted(names) != modules:
            twice = sorted(n for n in set(names) if names.count(n) > 1)
            missing, extra = sorted(set(modules) - set(names)), sorted(set(names) - set(modules))
            problems.append(f"{tier}: missing {missing}, not modules {extra}, twice {twice}")
        if not intro == heading == len(modules):
            problems.append(f"{tier}: {len(modules)} modules, the page says {intro} and {heading}")
    cells = re.findall(r"^\| `[\w/]+(?:\.py|/)` \| (.*) \|$", text, re.M)
    long = [row[:60] for row in cells if len(row) > 240]
    return problems + [f"a cell over two sentences' length: {row}..." for row in long]


def test_the_architecture_map_lists_every_module_once_in_its_tier_with_true_counts():
    """Issue 58 point 4: architecture.md is a map, one row per module, a sentence or two each,
    and its module lists and counts are the tree's (a new, moved or removed module fails here)."""
    assert not _map_problems(ARCHITECTURE.read_text())


def test_negative_control_a_stale_map_is_caught():
    text = ARCHITECTURE.read_text()
    row = "| `_trace/ops.py` |"
    assert row in text
    gone = _map_problems(text.replace(row, "| `tp/_gone.py` |"))
    assert any("missing ['_trace.ops']" in p for p in gone)
    core = int(re.search(r"### The core \((\d+) modules\)", text)[1])
    miscounted = text.replace(f"({core} modules)", f"({core - 1} modules)", 1)
    assert any(f"{core} modules, the page says {core - 1}" in p for p in _map_problems(miscounted))
    line = next(line for line in text.splitlines() if line.startswith(row))
    assert any("two sentences" in p for p in _map_problems(text.replace(line, line[:-2] + " x" * 120 + " |")))
    # a folder row stands for its modules in the applications only
    with pytest.raises(AssertionError, match="list each"):
        _map_problems(text.replace(line, "| `_trace/` | the trace read |"))


# Outside linen/, the modules that import the Linen front end or flax.linen themselves, and why
# each needs it. Every other module outside linen/ reaches Linen only through one of these.
IMPORT_LINEN = {
    TOP: "fsdp_tp's namespace re-exports the Linen front end (shard_module_params, the layers)",
    "models.layout": "Layout wraps the Linen GPT's classes for FSDP (shard_module_params)",
    "models.transformer": "the GPT written in Linen",
    "models.llama": "the einsum Llama written in both APIs",
    "models.moe": "the MoE block and its LM written in both APIs",
    "hub.decoder": "the decoder a Hugging Face config describes, written in both APIs",
    "bench.baselines": "plain Flax baselines the library is measured against",
    "bench.figures": "reads the Linen workloads' nn.Partitioned boxes",
    "bench.variants": "the Linen model each benchmark variant shards",
    "bench.workloads": "Linen models the benchmark builds",
    "bench.llama_rows": "the Linen Llama laid out by shard_by_rules",
    "bench.precision_rows": "the Linen Llama's FSDP wire under each precision policy",
    "bench.moe_rows": "the Linen MoE LM laid out by shard_by_rules",
    "bench.auto_rows": "finds the Linen Llama's plan (fsdp_tp.linen.find_tp_rules)",
    "cli.fit": "fsdp-tp plan prints the Linen GPT's plan (fsdp_tp.linen.find_tp_rules)",
    "recipe.moe_lm": "fsdp-tp train --experts --api linen lays the Linen MoE LM out by rules",
    "hub.finetune": "fsdp-tp finetune --api linen lays the Linen decoder out by rules",
    "testing._front": "check_sharded lays a user's Linen model out (fsdp_tp.linen._testing)",
}


def test_outside_linen_only_the_modules_that_need_linen_import_it():
    """The modules outside ``linen/`` that import Linen (``fsdp_tp.linen`` or ``flax.linen``)
    are exactly IMPORT_LINEN, each with its reason: the NNX front end, the core and a new
    module reach Linen only by being listed here, with a reason a reviewer reads."""
    importers = {
        name
        for name in _all_modules()
        if not name.startswith("linen")
        for ours, others in [_imports(name)]
        if _linen(others) or any(m.startswith("linen") for m in ours)
    }
    assert importers == set(IMPORT_LINEN), (
        f"import Linen but not listed: {sorted(importers - set(IMPORT_LINEN))}; "
        f"listed but no longer import it: {sorted(set(IMPORT_LINEN) - importers)}"
    )


def test_negative_control_the_top_level_init_is_walked():
    # The package's own __init__ is read with its relative imports resolved: it imports the
    # Linen front end (so the set above could miss it if the walk skipped it).
    assert "linen" in _imports(TOP)[0] and "nnx" not in _imports(TOP)[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module: the modules it imports): each strongly connected
    set of two or more modules, sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def _import_graph() -> dict[str, set[str]]:
    """Each module's fsdp_tp imports at any level of its source (a function's late import too),
    less a package's own ``__init__`` reached from inside it (importing ``fsdp_tp.tp`` from
    ``fsdp_tp.tp._matmul`` names the package, which Python has begun loading first)."""
    graph = {}
    for name in _all_modules():
        ours, _ = _imports(name)
        parts = [] if name == TOP else name.split(".")
        packages = {".".join(parts[:k]) for k in range(len(parts))}  # ("": the package's own)
        graph[name] = {TOP if m == "" else m for m in ours if m != name and m not in packages}
    return graph


def test_the_package_s_imports_have_no_cycle():
    """Issue 58 point 3: tp/_rules -> tp.auto -> tp/_plan -> tp/_rules, and the two front ends'
    plan finders and checks, imported each other (late, inside functions): a module could not
    be read without the others. A module's imports, late ones included, form no cycle."""
    assert _cycles(_import_graph()) == []


def test_negative_control_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _literal_tensor_defaults(source: str) -> list[int]:
    """The lines of ``source`` whose function argument or class field defaults to the string
    ``"tensor"``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            defaults = [node.value]
        else:
            continue
        lines += [d.lineno for d in defaults if isinstance(d, ast.Constant) and d.value == "tensor"]
    return lines


def test_the_default_tensor_axis_is_one_constant():
    """Issue 58 point 3: twelve functions and fields defaulted to their own literal "tensor";
    each now names fsdp_tp._axes.TENSOR."""
    found = {
        name: lines
        for name in _all_modules()
        if (lines := _literal_tensor_defaults(_module_file(name).read_text()))
    }
    assert found == {}
    assert _literal_tensor_defaults('def f(axis="tensor"):\n    pass\n') == [1]  # (negative control)


def test_no_test_file_imports_another_s_private_names():
    """Issue 58 point 5: test files imported each other's private helpers (``_check_split``,
    ``_total``, ``_step_collectives``); what they share lives in ``tests/conftest.py`` and the
    helper modules, or is public in its file."""
    tests = Path(__file__).parent
    found = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                found += [
                    f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert found == []


# Issue 83 point 4 (issue 58's hard cap of 250 lines cut concepts and classes in two to fit):
# one concept a file; a module over 300 lines says why in its docstring, in a sentence that
# starts "Long because" (what it holds that is one concept and would be two halves split).
MOST_LINES = 300
WHY_LONG = "Long because"


def _length_problems(lengths: dict[str, int], docstrings: dict[str, str]) -> list[str]:
    """Each module over :data:`MOST_LINES` whose docstring does not say why."""
    return [
        f"{m}: {n} lines, over {MOST_LINES}, and its docstring has no '{WHY_LONG} ...': split it by "
        f"concept or say why it is one"
        for m, n in lengths.items()
        if n > MOST_LINES and WHY_LONG not in docstrings.get(m, "")
    ]


def _lengths() -> dict[str, int]:
    return {name: len(_module_file(name).read_text().splitlines()) for name in _all_modules()}


def _docstrings() -> dict[str, str]:
    parsed = {name: ast.parse(_module_file(name).read_text()) for name in _all_modules()}
    return {name: ast.get_docstring(tree) or "" for name, tree in parsed.items()}


def test_a_module_over_300_lines_says_why_in_its_docstring():
    assert not _length_problems(_lengths(), _docstrings())


def test_negative_control_a_long_module_without_its_reason_is_caught():
    lengths, docstrings = _lengths(), _docstrings()
    grown = {**lengths, "errors": MOST_LINES + 1, "plan": MOST_LINES + 2}
    said = {**docstrings, "plan": docstrings["plan"] + f"\n\n{WHY_LONG} the plan is one report."}
    assert [p.split(":")[0] for p in _length_problems(grown, said)] == ["errors"]
    assert _length_problems(lengths, docstrings) == []


# Issue 58 point 1: every context variable and class swap is named in architecture.md with why
# it must be ambient; a new one (or one removed) fails here until the page says so. Issue 83
# point 2: a module's class is set in one place (nnx/_swap.py), every swap a kind made there.
_CONTEXT_VAR = re.compile(r'(?:ContextVar|Ambient)\(\s*"(fsdp_tp_\w+)"')
_CLASS_SET = re.compile(r'"__class__"|\.__class__ =')
_SWAP_KIND = re.compile(r'^@Swap\.kind\("([\w ]+)"\)', re.M)
SWAP_HOME = "nnx/_swap.py"


def _ambient_in_source() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """``({(context variable, module file)}, {(class swap kind, module file)})`` of the package."""
    variables, swaps = set(), set()
    for name in _all_modules():
        file = _module_file(name)
        text, where = file.read_text(), file.relative_to(PACKAGE).as_posix()
        variables |= {(var, where) for var in _CONTEXT_VAR.findall(text)}
        swaps |= {(kind, where) for kind in _SWAP_KIND.findall(text)}
    return variables, swaps


def _ambient_on_page(text: str) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    section = text.split("## State no import shows", 1)[1].split("\n## ", 1)[0]
    variables = set(re.findall(r"^\| `(fsdp_tp_\w+)` \| `([\w/]+\.py)` \|", section, re.M))
    swaps = set(re.findall(r"^\| ([a-z][a-z ]+) \| `([\w/]+\.py)` \|", section, re.M))
    return variables, swaps


def _classes_set_outside_swap() -> list[str]:
    """Modules other than nnx/_swap.py that set an object's ``__class__``."""
    found = []
    for name in _all_modules():
        file = _module_file(name)
        where = file.relative_to(PACKAGE).as_posix()
        if where != SWAP_HOME and _CLASS_SET.search(file.read_text()):
            found.append(where)
    return found


def test_a_class_is_swapped_in_one_place_by_a_kind_of_swap():
    assert _classes_set_outside_swap() == []
    assert len(_CLASS_SET.findall((PACKAGE / SWAP_HOME).read_text())) == 1
    # (negative control) a swap written by hand elsewhere is seen
    assert _CLASS_SET.search('object.__setattr__(node, "__class__", cls)')


def test_every_context_variable_and_class_swap_is_on_the_architecture_page():
    assert _ambient_on_page(ARCHITECTURE.read_text()) == _ambient_in_source()


def _records() -> dict[str, tuple[str, ...]]:
    """``{context variable: the fields of its record}`` of every ``Ambient`` in the package."""
    import importlib

    from fsdp_tp._context import Ambient

    found = {}
    for name in _all_modules():
        if name in (TOP, "__main__"):
            continue
        for value in vars(importlib.import_module(f"fsdp_tp.{name}")).values():
            if isinstance(value, Ambient):
                found[value.name] = tuple(f.name for f in dataclasses.fields(value.get()))
    return found


def _fields_unnamed(text: str, records: dict[str, tuple[str, ...]]) -> list[str]:
    rows = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("| `fsdp_tp_")}
    return [
        f"{var}.{f}" for var, fields in records.items() for f in fields if f"`{f}`" not in rows.get(var, "")
    ]


def test_the_ambient_state_is_at_most_four_records_each_field_on_the_page():
    """Issue 83 point 2: 14 context variables became typed records, at most 4, every one a row
    of architecture.md naming each of its fields (with why it cannot be an argument)."""
    variables, _ = _ambient_in_source()
    records = _records()
    assert len(variables) <= 4 and set(records) == {var for var, _ in variables}, (variables, records)
    assert _fields_unnamed(ARCHITECTURE.read_text(), records) == []
    # (negative control) a field the page leaves out is seen
    text = ARCHITECTURE.read_text().replace("`keys_as_stored`", "keys as stored")
    assert _fields_unnamed(text, records) == ["fsdp_tp_step.keys_as_stored"]


def test_negative_control_an_unlisted_context_variable_is_caught():
    text = ARCHITECTURE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `fsdp_tp_step` |"))
    assert _ambient_on_page(text.replace(row + "\n", "")) != _ambient_in_source()
    swaps = _ambient_on_page(text.replace("| role | `nnx/_layers.py` |", "| role | `nnx/_tp.py` |"))[1]
    assert swaps != _ambient_in_source()[1]


# Issue 58 point 5: what several test files share lives in tests/conftest.py and the tests/
# helper modules (models, rules, the equivalence harness); no test file imports another.
TESTS = Path(__file__).parent


def _test_files_imported(source: str) -> list[str]:
    tree = ast.parse(source)
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [
        f"{n.module}.{a.name}" if n.module == "tests" else n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module
        for a in n.names
    ]
    return sorted({m for m in names if re.match(r"tests\.test_\w+", m)})


def test_no_test_file_imports_another():
    found = {f.name: i for f in TESTS.glob("test_*.py") if (i := _test_files_imported(f.read_text()))}
    assert not found


def test_negative_control_a_test_file_importing_another_is_caught():
    assert _test_files_imported("from tests import test_tp_rules as t\n") == ["tests.test_tp_rules"]
    assert _test_files_imported("from tests.test_einsum_tp import first_block\n") == ["tests.test_einsum_tp"]


# Issue 58 point 3: a role runs one way. Every front end (the rules of Linen and NNX, the
# experts, Linen's own Megatron layers) enters a role through TPRole.around, and a role's call
# takes exactly the base class's arguments (0.2's ColumnParallel.call(prepared=) did not).
def _role_calls(source: str, where: str) -> list[str]:
    """``where:line`` of each ``<x>.call(method, run, layer, args, kwargs)`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if is_call and node.func.attr == "call" and len(node.args) >= 5:  # (the role's signature)
            found.append(f"{where}:{node.lineno}")
    return found


def test_every_front_end_runs_a_role_through_around():
    found = []
    for name in _all_modules():
        file = _module_file(name)
        found += _role_calls(file.read_text(), file.relative_to(PACKAGE).as_posix())
    lines, first = inspect.getsourcelines(TPRole.around)
    (around,) = [first + i for i, line in enumerate(lines) if ".call(" in line]
    assert found == [f"tp/_role.py:{around}"]
    # (negative control) a layer calling its role's call directly is seen
    assert _role_calls('role.call("__call__", run, layer, (x,), {})\n', "m") == ["m:1"]


# Issue 58 point 1: the seam. A module a rule names computes through tp/_front.compute (its local
# sizes for the axis, the front end's method on them, the role around it), which each front end
# reaches through its adapter of the FrontEnd protocol; no front end sizes a role's call itself.
# The roles call a part's local (ExpertParallel's within), and Linen's own attention layer, which
# is the layer itself and no front end's module, reads its kept blocks off its role's local.
_SIZES_THEMSELVES = {"tp/_front.py", "tp/_experts.py", "linen/layers/attention.py"}


def _local_sizes(source: str, where: str) -> list[str]:
    """``where:line`` of each ``<x>.local(layer, size)`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if is_call and node.func.attr == "local" and len(node.args) == 2:
            found.append(f"{where}:{node.lineno}")
    return found


def test_both_front_ends_compute_a_named_module_through_the_seam():
    from fsdp_tp.linen._local_compute import LinenFront, Seen
    from fsdp_tp.nnx._layers import NNXFront
    from fsdp_tp.tp._front import FrontEnd
    from fsdp_tp.tp._role_plan import RolePlan
    from fsdp_tp.tp._rules import compile_tp_rules

    plan = RolePlan(compile_tp_rules([], "test"), LinenFront.kinds)
    assert isinstance(NNXFront(object), FrontEnd) and isinstance(LinenFront(Seen(plan)), FrontEnd)
    found = set()
    for name in _all_modules():
        file = _module_file(name)
        where = file.relative_to(PACKAGE).as_posix()
        found |= {hit.split(":")[0] for hit in _local_sizes(file.read_text(), where)}
    assert found == _SIZES_THEMSELVES
    # (negative controls) a front end sizing a role's call itself is seen; an adapter without
    # with_local is no FrontEnd
    assert _local_sizes("local = role.local(layer, jax.lax.axis_size(role.axis))\n", "m") == ["m:1"]
    assert not isinstance(type("Half", (), {"kinds": None, "layer_of": lambda self: 0})(), FrontEnd)


def _call_arguments(role: type) -> list[str]:
    return list(inspect.signature(role.call).parameters)


def test_no_role_s_call_takes_an_argument_the_base_class_lacks():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    assert fsdp_tp.linen and fsdp_tp.nnx  # (imported: every role class is defined)
    odd = {c.__name__: a for c in subclasses(TPRole) if (a := _call_arguments(c)) != _call_arguments(TPRole)}
    assert odd == {}
    # (negative control) a call with a flag of its own is seen
    flagged = type("Flagged", (TPRole,), {"call": lambda self, m, run, layer, args, kw, prepared=False: 0})
    assert _call_arguments(flagged) != _call_arguments(TPRole)


# Issue 83 point 1: the plan check of a call is driven once, in the core (_check.check_call):
# a front end (Linen's rules, NNX's, the Linen Megatron layers' at init) traces and names for it
# (a PlanCall) and runs none of its steps itself.
_DRIVER_STEPS = ("check_plan", "raise_failure", "references_for")


def _driver_steps(source: str, where: str, steps: tuple[str, ...] = _DRIVER_STEPS) -> list[str]:
    """``where:line`` of each call of one of ``steps`` (a driver's) in ``source``."""
    return [
        f"{where}:{node.lineno}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in steps
    ]


def test_the_plan_check_is_driven_once_for_both_front_ends():
    from fsdp_tp._check import driver as _check
    from fsdp_tp.linen import _check as linen_check
    from fsdp_tp.linen import _layers_check
    from fsdp_tp.nnx import _check as nnx_check

    assert linen_check.drive is nnx_check.drive is _layers_check.drive is _check.check_call
    found = set()
    for name in _all_modules():
        file = _module_file(name)
        where = file.relative_to(PACKAGE).as_posix()
        found |= {hit.split(":")[0] for hit in _driver_steps(file.read_text(), where)}
    assert found == {"_check/driver.py"}
    # (negative control) a front end running the check's steps itself is seen
    assert _driver_steps("check_plan(local, references, sizes, where, named)\n", "m") == ["m:1"]


# Issue 83 point 1: the plan finder is driven once, in the core (tp/_find.find): the front ends'
# find_tp_rules and tp_rules="auto" trace the call and initialize it under a plan (a FindCall);
# none sizes, fits or meshes a plan itself.
_FINDER_STEPS = ("fitted", "require_size")


def test_the_plan_finder_is_driven_once_for_both_front_ends():
    from fsdp_tp.linen import _auto as linen_auto
    from fsdp_tp.linen import auto_rules
    from fsdp_tp.nnx import _auto as nnx_auto
    from fsdp_tp.nnx import _specs
    from fsdp_tp.tp._find import driver as _find

    assert linen_auto.find is auto_rules.find is nnx_auto.find is _specs.find is _find.find
    found = set()
    for name in _all_modules():
        file = _module_file(name)
        where = file.relative_to(PACKAGE).as_posix()
        found |= {hit.split(":")[0] for hit in _driver_steps(file.read_text(), where, _FINDER_STEPS)}
    assert found == {"tp/_find/driver.py"}
    # (negative control) a front end fitting a plan itself is seen
    assert _driver_steps("plan = fitted(plan, attempt)\n", "m", _FINDER_STEPS) == ["m:1"]


def _calls(source: str, name: str) -> list[int]:
    """The lines of ``source`` that call the function ``name``."""
    tree = ast.parse(inspect.cleandoc(source) if source.startswith(" ") else source)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == name]


def test_linen_auto_tries_a_plan_on_its_own_transform_not_through_the_verb_again():
    """Issue 83 point 1: ``tp_rules="auto"`` checks a plan it found by the transform it is
    (``RulesTransform.with_roles``), not by calling ``shard_by_rules`` again from inside it."""
    from fsdp_tp.linen import _auto, rule_transform

    for module in (rule_transform.RulesTransform, _auto):
        assert not _calls(inspect.getsource(module), "shard_by_rules"), module
    # (negative control) 0.2's remake is seen
    assert _calls("remake = lambda tp: shard_by_rules(target, rules, tp_rules=tp)\n", "shard_by_rules") == [1]


def test_the_architecture_page_is_short():
    """Issue 83 point 6: the map a maintainer reads first is at most 3,000 words (6,639 before)."""
    words = len(ARCHITECTURE.read_text().split())
    assert words <= 3000, f"docs/architecture.md is {words} words: shorten rows, not the map's coverage"


# Issue 98: rooms by concept. The check (_check/) stands above the tensor plan (tp/) and the
# sequence split (context/); tp/ is the tensor plan alone; the traced program and its reading
# (_trace/) stand on the foundations alone; no room imports one that imports it back.
_FOUNDATIONS = frozenset({"_tree", "_types", "_layout"})


def _room(module: str) -> str:
    return module.split(".")[0]


def _floor_problems(imports: dict[str, set[str]]) -> list[str]:
    """Each edge of ``imports`` that leaves its room's floor, with why."""
    problems = []
    for m, ours in imports.items():
        for i in ours:
            if _room(m) == "tp" and _room(i) in ("_check", "context"):
                problems.append(f"{m} imports {i}: tp/ holds the tensor plan alone")
            if _room(m) == "_trace" and _room(i) != "_trace" and i not in _FOUNDATIONS:
                problems.append(f"{m} imports {i}: _trace/ stands on {sorted(_FOUNDATIONS)} alone")
    return sorted(problems)


def _rooms(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms (a top-level module or package) and the arrows between them."""
    rooms: dict[str, set[str]] = {}
    for m, ours in imports.items():
        rooms.setdefault(_room(m), set()).update(_room(i) for i in ours if _room(i) != _room(m))
    return rooms


def test_the_tensor_plan_and_the_trace_keep_to_their_floors():
    assert _floor_problems(_import_graph()) == []
    # (negative controls) tp reaching up into the check, the trace reading into a role
    wrong = {"tp._role": {"_check.driver", "_trace.graph"}, "_trace.graph": {"tp._role", "_tree"}}
    assert _floor_problems(wrong) == [
        "_trace.graph imports tp._role: _trace/ stands on ['_layout', '_tree', '_types'] alone",
        "tp._role imports _check.driver: tp/ holds the tensor plan alone",
    ]


def test_no_room_imports_a_room_that_imports_it_back():
    """Issue 98: dropout/ imported context/, which imported dropout/ (the split's layout now
    stands beside _layout, in _sequence_split.py, under both)."""
    assert _cycles(_rooms(_import_graph())) == []
    # (negative control) the arrow that ran back up
    assert _cycles(_rooms({"dropout._block_key": {"context._split"}, "context._dropout": {"dropout.x"}})) == [
        ["context", "dropout"]
    ]


def _private_names(module: str) -> list[str]:
    """The private names (``_x``, not a module) ``module`` imports from another module."""
    path = _module_file(module)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__" or not node.level:
            continue
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        source = base.joinpath(*(node.module or "").split("."))
        for alias in node.names:
            name = alias.name
            is_module = (source / f"{name}.py").exists() or (source / name / "__init__.py").exists()
            if name.startswith("_") and not name.startswith("__") and not is_module:
                found.append(f"{module} imports {name} from {'.' * node.level}{node.module or ''}")
    return found


def test_no_module_imports_another_s_private_name():
    """Issue 98 point 6: a name another module uses is not private (testing/_programs.py took
    sharded_init._programs; context/_all_to_all.py two of _ring's; nnx/_model.py a constant)."""
    assert [p for m in _all_modules() for p in _private_names(m)] == []


def test_negative_control_a_private_name_imported_is_seen(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("from .b import _hidden, visible\nfrom . import _c\n")
    (tmp_path / "_c.py").write_text("")
    monkeypatch.setitem(globals(), "_module_file", lambda module: tmp_path / f"{module}.py")
    assert _private_names("a") == ["a imports _hidden from .b"]


# Issue 83's proof: linen/ and nnx/ reach tp's insides only through the seam (tp/_front.py: what a
# front end does for the core and what it is given) and the drivers (the check's, its plain calls',
# the finder's); tp's other private modules move without touching a front end (49 edges into 11 of
# them before, at 7f40e28).
_DOORS_INTO_TP = frozenset({"tp._front", "_check.driver", "_check.plain", "tp._find.driver"})


def _side_doors(imports: dict[str, set[str]]) -> list[str]:
    """Each ``module imports tp-private`` (or check-private) edge of ``imports`` that is not a
    door: the front ends reach ``tp`` and ``_check`` through their drivers."""
    behind_tp = lambda m: m.startswith("tp.") and any(part.startswith("_") for part in m.split("."))
    private = lambda m: behind_tp(m) or m.startswith("_check.")
    return sorted(
        f"{m} imports {i}"
        for m, ours in imports.items()
        for i in ours
        if private(i) and i not in _DOORS_INTO_TP
    )


def test_the_front_ends_reach_tp_through_its_package_the_seam_and_the_drivers():
    fronts = {m: _imports(m)[0] for m in _all_modules() if _tier(m) == "front end"}
    assert _side_doors(fronts) == [], "import it from fsdp_tp.tp._front (add it to the seam's __all__)"
    # (negative control) a front end importing a tp module behind the seam is seen
    assert _side_doors({"linen.x": {"tp._rules", "tp._front", "tp"}}) == ["linen.x imports tp._rules"]
    assert _side_doors({"nnx.x": {"_check.blocks", "_check.driver"}}) == ["nnx.x imports _check.blocks"]


def test_the_seam_gives_what_it_names():
    from fsdp_tp.tp import _front

    missing = [name for name in _front.__all__ if not hasattr(_front, name)]
    assert missing == []

"""The finding of ``tp_rules="auto"``: :func:`find_plan`, a model's Megatron plan from its traced
forward (:class:`~fsdp_tp._trace.graph.Graph`) and its layers. Each split a matmul's parameter
could take (a kernel's output features or heads, an embedding's rows) grows a region
(:func:`~fsdp_tp.tp._find.regions.grow`); a region is taken when every parameter it splits is
one a role splits, on the dim that role splits; a layer no region takes is left whole, with the
reason. :mod:`fsdp_tp.tp.auto` is its public face, with an example.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..._axes import TENSOR
from ..._trace.graph import Graph, kernel_operand, kernels_of
from ...errors import IndivisibleShapeError, RuleError
from .._einsum import Equation
from .._experts import EXPERT, ExpertParallel
from .._roles import ColumnParallel, HeadParallel, Layer, Region, RowParallel, TPRole, VocabParallel
from .experts import expert_roles, raw_banks, with_within
from .plan import RAW, RAW_FIX, TPPlan, ancestors, rules_for
from .regions import Refused, grow

__all__ = ["find_plan"]


def find_plan(
    graph: Graph,
    layers: Mapping[str, Layer],
    axis: str | None = TENSOR,
    size: int | None = None,
    outputs_split: bool = False,
    expert_axis: str = EXPERT,
    expert_size: int | None = None,
) -> TPPlan:
    """The plan of the traced model ``graph`` whose role-computable modules are ``layers``
    (``{path: Layer}``, as the front end sees them). ``size``: the ``axis`` size the plan is
    for (each role's sizes must divide it; ``None``: not checked). ``outputs_split``: the
    model's outputs may leave split on their last dim (logits for
    :func:`~fsdp_tp.vocab_parallel_cross_entropy`); else a column layer whose result is
    the output gathers it. ``expert_size``: a mixture's expert layers go on ``expert_axis``
    of that size (:class:`~fsdp_tp.tp.ExpertParallel`,
    :func:`~fsdp_tp.tp._find.experts.expert_banks`); ``None``: experts are einsums like any
    other. No tensor split (the experts alone) where ``axis`` is ``None``, or where an expert
    size is given and no tensor ``size``."""
    kernels = kernels_of(graph)
    taken: set[str] = set()
    roles: dict[str, TPRole] = {}
    regions: list[tuple[str, ...]] = []
    reasons: dict[str, str] = {}
    banks: dict[str, ExpertParallel] = {}
    if expert_size is not None:
        banks = expert_roles(graph, layers, expert_axis, expert_size, reasons)
        banks |= raw_banks(graph, layers, expert_axis, expert_size, reasons)
        regions += [tuple(banks)] if banks else []
        axis = axis if size is not None else None
        if axis is None:  # (else each expert's hidden dim may go over the tensor axis within)
            taken |= {p for p in graph.params.values() if p.rpartition("/")[0] in banks}
    tensor = axis if axis is not None else TENSOR  # (no seeds without a tensor axis: unused)
    for value, dim in _seeds(graph, kernels) if axis is not None else ():
        param = graph.params[kernels[value]]
        if param in taken:
            continue
        owner = _owner(param.rpartition("/")[0], layers)
        try:
            region = grow(graph, kernels, (value, dim), outputs_split, size)
            split = region.params(graph)
            found = _roles(graph, split, region.output, layers, tensor, size, outputs_split)
        except Refused as why:
            where = f"{param} split on dim {dim - len(graph.shapes[value])}"
            reasons.setdefault(owner, f"{where}: {why}")
            continue
        roles |= found
        regions.append(tuple(found))
        taken |= set(split)
    roles |= {path: with_within(bank, roles.get(path)) for path, bank in banks.items()}
    roles, regions = _outside_rerun_calls(roles, regions, banks, reasons)
    first = _first_reads(graph, kernels)
    roles = dict(sorted(roles.items(), key=lambda item: first.get(item[0], len(graph.nodes))))
    otherwise = "no matmul reads its parameters" if axis is not None else "the mesh has no tensor axis"
    left = tuple((p, reasons.get(p, otherwise)) for p in layers if _leaf(p, roles, layers))
    left += _raw_modules(graph, kernels, layers, roles, reasons)
    paths = [*layers, *(path for path in roles if path not in layers)]  # (modules of raw kernels)
    return TPPlan(rules_for(roles, paths), roles, left, tuple(paths), tuple(regions))


def _raw_modules(
    graph: Graph,
    kernels: dict[int, int],
    layers: Mapping[str, Layer],
    roles: Mapping[str, TPRole],
    reasons: Mapping[str, str],
) -> tuple[tuple[str, str], ...]:
    """``(module, why)`` for each module whose own code reads raw parameters through a matmul
    or a lookup (an MoE block's ``(E, d, h)`` experts) that the plan gives no :class:`Region`:
    it is left whole, on every device, and the plan says so (``reasons``: why a split tried there
    was refused)."""
    read: dict[str, dict[str, None]] = {}
    for node in (n for n in graph.nodes if n.prim in ("dot_general", "conv_general_dilated", "gather")):
        for value in node.ins[:1] if node.prim == "gather" else node.ins:  # (a lookup's table)
            if value in kernels:
                module, _, name = graph.params[kernels[value]].rpartition("/")
                if not module or not any(p in layers or p in roles for p in ancestors(module)):
                    read.setdefault(module, {})[name] = None
    # (where a Region's split was tried and refused, why; else why none could be)
    why = lambda module: (
        f"and no role splits it so: {reasons[module]}"
        if module in reasons
        else f"which no role computes: {RAW_FIX}"
    )
    return tuple(
        (module or "the model", f"{RAW} ({', '.join(names)}), {why(module)}")
        for module, names in read.items()
    )


def _seeds(graph: Graph, kernels: dict[int, int]):
    """``(kernel value, dim)``: each dim of a parameter read by a matmul that its result
    keeps (a column layer's split), and each looked-up dim of a table, in the model's order."""
    for node in graph.nodes:
        if node.prim in ("dot_general", "conv_general_dilated"):
            if (kernel := kernel_operand(node, kernels)) is None:
                continue
            x = node.ins[0] if kernel == node.ins[1] else node.ins[1]
            for group in node.same:
                members = dict(group)
                if kernel in members and node.outs[0] in members and x not in members:
                    yield kernel, members[kernel]
        elif node.prim == "gather" and node.ins[0] in kernels:
            for dim in node.params["looked_up"]:
                yield node.ins[0], dim


def _first_reads(graph: Graph, kernels: dict[int, int]) -> dict[str, int]:
    """``{module: the first matmul or lookup reading one of its parameters}``: the model's order."""
    first: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        if node.prim in ("dot_general", "conv_general_dilated", "gather"):
            for value in node.ins:
                if value in kernels:
                    for module in ancestors(graph.params[kernels[value]].rpartition("/")[0]):
                        first.setdefault(module, index)
    return first


def _owner(module: str, layers: Mapping[str, Layer]) -> str:
    """The module a parameter's split belongs to: its own, or the attention it is part of."""
    attention = (p for p in ancestors(module)[:-1] if p in layers and layers[p].kind == "attention")
    return next(attention, module)


def _outside_rerun_calls(
    roles: dict[str, TPRole], regions: list[tuple[str, ...]], banks: Mapping[str, TPRole], reasons: dict
) -> tuple[dict[str, TPRole], list[tuple[str, ...]]]:
    """``roles`` and ``regions`` less each region with a module inside a bank whose role re-runs
    its call as written (``ExpertParallel(dims=...)``: the module's operations run again on a
    device's values, so a role of a submodule inside it would never run, and a rule naming it
    would match nothing); those modules left whole, each with why (``reasons``)."""
    rerun = [path for path, bank in banks.items() if bank.runs_call_again()]
    inside = lambda path: next((bank for bank in rerun if path.startswith(bank + "/")), None)
    dropped = {path for region in regions if any(map(inside, region)) for path in region}
    hit = ", ".join(sorted({bank for path in dropped if (bank := inside(path))}))
    for path in sorted(dropped):
        bank = inside(path)
        reasons[path] = (
            f"inside {bank}, whose ExpertParallel(dims=...) runs its call again operation by operation "
            f"(a role inside it would not run)"
            if bank is not None
            else f"split with modules inside {hit}, whose ExpertParallel(dims=...) runs its call again"
        )
    kept = {path: role for path, role in roles.items() if path not in dropped}
    return kept, [region for region in regions if not dropped.intersection(region)]


def _leaf(path: str, roles: Mapping[str, TPRole], layers: Mapping[str, Layer]) -> bool:
    """A layer the plan leaves whole (not a projection inside an attention: that is named)."""
    return path not in roles and _owner(path, layers) == path


def _roles(
    graph: Graph, split: dict[str, int], output: bool, layers, axis: str, size, outputs_split: bool
) -> dict[str, TPRole]:
    """Each module a region splits (``split``: its parameters' dims; ``output``: it reaches the
    model's output), with the role that splits it so (or :class:`Refused`)."""
    by_owner: dict[str, dict[str, int]] = {}
    for param, dim in split.items():
        owner = _owner(param.rpartition("/")[0], layers)
        by_owner.setdefault(owner, {})[param[len(owner) + 1 :]] = dim
    if raw := [owner for owner in by_owner if owner not in layers]:
        return _region(graph, by_owner, raw[0], output, axis, size, outputs_split)
    gather = output and not outputs_split
    names = set(graph.params.values())
    found = {}
    for owner, splits in by_owner.items():
        held = {p[len(owner) + 1 :] for p in names if p.startswith(f"{owner}/")}
        found[owner] = _role_for(owner, layers, splits, held, gather, axis, size)
    return found


def _region(
    graph: Graph,
    by_owner: dict[str, dict[str, int]],
    owner: str,
    output: bool,
    axis: str,
    size,
    outputs_split: bool,
) -> dict[str, TPRole]:
    """A region of one module's raw kernels, begun and summed inside its own code (a one-module
    SwiGLU, raw-kernel attention): :class:`Region`, each kernel on the region's dim; one that
    reaches the model's output unsummed (a raw head) gathers it (``gather_output``). A region
    that also splits another module's parameters, or would leave the output split
    (``outputs_split``: no role leaves a Region's so), has no role that computes it
    (:class:`Refused`)."""
    splits = by_owner[owner]
    if len(by_owner) > 1 or not owner or (output and outputs_split):
        param = f"{owner}/{next(iter(splits))}" if owner else next(iter(splits))
        if len(by_owner) == 1 and owner:  # (outputs_split: a Region gathers what it leaves split)
            raise Refused(
                f"it would split {param} and leave the model's output split (outputs_split=True), "
                f"and {owner} computes no tensor-parallel role but Region, which gathers its output"
            )
        raise Refused(
            f"it would split {param}, and {owner or 'the model'} computes no tensor-parallel role but "
            f"Region, whose split begins and is summed inside the module (its split spans modules)"
        )
    if size is not None:
        values = {path: value for value, path in graph.params.items()}
        for name, dim in splits.items():
            if (n := graph.shapes[values[f"{owner}/{name}"]][dim]) % size:
                raise Refused(f"{owner}/{name} dim {dim} has {n}, which {axis!r} of {size} does not divide")
    return {owner: Region(axis, dims=splits, gather_output=output)}


def _role_for(
    owner: str, layers, splits: dict[str, int], held: set[str], gather: bool, axis: str, size
) -> TPRole:
    layer = layers[owner]
    refused = []

    def splits_so(role: TPRole) -> bool:
        try:
            wanted = _splits(role, owner, layer, layers)
        except RuleError:
            return False
        return {k: v for k, v in wanted.items() if k in held} == splits

    for role in _candidates(layer, gather, axis):
        plain = splits_so(role)
        # kv heads kept whole: where the plain role's split does not divide (an einsum's kept
        # letter), or where the region splits as the kept role does (query heads only)
        for fitted in (role, *_kept(role, layer)):
            if not (plain or (fitted is not role and splits_so(fitted))):
                continue
            try:
                if size is not None:
                    fitted.require_divides(layer, size, owner, lambda _: "")
                return fitted
            except IndivisibleShapeError as err:
                refused.append(str(err).split(";")[0])
    what = ", ".join(f"{k} on dim {v}" for k, v in splits.items())
    raise Refused(refused[0] if refused else f"it would split {owner}'s {what}, which no role splits so")


def _candidates(layer: Layer, gather: bool, axis: str) -> list[TPRole]:
    if layer.kind in ("dense", "conv"):
        return [ColumnParallel(axis, gather_output=gather), RowParallel(axis)]
    if layer.kind == "einsum":
        letters = [None, *Equation.parse(layer.equation, layer.path).kernel]
        return [ColumnParallel(axis, gather_output=gather, letter=c) for c in letters] + [
            RowParallel(axis, letter=c) for c in letters
        ]
    if layer.kind == "attention":
        return [HeadParallel(axis)]
    return [VocabParallel(axis)]


def _kept(role: TPRole, layer: Layer) -> list[TPRole]:
    """The role with kv heads kept whole: for an axis larger than they are."""
    if isinstance(role, HeadParallel) and layer.num_kv_heads:
        return [dataclasses.replace(role, replicated_kv=True)]
    if isinstance(role, ColumnParallel) and layer.kind == "einsum" and not role.gather_output:
        return [dataclasses.replace(role, replicated=True)]
    return []


def _splits(role: TPRole, owner: str, layer: Layer, layers) -> dict[str, int]:
    """What ``role`` splits, its own children's roles included (attention's output)."""
    splits = dict(role.splits(layer))
    for child, inner in role.inner().items():
        if (sub := layers.get(f"{owner}/{child}")) is not None:
            splits |= {f"{child}/{k}": v for k, v in inner.splits(sub).items()}
    return splits

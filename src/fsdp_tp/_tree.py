"""Small tree utilities every tier shares: paths, module paths, shardings, tree differences.

Framework-free (no ``flax.linen``): the core and both front ends import them from here.

>>> import jax
>>> from jax.sharding import PartitionSpec as P
>>> path_of(jax.tree_util.tree_leaves_with_path({"a": {"b": [0]}})[0][0])
'a/b/0'
>>> module_path(("Block_0", "mlp"), "Dense_1")
'Block_0/mlp/Dense_1'
>>> first_difference({"w": 0, "b": {"x": 1}}, {"w": 0, "b": {"y": 1}})
"at 'b': expected a dict with keys ['x'], got a dict with keys ['y']"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ._types import PyTree

__all__ = ["first_difference", "module_path", "named_shardings", "path_of", "static_split"]


def path_of(key_path) -> str:
    """``"a/b/kernel"`` from a JAX key path (dict keys, attributes, indices)."""
    return jax.tree_util.keystr(tuple(key_path), simple=True, separator="/")


def module_path(parent: Sequence[str], *names: str) -> str:
    """A submodule's or parameter's path, ``/``-joined, as rules match it: the one spelling
    of "where in the model" for every front end."""
    return "/".join(str(part) for part in (*parent, *names) if part != "")


def named_shardings(specs: PyTree, mesh) -> PyTree:
    """``NamedSharding(mesh, spec)`` for every spec: the ``out_shardings`` of ``jax.jit``.

    >>> from jax.sharding import PartitionSpec as P
    >>> from fsdp_tp import make_mesh
    >>> named_shardings({"w": P("fsdp")}, make_mesh({"fsdp": 8}))["w"].spec
    P('fsdp',)
    """
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def _children(x, leaf: bool = False) -> tuple[list[str], list, object] | None:
    """``x``'s own level: its children's keys, the children and its node; ``None`` where
    ``x`` is a leaf (or ``leaf`` says to take it as one)."""
    pairs, node = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x or leaf)
    if len(pairs) == 1 and pairs[0][1] is x:
        return None
    return [path_of(key) for key, _ in pairs], [child for _, child in pairs], node


def _node(tree) -> str:
    """One node of a tree in a few words (never its whole structure)."""
    if isinstance(tree, dict):
        return f"a dict with keys {sorted(map(str, tree))}"
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return f"a {type(tree).__name__} of {len(tree)}"
    return "a leaf" if _children(tree) is None else f"a {type(tree).__name__}"


def first_difference(expected: PyTree, got: PyTree, is_leaf=None, prefix: bool = False) -> str | None:
    """Where two trees first differ in structure, in one line: the path and the two nodes;
    ``None`` where they have the same structure. For errors: never a whole ``PyTreeDef``.
    ``prefix=True``: a leaf of ``expected`` stands for any subtree of ``got`` (a spec tree)."""

    def walk(a, b, path: tuple) -> str | None:
        kids_a = _children(a, is_leaf is not None and is_leaf(a))
        if prefix and kids_a is None:
            return None
        kids_b = _children(b, is_leaf is not None and is_leaf(b))
        if kids_a is None and kids_b is None:
            return None
        if kids_a is None or kids_b is None or kids_a[2] != kids_b[2]:
            where = repr("/".join(path)) if path else "the top"
            return f"at {where}: expected {_node(a)}, got {_node(b)}"
        for key, child_a, child_b in zip(kids_a[0], kids_a[1], kids_b[1], strict=True):
            if found := walk(child_a, child_b, (*path, key)):
                return found
        return None

    return walk(expected, got, ())


def static_split(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple[tuple, dict]]]:
    """The call's array leaves (what a trace takes as inputs) and how to rebuild the call from
    them; every other leaf (``train=True``) stays a Python value, as the model reads it.

    >>> arrays, rebuild = static_split((jax.numpy.ones(2),), {"train": True})
    >>> len(arrays), rebuild([jax.numpy.zeros(2)])[1]
    (1, {'train': True})
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]

    def rebuild(values: list) -> tuple[tuple, dict]:
        filled = list(leaves)
        for i, value in zip(arrays, values, strict=True):
            filled[i] = value
        return jax.tree.unflatten(treedef, filled)

    return [leaves[i] for i in arrays], rebuild

"""Where an operation of a traced model comes from: the line of the user's source that made it
(:class:`Site`, read off the jaxpr equation's traceback), whether the library made it (a role's
collective, an FSDP gather: :func:`is_library`), and which operations of two traces of the same
model are the same line's (:func:`pair`), so a device's trace can be read against the unsharded
model's.

Two traces of one model's call (one device's under a plan, the unsharded model's) run the same
code: each operation the model's code makes (its own lines, flax's layers) appears in both, in
the same order, with the same primitive and source line; the library adds its own around them.
The n-th operation of a line, primitive and module (the name stack it was made under) in one
trace is the n-th in the other.

>>> import jax, jax.numpy as jnp
>>> from fsdp_tp._trace.graph import Graph
>>> graph = Graph.trace(lambda p, x: jnp.tanh(x @ p), jnp.ones((4, 8)), jnp.ones((2, 4)))
>>> site = site_of(graph.nodes[1].source)
>>> graph.nodes[1].prim, site.function, is_library(graph.nodes[1])
('tanh', '<lambda>', False)
>>> pair(graph, graph)
{0: 0, 1: 1}
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import sysconfig
import types
from collections import defaultdict

import flax
import jax
import jaxlib
import opt_einsum

from .graph import Graph
from .relations import Node

__all__ = [
    "Site",
    "calling_site",
    "flax_file",
    "is_library",
    "made_by_jax",
    "module_of",
    "pair",
    "scope_of",
    "site_of",
    "site_of_file",
    "source_of",
    "user_site",
    "users_file",
]

# The fsdp_tp package's folder, read off the package (not off this file's depth in it).
_HERE = os.path.dirname(os.path.abspath(str(sys.modules[__name__.split(".")[0]].__file__)))
# Frames of JAX itself, of the packages JAX calls into (opt_einsum plans jnp.einsum's
# contractions, jaxlib) and of Python's standard library are how an operation was made, not where.
_SKIPPED = (
    *(
        os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep
        for module in (jax, opt_einsum, jaxlib)
    ),
    sysconfig.get_paths()["stdlib"] + os.sep,
)
# The library's own models compute as a user's model does; everything else of it distributes.
_MODEL_CODE = (os.path.join(_HERE, "models") + os.sep, os.path.join(_HERE, "attention.py"))
_FLAX = os.path.dirname(os.path.abspath(flax.__file__)) + os.sep
# Operations that only retype a value for JAX's replication check (no-ops on the numbers),
# which JAX inserts at the line of the operation they feed.
_RETYPES = frozenset({"pvary", "pcast"})


@dataclasses.dataclass(frozen=True)
class Site:
    """A line of source: the innermost frame of an operation's traceback outside JAX."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line} ({self.function})"

    @property
    def library(self) -> bool:
        """Made by the library's distributing code (not its models, which compute as a user's)."""
        return self.file.startswith(_HERE + os.sep) and not self.file.startswith(_MODEL_CODE)


def site_of(source) -> Site | None:
    """The :class:`Site` of an equation's ``source_info`` (``None``: no traceback, or JAX's own)."""
    traceback = getattr(source, "traceback", None)
    return None if traceback is None else _site(traceback)


@functools.lru_cache(maxsize=1 << 14)  # (each node's is asked for several times, its callers' too)
def _site(traceback) -> Site | None:
    for frame in traceback.frames:  # innermost first
        if not made_by_jax(frame.file_name):
            return Site(frame.file_name, frame.line_num, frame.function_name)
    return None


def source_of(node: Node):
    """Where ``node`` was made, as a ``source_info``: its own, or, where that holds no line
    outside JAX (the body of a function JAX jits: ``jnp.cumsum``, ``jnp.roll``), the innermost
    call's that does. So a ``jnp`` function the model calls is the model's line (paired with
    the unsharded trace's, checked like the model's own), and one the library calls is the
    library's.

    >>> import jax, jax.numpy as jnp
    >>> from fsdp_tp._trace.graph import Graph
    >>> [cumsum] = Graph.trace(lambda p, x: jnp.cumsum(x, axis=1), {}, jnp.ones((2, 4))).nodes
    >>> site_of(cumsum.source), site_of(source_of(cumsum)).function
    (None, '<lambda>')
    """
    if site_of(node.source) is not None:
        return node.source
    return next((caller for caller in node.callers if site_of(caller) is not None), node.source)


def user_site(source) -> Site | None:
    """Where the user's own code made an operation, for a message: the innermost frame outside
    JAX, Flax and the library's distributing code (a LayerNorm's sum: the line that calls the
    LayerNorm), else :func:`site_of`'s."""
    traceback = getattr(source, "traceback", None)
    frames = traceback.frames if traceback is not None else ()
    for frame in frames:
        if users_file(frame.file_name):
            return Site(frame.file_name, frame.line_num, frame.function_name)
    return site_of(source)


def calling_site() -> Site | None:
    """Where the user's code called what runs now: the innermost frame of the Python stack in a
    :func:`users_file` (while a model traces, the model's line that reached the library)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if users_file(code.co_filename):
            return Site(code.co_filename, frame.f_lineno, code.co_qualname)
        frame = frame.f_back
    return None


def made_by_jax(file: str) -> bool:
    """Whether ``file`` is JAX's or Python's own: how an operation was made, not where."""
    return file.startswith(_SKIPPED)


def flax_file(file: str) -> bool:
    """Whether ``file`` is Flax's own (a layer's code, not the model's)."""
    return file.startswith(_FLAX)


def users_file(file: str) -> bool:
    """Whether a frame of ``file`` is the user's own code: :func:`site_of_file`'s, less Flax's."""
    return site_of_file(file) and not flax_file(file)


def site_of_file(file: str) -> bool:
    """Whether a frame of ``file`` is where the model's code is (not JAX's, Python's or the
    library's distributing code)."""
    return not made_by_jax(file) and not Site(file, 0, "").library


def scope_of(node: Node) -> str:
    """The name stack the operation was made under (Linen's module path; an NNX role's)."""
    return str(getattr(source_of(node), "name_stack", "") or "")


def is_library(node: Node) -> bool:
    """Whether the library made ``node`` (or JAX's replication check did): it has no pair in
    the unsharded model's trace."""
    if node.prim in _RETYPES:
        return True
    site = site_of(source_of(node))
    return site is not None and site.library


def pair(local: Graph, reference: Graph) -> dict[int, int]:
    """``{index in local: index in reference}``: each operation the model's code made in
    ``local`` with the one of the same primitive and source line, counted in order, in
    ``reference`` (the library's operations, and those made twice as often in one trace, have
    none)."""
    made: dict[tuple, list[int]] = defaultdict(list)
    folded = _on_literals(reference)
    for index, node in enumerate(reference.nodes):
        if (key := _key(node)) is not None and index not in folded:
            made[key].append(index)
    seen: dict[tuple, int] = defaultdict(int)
    pairs = {}
    folded = _on_literals(local)
    for index, node in enumerate(local.nodes):
        if (key := _key(node)) is None or is_library(node) or index in folded:
            continue
        nth, seen[key] = seen[key], seen[key] + 1
        if nth < len(made[key]):
            pairs[index] = made[key][nth]
    return pairs


def _on_literals(graph: Graph) -> set[int]:
    """The operations that read only literals (or what such operations made): JAX folds them
    into a literal in one trace and not in the other. Inside ``shard_map`` with ``check_vma`` a
    Python scalar becomes a value (``pvary``), so ``x + 1e-6`` in bf16 converts it by an
    operation the unsharded trace does not have; counting it would shift the line's pairs.
    A parameter is never such a value, though an initializer made it of literals alone (Linen's
    trace of ``init``: ``ones`` for a norm's scale): the model reads it as one."""
    constant: set[int] = set()
    folded = set()
    for index, node in enumerate(graph.nodes):
        if node.ins and all(v is None or v in constant for v in node.ins):
            folded.add(index)
            constant.update(v for v in node.outs if v not in graph.params)
    return folded


def _key(node: Node) -> tuple | None:
    """The primitive, the line and the module: a role may run a module's line less often
    (a row layer adds its bias after the sum), which must not shift the other modules' pairs."""
    site = site_of(source_of(node))
    if site is None:
        return None
    return node.prim, site.file, site.line, site.function, module_of(scope_of(node))


def module_of(scope: str) -> str:
    """The module path of a name stack, each name said once (a Linen role's clone repeats its
    module's name: ``LM/mlp/up/up``; a call through ``nn.map_variables`` adds the call's name
    after it: ``LM/moe/moe.call/moe``).

    >>> module_of("LM/moe/moe.call/moe/router")
    'LM/moe/router'
    """
    parts: list[str] = []
    for part in scope.split("/"):
        if not parts or (parts[-1] != part and not part.startswith(parts[-1] + ".")):
            parts.append(part)
    return "/".join(parts)


def _short(file: str) -> str:
    """A file as a user finds it: under a ``site-packages`` the package's own path, under the
    working directory the relative one, else the whole path."""
    if (at := file.rfind("site-packages" + os.sep)) >= 0:
        return file[at + len("site-packages") + 1 :]
    cwd = os.getcwd() + os.sep
    return file[len(cwd) :] if file.startswith(cwd) else file

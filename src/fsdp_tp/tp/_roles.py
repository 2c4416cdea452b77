"""The tensor-parallel roles a tp rule gives a submodule, once for every front end.

A rule is ``(pattern, role)``: ``pattern`` is searched (``re.search``) in a submodule's
path, as every rule of the library is (:mod:`fsdp_tp.rules`), and ``role`` says how that
submodule computes on its slices over a mesh axis:

- :class:`ColumnParallel` (a dense layer, a convolution or an einsum): the kernel split on
  its (first) output feature dim (an einsum's: a kernel letter of the output, ``letter=``);
  the input is the same on every device, the output this device's slice of the features (or
  gathered, ``gather_output=True``);
- :class:`RowParallel` (the same kinds): the kernel split on its (first) contracted input
  dim (an einsum's: a kernel letter of the inputs only); the input arrives split (a
  column-parallel layer's output), the partial products are summed over the axis and the
  bias added once;
- :class:`HeadParallel` (multi-head attention): each device computes its share of the heads
  (query/key/value split on the heads dim, the output projection row-parallel);
- :class:`ExpertParallel` (an einsum over experts' kernels ``(E, d, h)``): the expert dim split
  over an axis that also splits the batch; each device's tokens go to their experts' devices
  by ``all_to_all`` and come back on the layer given ``returns=True``;
- :class:`VocabParallel` (an embedding): the table split on the vocabulary; each device looks
  up the ids in its range and the rows are summed over the axis (``attend``, tied logits,
  gathers the vocabulary);
- :class:`Region` (a module of any class holding raw kernels, read by its own einsums): each
  parameter named split on its dim, the module's code run on the blocks, its input through *f*
  and its output summed over the axis (or gathered).

Sequence parallelism: give every role of the model ``sequence_dim`` (the sequence's dim of
the activations, 1 for ``(batch, seq, ...)``). Between tensor-parallel layers each device then
holds a slice of the sequence: the embedding's sum and each row layer's become
reduce-scatters along it, and each column layer (and attention, and tied logits) all-gathers
it first, whose backward reduce-scatters; no all-reduce is left over ``tensor``. It needs
``check_vma=True`` (a norm's parameters read sequence slices; JAX sums their gradients).

A role sees the module as a :class:`Layer`, which each front end builds from its own module
classes (Linen's ``nn.Dense`` and NNX's ``nnx.Linear`` are both the ``"dense"`` kind, their
``Einsum`` the ``"einsum"`` kind, whose equation says what it produces and contracts), and
computes through :mod:`fsdp_tp.tp`'s pieces. The roles live one kind of module to a file
(``_matmul.py``: the column and row roles; ``_heads.py``: attention; ``_vocab.py``: the
embedding) and are all named here; a new role is one :class:`TPRole` subclass, listed in
:data:`ROLES`. A module class of your own takes the column and row roles once
:func:`register_einsum` says what it computes.

>>> role = ColumnParallel()
>>> role.splits(Layer(kind="dense", path="mlp/up", features=(64,)))
{'kernel': -1, 'bias': -1}
>>> RowParallel().splits(Layer(kind="dense", path="mlp/down", features=(16,)))
{'kernel': -2}
>>> q = Layer(kind="einsum", path="attn/q", equation="BTD,NDH->BTNH", kernel_shape=(8, 64, 16))
>>> ColumnParallel().splits(q), ColumnParallel().local(q, 4)
({'kernel': -3, 'bias': -2}, Local(kernel_shape=(2, 64, 16)))
"""

from __future__ import annotations

from ._experts import ExpertParallel
from ._heads import HeadParallel
from ._matmul import ColumnParallel, RowParallel
from ._region import Region
from ._registered import register_einsum
from ._role import Layer, TPRole
from ._vocab import VocabParallel

__all__ = [
    "ROLES",
    "ColumnParallel",
    "ExpertParallel",
    "HeadParallel",
    "Layer",
    "Region",
    "RowParallel",
    "TPRole",
    "VocabParallel",
    "register_einsum",
]

# Every role a tp rule may name (the rules' errors list what each computes).
ROLES: tuple[type[TPRole], ...] = (
    ColumnParallel,
    RowParallel,
    HeadParallel,
    VocabParallel,
    ExpertParallel,
    Region,
)

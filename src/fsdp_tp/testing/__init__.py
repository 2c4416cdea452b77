"""The proof the suite gives its own models, for yours: a sharded model equal to the unsharded
one it was built from (docs/design.md invariants 1-5).

- :func:`check_sharded`: a model (Linen module, or NNX constructor), rules, a mesh, a batch and
  a loss in; the init bit for bit, outputs, loss, synced gradients and optimizer steps checked
  against the unsharded twin, a failure naming the first leaf that differs.
- :func:`check_equal` over a :class:`Comparison`: the same check on a sharded model and a twin
  you built (the suite's own equivalence tests run it).
- :func:`assert_trees_close`: the comparison, leaf by leaf, with its message.
- :class:`Reference`: the unsharded run computed once, read by every check of the same twin.
- :class:`Inputs`: the inputs of a model that takes several (``model(tokens, positions)``).
- :func:`meshes`: a hypothesis strategy of the meshes the devices can form.
- :class:`NNXSharded`, :class:`NNXTwin`: an NNX model as the check calls one.
"""

from ._arguments import Inputs as Inputs
from ._compare import ATOL as ATOL
from ._compare import RTOL as RTOL
from ._compare import assert_trees_close as assert_trees_close
from ._front import check_sharded as check_sharded
from ._harness import OPTIMIZERS as OPTIMIZERS
from ._harness import Comparison as Comparison
from ._harness import check_equal as check_equal
from ._meshes import mesh_shapes as mesh_shapes
from ._meshes import meshes as meshes
from ._nnx import NNXSharded as NNXSharded
from ._nnx import NNXTwin as NNXTwin
from ._reference import Reference as Reference

__all__ = [
    "ATOL",
    "OPTIMIZERS",
    "RTOL",
    "Comparison",
    "Inputs",
    "NNXSharded",
    "NNXTwin",
    "Reference",
    "assert_trees_close",
    "check_equal",
    "check_sharded",
    "mesh_shapes",
    "meshes",
]

"""The transform core's gather: blocks all-gathered for compute, at once or where they are read.

:func:`gather` all-gathers every block split over the given axes (a dim's minor axis
first). Over a batch axis the backward pass reduce-scatters the mean gradient; over any
other axis (every device there saw the same batch) it keeps this device's slice. With
``at_read=True`` a block the transform gathers whole (or to a tensor-parallel slice) is
not gathered yet: it is boxed as
:class:`GatheredOnRead`, and the gather runs where a module reads it (``self.param``
unboxes it). So a transform over a whole model gathers each parameter inside the call
of the submodule that owns it, as wrapping every layer does: inside any ``nn.remat`` or
``nn.scan`` of the model, next to its use, each layer's parameters on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import flax.linen as nn
import jax
from flax import struct
from flax.core import meta

from .._axes import axes_named
from .._tree import module_path, path_of
from .._types import AxisName, PyTree, is_box
from ..collectives._gather import gather_box
from ..errors import RuleError
from ..precision import MixedPrecision
from ._transform import current_module_path

__all__ = ["GatheredOnRead", "gather", "param_boxed"]


class GatheredOnRead(struct.PyTreeNode, meta.AxisMetadata):
    """A stored block that :func:`gather` leaves for the module to gather when it reads it.

    ``unbox()`` (what ``self.param`` does) runs the gather, so it lands inside the
    submodule's call and inside any lifted transform around it (an ``nn.remat`` of the
    model re-gathers in its backward pass, as FSDP frees and re-gathers a layer's
    parameters). The pytree leaf is the block, so lifted transforms pass the block, not
    the full value, across their boundaries.
    """

    block: nn.Partitioned
    path: str = struct.field(pytree_node=False)
    axes: frozenset = struct.field(pytree_node=False)
    batch_axes: frozenset = struct.field(pytree_node=False)
    vary: frozenset = struct.field(pytree_node=False)
    precision: MixedPrecision | None = struct.field(pytree_node=False)

    def unbox(self) -> Any:
        value = gather_box(self.block, self.axes, self.batch_axes, self.vary, self.precision)
        # Still split over a `local` axis (tensor parallelism by rules): the module computes on
        # this device's slice.
        return value.value if isinstance(value, nn.Partitioned) else value

    def replace_boxed(self, val: Any) -> Any:
        # A value written over the parameter is whole; the transform's store splits it again.
        return val

    def add_axis(self, index: int, params: dict) -> GatheredOnRead:
        return self.replace(block=self.block.add_axis(index, params))

    def remove_axis(self, index: int, params: dict) -> GatheredOnRead:
        names = self.block.names
        if index < len(names) and names[index] is not None:
            raise RuleError(
                f"{self.path}: dim {index} is split over {names[index]!r}, and a lifted transform "
                f"(nn.scan or nn.vmap) slices the parameter along that dim, one layer per step; a "
                f"device's block holds only some layers. Split another dim: give dim {index} None in "
                f"the rule, e.g. P(None, {names[index]!r})."
            )
        return self.replace(block=self.block.replace(names=names[:index] + names[index + 1 :]))


def gather(
    params: PyTree,
    axes: Collection[AxisName],
    batch_axes: Collection[AxisName],
    vary: frozenset = frozenset(),
    precision: MixedPrecision | None = None,
    at_read: bool = False,
    local: frozenset = frozenset(),
) -> PyTree:
    """All-gathers every block split over ``axes`` (a dim's minor axis first); splits over other
    axes stay boxed, a leaf left whole is unboxed. Over an axis in ``batch_axes`` the gradient
    comes back as the reduce-scattered mean (every device's gradient is a part of the batch
    mean); over any other axis as this device's slice (all devices computed the same one).
    ``vary``: the axes the gathered values will meet device-varying data on, under
    ``check_vma=True`` (see :func:`~fsdp_tp.linen._transform.input_varying`). ``precision``: every
    floating leaf is read rounded to its gather dtype, and the gathers over ``batch_axes``
    move that dtype and reduce-scatter the gradient in its reduce dtype
    (:class:`~fsdp_tp.precision.MixedPrecision`). ``at_read``: every block is boxed as
    :class:`GatheredOnRead` and gathered where the module reads it, if it is split over no
    axes but ``axes`` and ``local``: the axes a module computes on slices of (tensor
    parallelism by rules), read as this device's slice. A block split over another axis
    is gathered at once, left boxed for a transform inside to gather."""
    axes, batch = frozenset(axes), frozenset(batch_axes)

    def leaf_fn(key_path, leaf):
        if at_read and isinstance(leaf, nn.Partitioned) and axes_named(leaf.names) <= axes | local:
            path = module_path((current_module_path(),), path_of(key_path).removeprefix("params/"))
            return GatheredOnRead(leaf, path, axes, batch, vary, precision)
        return gather_box(leaf, axes, batch, vary, precision)

    return jax.tree_util.tree_map_with_path(leaf_fn, params, is_leaf=is_box)


def param_boxed(module: nn.Module, name: str, param: Callable[[], Any]) -> Any:
    """Parameter ``name`` of ``module`` for a layer that reads it boxed, to keep its own split:
    ``param()`` (its ``self.param(..., unbox=False)``) unless a transform around the layer
    left the block to be gathered here (:class:`GatheredOnRead`); then the gathered value,
    read as stored, since flax's shape check in ``param`` would take the box's leaf, the
    block, for the value."""
    if module.has_variable("params", name):
        stored: Any = module.get_variable("params", name)
        if isinstance(stored, GatheredOnRead):
            return stored.unbox()
    return param()

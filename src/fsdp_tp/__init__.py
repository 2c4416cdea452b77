"""fsdp_tp: fully sharded data parallelism and tensor parallelism for Flax models.

The front door holds the user's path: a mesh, a transform (or the tensor-parallel
layers), the sharded init, the step, the gradient sync, checkpoints and the plan. The
building blocks live in named submodules. The core, which imports no Flax front end:
:mod:`fsdp_tp.collectives` (the custom-gradient collectives), :mod:`fsdp_tp.tp` (the
tensor-parallel roles; Megatron's pieces in :mod:`fsdp_tp.tp.pieces`),
:mod:`fsdp_tp.precision` (mixed-precision gathers), :mod:`fsdp_tp.partitioning` (specs of a
state, checks), :mod:`fsdp_tp.rules` (the rule grammar, specs for ``jax.jit``),
:mod:`fsdp_tp.mesh`, :mod:`fsdp_tp.train`, :mod:`fsdp_tp.sharded_init`,
:mod:`fsdp_tp.checkpoint`, :mod:`fsdp_tp.analysis`, :mod:`fsdp_tp.dropout`,
:mod:`fsdp_tp.context` (the sequence split over ``context``, attention across it),
:mod:`fsdp_tp.attention` (softmax attention, framework-free), :mod:`fsdp_tp.routing` (a
mixture's router and dispatch), :mod:`fsdp_tp.compile_cache` (compiled programs kept across
runs), :mod:`fsdp_tp.errors`. The front ends: :mod:`fsdp_tp.linen` (its modules
:mod:`fsdp_tp.linen.fsdp`, :mod:`fsdp_tp.linen.layers`, :mod:`fsdp_tp.linen.tp_rules`) and
:mod:`fsdp_tp.nnx`. And :mod:`fsdp_tp.models`. Each public name has one path (0.1's and 0.2's
others warn: :mod:`fsdp_tp._aliases`); ``docs/architecture.md`` maps the modules.
"""

from . import analysis as analysis
from . import checkpoint as checkpoint
from . import collectives as collectives
from . import dropout as dropout
from . import errors as errors
from . import linen as linen
from . import mesh as mesh
from . import models as models
from . import partitioning as partitioning
from . import precision as precision
from . import rules as rules
from . import sharded_init as sharded_init
from . import tp as tp
from . import train as train
from ._aliases import aliases_of
from ._check import plain as _plain
from .checkpoint import Checkpoints as Checkpoints
from .gradients import sync_gradients as sync_gradients
from .linen.fsdp import shard_module_params as shard_module_params
from .linen.layers import AttentionBlock as AttentionBlock
from .linen.layers import ColumnParallelDense as ColumnParallelDense
from .linen.layers import MLPBlock as MLPBlock
from .linen.layers import RowParallelDense as RowParallelDense
from .linen.layers import VocabParallelEmbed as VocabParallelEmbed
from .linen.rule_transform import shard_by_rules as shard_by_rules
from .mesh import make_mesh as make_mesh
from .mesh import simulate_cpu_devices as simulate_cpu_devices
from .plan import make_plan as make_plan
from .precision import MixedPrecision as MixedPrecision
from .sharded_init import init_sharded as init_sharded
from .tp.pieces import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .train import TrainState as TrainState
from .train import accumulate_gradients as accumulate_gradients
from .train import shard_step as shard_step
from .train import state_init_fn as state_init_fn

# (a model from nnx.merge in a step that splits the sequence: checked where flax.nnx is loaded)
_plain.register_when_loaded("flax.nnx", "fsdp_tp.nnx._plain")

__getattr__ = aliases_of(__name__)  # the Linen modules 0.1 reached from here (fsdp_tp._aliases)

__version__ = "0.2.0"

__all__ = [
    "AttentionBlock",
    "Checkpoints",
    "ColumnParallelDense",
    "MLPBlock",
    "MixedPrecision",
    "RowParallelDense",
    "TrainState",
    "VocabParallelEmbed",
    "accumulate_gradients",
    "init_sharded",
    "make_mesh",
    "make_plan",
    "shard_by_rules",
    "shard_module_params",
    "shard_step",
    "simulate_cpu_devices",
    "state_init_fn",
    "sync_gradients",
    "vocab_parallel_cross_entropy",
]

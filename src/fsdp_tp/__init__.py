"""fsdp_tp: fully sharded data parallelism and tensor parallelism for Flax linen models.

The public API is re-exported here; the modules behind it are documented in
``docs/architecture.md``.
"""

from . import analysis as analysis
from . import checkpoint as checkpoint
from . import errors as errors
from . import models as models
from . import rules as rules
from .checkpoint import Checkpoints as Checkpoints
from .checkpoint import global_tree as global_tree
from .collectives import copy_to_axis as copy_to_axis
from .collectives import gather_array_with_mean_grads as gather_array_with_mean_grads
from .collectives import gather_from_axis as gather_from_axis
from .collectives import reduce_from_axis as reduce_from_axis
from .collectives import scatter_to_axis as scatter_to_axis
from .fsdp import gather_params as gather_params
from .fsdp import shard_module_params as shard_module_params
from .fsdp import shard_params as shard_params
from .gradients import sync_gradients as sync_gradients
from .mesh import DEFAULT_AXIS_NAMES as DEFAULT_AXIS_NAMES
from .mesh import make_mesh as make_mesh
from .mesh import parse_mesh as parse_mesh
from .mesh import simulate_cpu_devices as simulate_cpu_devices
from .partitioning import check_specs as check_specs
from .partitioning import derive_specs as derive_specs
from .partitioning import specs_of as specs_of
from .plan import make_plan as make_plan
from .rule_transform import shard_by_rules as shard_by_rules
from .rules import named_shardings as named_shardings
from .rules import specs_from_rules as specs_from_rules
from .sharded_init import init_sharded as init_sharded
from .sharded_init import lower_init as lower_init
from .tensor_parallel import AttentionBlock as AttentionBlock
from .tensor_parallel import ColumnParallelDense as ColumnParallelDense
from .tensor_parallel import MLPBlock as MLPBlock
from .tensor_parallel import RowParallelDense as RowParallelDense
from .tensor_parallel import VocabParallelEmbed as VocabParallelEmbed
from .tensor_parallel import tensor_parallel as tensor_parallel
from .tensor_parallel import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from .train import TrainState as TrainState
from .train import accumulate_gradients as accumulate_gradients
from .train import fold_rng_over_axis as fold_rng_over_axis
from .train import shard_step as shard_step
from .train import state_init_fn as state_init_fn

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_AXIS_NAMES",
    "AttentionBlock",
    "Checkpoints",
    "ColumnParallelDense",
    "MLPBlock",
    "RowParallelDense",
    "TrainState",
    "VocabParallelEmbed",
    "accumulate_gradients",
    "analysis",
    "check_specs",
    "checkpoint",
    "copy_to_axis",
    "derive_specs",
    "errors",
    "fold_rng_over_axis",
    "gather_array_with_mean_grads",
    "gather_from_axis",
    "gather_params",
    "global_tree",
    "init_sharded",
    "lower_init",
    "make_mesh",
    "make_plan",
    "models",
    "named_shardings",
    "parse_mesh",
    "reduce_from_axis",
    "rules",
    "scatter_to_axis",
    "shard_by_rules",
    "shard_module_params",
    "shard_params",
    "shard_step",
    "simulate_cpu_devices",
    "specs_from_rules",
    "specs_of",
    "state_init_fn",
    "sync_gradients",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]

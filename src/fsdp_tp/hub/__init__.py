"""Checkpoints in the Hugging Face layout, read straight into a sharded model's arrays.

:mod:`~fsdp_tp.hub.safetensors` (the file format, read as untrusted input),
:mod:`~fsdp_tp.hub.directory` (a checkpoint directory: one file or an index of shards),
:mod:`~fsdp_tp.hub.mapping` (checkpoint names to parameter paths, and the views between their
layouts), :mod:`~fsdp_tp.hub.load` (each process reads only its own devices' blocks),
:mod:`~fsdp_tp.hub.decoder` (the decoder a ``config.json`` describes, Linen and NNX),
:mod:`~fsdp_tp.hub.layout` (its layout on a mesh, as rules) and :mod:`~fsdp_tp.hub.families`
(each family's mapping).

A fine-tune starts so: the decoder's config from the checkpoint, its state laid out on the mesh
(:func:`~fsdp_tp.sharded_init.abstract_init`: shapes only), then its parameters read into that
layout::

    checkpoint = Checkpoint(directory)
    config = DecoderConfig.from_hub(checkpoint.config)
    model = fsdp_tp.shard_by_rules(Decoder, fsdp_rules(config), tp_rules=tp_rules(config))(config)
    shapes, specs = abstract_init(init_fn, mesh, in_specs, *args)
    params, report = load(checkpoint, shapes.params, *mapping(config))
"""

from .config import DecoderConfig
from .decoder import Decoder, NNXDecoder
from .directory import Checkpoint
from .families import mapping
from .layout import fsdp_rules, tp_rules
from .load import LoadReport, load, train_state
from .mapping import Rule, SplitDim, Take, Transpose

__all__ = [
    "Checkpoint",
    "Decoder",
    "DecoderConfig",
    "LoadReport",
    "NNXDecoder",
    "Rule",
    "SplitDim",
    "Take",
    "Transpose",
    "fsdp_rules",
    "load",
    "mapping",
    "tp_rules",
    "train_state",
]

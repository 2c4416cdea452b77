"""One of two processes of a run (gloo over 127.0.0.1, 4 CPU devices each) that loads the tiny
Llama checkpoint into FSDP over all 8 devices and exports it back; prints what it read, as
JSON. Started by ``tests/test_hub.py``:

    python tests/hub_process.py PORT PROCESS_ID EXPORT_DIR
"""

from __future__ import annotations

import json
import os
import sys

CHECKPOINT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "hub_checkpoints", "llama"
)


def main(port: int, process_id: int, out: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import fsdp_tp
    from fsdp_tp.cli.distributed import join

    jax.config.update("jax_num_cpu_devices", 4)
    join(f"127.0.0.1:{port}", 2, process_id, auto=False)
    from fsdp_tp.hub import Checkpoint, Decoder, DecoderConfig, fsdp_rules, load, mapping
    from fsdp_tp.hub.export import export
    from fsdp_tp.sharded_init import abstract_init

    checkpoint = Checkpoint(CHECKPOINT, coalesce=0)
    config = DecoderConfig.from_hub(checkpoint.config)
    mesh = fsdp_tp.make_mesh({"fsdp": 8})
    model = fsdp_tp.shard_by_rules(Decoder, fsdp_rules(config), batch_axes=("fsdp",))(config)
    init = lambda key, tokens: model.init(key, tokens)["params"]
    shapes, _ = abstract_init(init, mesh, (P(), P("fsdp")), jax.random.key(0), jnp.zeros((8, 4), jnp.int32))
    rules, ignore = mapping(config)
    params, report = load(checkpoint, shapes, rules, ignore)
    export(params, rules, like=checkpoint, directory=out, ignore=ignore)
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "bytes_read": report.bytes_read,
                "bytes_stored": report.bytes_stored,
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

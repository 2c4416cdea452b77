"""Writes ``llama_tuned/``: the tiny Llama fine-tuned three steps by the library on a data x fsdp x
tensor mesh and exported by it (``fsdp_tp.hub.finetune``), so that ``record.py`` records the
logits ``transformers`` computes from the library's export, and the suite checks the library
reads that file as ``transformers`` does (``tests/test_hub.py``). Run again, it writes tensors
within float32's rounding of these, not bit for bit: AdamW turns a near-zero gradient's rounding
into its update's sign (measured: one element of 1,536 apart by 2.8e-6 between two processes).

    python examples/hub_checkpoints/tune.py
    /tmp/hub/bin/python examples/hub_checkpoints/record.py llama_tuned
"""

import pathlib
import shutil

import fsdp_tp

fsdp_tp.simulate_cpu_devices(8)

from fsdp_tp.cli.finetune import read_data  # noqa: E402
from fsdp_tp.hub.finetune import FineTune, Schedule  # noqa: E402

HERE = pathlib.Path(__file__).parent


def main(out: pathlib.Path = HERE / "llama_tuned") -> None:
    tune = FineTune(
        HERE / "llama", {"data": 2, "fsdp": 2, "tensor": 2}, batch=4, seq_len=16, schedule=Schedule(lr=3e-2)
    )
    tokens = read_data(str(HERE / "corpus.txt"), str(HERE / "llama"))
    for step in range(3):
        print("step", step + 1, tune.step(tune.batch_at(tokens, step)))
    shutil.rmtree(out, ignore_errors=True)
    tune.export(out)


if __name__ == "__main__":
    main()

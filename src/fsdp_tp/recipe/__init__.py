"""The main job's recipe, shared by ``fsdp-tp train`` (:mod:`fsdp_tp.cli`) and
``fsdp-tp bench`` (:mod:`fsdp_tp.bench`), neither of which imports the other's modules:
the model presets (``config``), the token data (``data``), the trainer with its sharded
init, step and twin check (``trainer``), and throughput and memory figures (``throughput``).

Not the library's API: the command's insides, whose names may change in any release (the
library is what docs/api.md lists).
"""

__all__: list[str] = []

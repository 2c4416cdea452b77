"""Benchmarks of every strategy against the baselines: ``fsdp-tp bench`` (see ``run.py``).

Not the library's API: the command's insides, whose names may change in any release (the
library is what docs/api.md lists).
"""

from .run import run_benchmarks as run_benchmarks

__all__ = ["run_benchmarks"]

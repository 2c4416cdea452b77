"""Benchmarks of every strategy against the baselines: ``fsdp-tp bench`` (see ``run.py``)."""

from .run import run_benchmarks as run_benchmarks

__all__ = ["run_benchmarks"]

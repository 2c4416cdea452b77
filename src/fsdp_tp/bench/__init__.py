"""Benchmarks of every strategy against the baselines: `fsdp-tp bench`."""

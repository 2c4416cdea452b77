"""Benchmarks: exact figures of the library against the baselines a user would pick instead."""

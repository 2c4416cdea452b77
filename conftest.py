"""Test set-up shared by tests/ and the doctests in src/: 8 simulated CPU devices and
hypothesis profiles. It runs before any test module imports jax's backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

_common = dict(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# "ci": what the README's test command and .ci/run use (the suite stays near 10 min on 2 cores).
settings.register_profile("ci", max_examples=6, **_common)
# "thorough": for local runs before a release: HYPOTHESIS_PROFILE=thorough pytest
settings.register_profile("thorough", max_examples=60, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

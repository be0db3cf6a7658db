"""Test set-up: 8 emulated CPU devices for jax, and hypothesis profiles.

XLA_FLAGS must be set before jax is first imported anywhere, so it is set
here, at collection time.  The ``ci`` profile (the default; HYPOTHESIS_PROFILE=dev for more, random examples) bounds the
examples and switches deadlines off, since some tests compile with XLA.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# Bounded and derandomized unless asked otherwise: random planner specs can reach layouts whose
# exact search takes seconds (a known gap), and the suite must stay under 10 minutes.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

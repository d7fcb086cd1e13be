"""Test setup: 8 simulated CPU devices, set before anything imports jax."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

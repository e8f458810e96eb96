"""Shared test configuration."""

import os

# Eight virtual CPU devices for the sharding tests; set before jax starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# The fixture recorder imports torch, which the tests do not need.
collect_ignore = ["data"]

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(params=["eager", "jit"])
def jit(request):
    """``jax.jit``, or no transformation: a test that takes it runs both ways."""
    return jax.jit if request.param == "jit" else (lambda fn: fn)

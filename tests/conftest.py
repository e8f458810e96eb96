"""Shared test configuration."""

import os
import shutil
import tempfile

# Eight virtual CPU devices for the sharding tests; set before jax starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# One persistent XLA compilation cache per test run, shared by the xdist
# workers (they inherit this environment from the controller, whose conftest is
# imported first) and by the subprocesses the tests start: the examples, the
# notebooks' kernels, the README blocks. Many tests compile the same programs,
# and on CPU XLA's compile takes most of their time. An entry is keyed by the
# program's fingerprint, the compile options and the jax/XLA versions, so a hit
# runs exactly the executable a fresh compile would have produced.
_CACHE_CREATED_HERE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_CREATED_HERE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="loss_scale-tests-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# The fixture recorder imports torch, which the tests do not need.
collect_ignore = ["data"]

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(params=["eager", "jit"])
def jit(request):
    """``jax.jit``, or no transformation: a test that takes it runs both ways."""
    return jax.jit if request.param == "jit" else (lambda fn: fn)


def pytest_sessionfinish(session):
    """The process that made the compilation cache removes it at the end."""
    if _CACHE_CREATED_HERE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

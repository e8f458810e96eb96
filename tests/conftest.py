"""Shared test configuration."""

import os
import shutil
import tempfile

# Eight virtual CPU devices for the sharding tests; set before jax starts.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# A persistent XLA compilation cache for the run: many tests compile the same
# programs, and on CPU XLA's compile takes most of their time. An entry is
# keyed by the program's fingerprint, the compile options and the jax/XLA
# versions, so a hit runs exactly the executable a fresh compile would have
# produced. The pytest process makes the run's directory (its xdist workers
# inherit it) and removes it at the end. Each process that runs tests gets a
# directory of its own, shared with the subprocesses its tests start (examples,
# notebook kernels, README blocks), which run while it waits: JAX writes an
# entry without a lock, so two processes compiling the same program at once
# could otherwise read a half-written one.
_CACHE_ROOT = "LOSS_SCALE_TESTS_XLA_CACHE"
_CACHE_CREATED_HERE = _CACHE_ROOT not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_CREATED_HERE:
    os.environ[_CACHE_ROOT] = tempfile.mkdtemp(prefix="loss_scale-tests-xla-cache-")
if _CACHE_ROOT in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ[_CACHE_ROOT], f"process-{os.getpid()}")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# The fixture recorder imports torch, which the tests do not need.
collect_ignore = ["data"]

jax.config.update("jax_numpy_rank_promotion", "raise")
if _CACHE_ROOT in os.environ:  # in case jax was imported, and read its environment, before this file
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes", int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
    )


@pytest.fixture(params=["eager", "jit"])
def jit(request):
    """``jax.jit``, or no transformation: a test that takes it runs both ways."""
    return jax.jit if request.param == "jit" else (lambda fn: fn)


def pytest_sessionfinish(session):
    """The process that made the compilation cache removes it at the end."""
    if _CACHE_CREATED_HERE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ[_CACHE_ROOT], ignore_errors=True)

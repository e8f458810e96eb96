"""Compiling with each phase timed, interleaved timing rounds, paired ratio
statistics, and rerunning a script with glibc malloc tuned.

XLA:CPU timings depend heavily on glibc malloc: the temp buffer of an
executable is page-faulted in again on every step unless malloc keeps it.
``TUNED_MALLOC`` makes malloc keep and reuse freed memory, as accelerator
allocators do; glibc reads it once, at process start, so a script applies it
by rerunning itself (``rerun``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

PyTree = Any

TUNED_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
}
# Environment variables that change the allocator, reported with the results.
MALLOC_ENV_VARS = (*TUNED_MALLOC, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")

# For smoke runs, whose wall time is mostly XLA:CPU compiling: optimizing less
# and using XLA:CPU's older loop emitters (measured 3-6x faster to compile on
# jaxlib 0.10). jaxlib 0.11 removed the last option and refuses it.
_QUICK_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


@functools.cache
def quick_compiler_options() -> dict[str, Any]:
    """The options of ``_QUICK_OPTIONS`` that this jaxlib's XLA accepts
    (each tried once on a trivial program: an unknown option is an error,
    ``No such compile option``)."""
    accepted = {}
    for name, value in _QUICK_OPTIONS.items():
        try:
            jax.jit(lambda x: x + 1).lower(1.0).compile({name: value})
        except Exception:  # noqa: BLE001 - XLA raises its runtime error type for an unknown option
            continue
        accepted[name] = value
    return accepted


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------


def fresh_compiles() -> None:
    """Turns JAX's persistent compilation cache off in this process.

    With ``JAX_COMPILATION_CACHE_DIR`` set (or ``jax_compilation_cache_dir``
    configured), XLA would serve executables that an earlier run left on
    disk, and a timed compile would be a file read. The scripts call this
    before their first compile: JAX decides once per process whether the
    cache is used.
    """
    jax.config.update("jax_enable_compilation_cache", False)


def persistent_cache_dir() -> str | None:
    """The persistent compilation cache's directory if this process uses one
    (then compile times may be cache hits), else ``None``."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


@dataclasses.dataclass(frozen=True)
class CompileTimes:
    """Seconds spent tracing to a jaxpr, lowering to StableHLO, and in XLA."""

    trace_s: float
    lower_s: float
    compile_s: float

    @property
    def trace_lower_s(self) -> float:
        return self.trace_s + self.lower_s

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s


def compile_timed(
    fn: Callable,
    args: Sequence[Any],
    donate_argnums: tuple[int, ...] = (),
    compiler_options: dict[str, Any] | None = None,
    hlo_path: str | None = None,
) -> tuple[jax.stages.Compiled, CompileTimes]:
    """``jax.jit(fn).trace(*args).lower().compile()``, each phase timed.

    ``fn`` is wrapped in a fresh function, so that JAX's caches, keyed on the
    function object, cannot serve an earlier trace of it. If ``hlo_path`` is
    given, the optimized HLO is written there.
    """
    fresh = functools.wraps(fn)(lambda *a: fn(*a))
    jitted = jax.jit(fresh, donate_argnums=donate_argnums)
    start = time.perf_counter()
    traced = jitted.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options)
    done = time.perf_counter()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    return compiled, CompileTimes(traced_at - start, lowered_at - traced_at, done - lowered_at)


def memory_mib(compiled: jax.stages.Compiled) -> dict[str, float] | None:
    """XLA's planned memory in MiB: temp, and peak = arguments + outputs +
    temp - the outputs that alias (donated) arguments; ``None`` where the
    backend does not say."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if ma is None:
        return None
    mib = 2.0**20
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    return {
        "temp_mib": ma.temp_size_in_bytes / mib,
        "peak_mib": peak / mib,
        "argument_mib": ma.argument_size_in_bytes / mib,
        "output_mib": ma.output_size_in_bytes / mib,
        "alias_mib": ma.alias_size_in_bytes / mib,
    }


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def round_robin(
    call: Callable[[str], Any],
    names: Sequence[str],
    rounds: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Seconds per ``call(name)`` of each name, interleaved A B C .. A B C ..

    ``call`` runs one step and blocks until it is done. The starting name
    rotates every round, so none always runs right after the same neighbour
    (whose freed memory it may inherit). Python's garbage collector is paused
    while timing.
    """
    names = list(names)
    for _ in range(warmup):
        for name in names:
            call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                call(name)
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of ``values``:
    ``(low, high, coverage)``, from order statistics.

    With ``n`` values, the interval between the ``k``-th smallest and the
    ``k``-th largest holds the true median with probability ``1 - 2 P(B <
    k)``, ``B ~ Binomial(n, 1/2)``; ``k`` is the largest that reaches
    ``level``. With too few values for ``level`` (fewer than 6 for 95%) it is
    the full range, at the coverage that range has.
    """
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    tail = 0.0  # P(B <= j)
    k = 0
    for j in range(n // 2):
        tail += math.comb(n, j) / 2.0**n
        if tail > (1 - level) / 2:
            break
        k = j + 1
    if k == 0:
        return float(x[0]), float(x[-1]), 1 - 2 / 2.0**n
    below = sum(math.comb(n, j) for j in range(k)) / 2.0**n
    return float(x[k - 1]), float(x[n - k]), 1 - 2 * below


def ratio_stats(times: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """The per-round ratios ``times / baseline`` (paired: the same round):
    median, its 95% order-statistic CI, quartiles and range, and the
    median time in milliseconds."""
    ratios = np.asarray(times) / np.asarray(baseline)
    p25, median, p75 = np.percentile(ratios, [25, 50, 75])
    low, high, coverage = median_ci(ratios)
    return {
        "median": float(median),
        "ci_low": low,
        "ci_high": high,
        "ci_coverage": coverage,
        "p25": float(p25),
        "p75": float(p75),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "median_ms": float(np.median(times) * 1e3),
        "rounds": len(ratios),
    }


# ---------------------------------------------------------------------------
# Malloc
# ---------------------------------------------------------------------------


def tuned_malloc_in_effect() -> bool:
    return all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items())


def malloc_flag_help() -> str:
    return " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items())


def rerun(script: str, argv: Sequence[str], tuned: bool) -> dict[str, Any]:
    """Runs ``script argv --json TMP`` in a fresh interpreter, with malloc
    tuned or at glibc's defaults, and returns the JSON it wrote. Its output
    prints as it goes."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC}
    if tuned:
        env.update(TUNED_MALLOC)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.abspath(script), *argv, "--json", path], env=env, check=True)
        with open(path) as f:
            return json.load(f)

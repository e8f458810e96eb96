"""A float16 backward pass in miniature, for running scale rules over long
runs in the tests.

The simulated runs of ``benchmarks/predictive.py``, kept here too so that the
tests need only jax, numpy and the library's rule classes (the benchmark also
imports the examples' flax models); ``tests/test_benchmarks.py`` checks that
the benchmark's copy simulates the same runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F16_MAX = 65504.0

SIMULATIONS = (  # (steps, noise, amplification)
    (40000, 0.05, 40.0),
    (40000, 0.05, 3000.0),
    (20000, 0.25, 40.0),
    (20000, 0.25, 3000.0),
)


def drifting_gradients(steps: int, noise: float = 0.25, seed: int = 0) -> np.ndarray:
    """The largest parameter gradient of each step of a made-up run: down 30x
    over the run with two slow rises (5x and 9x), times log-normal
    step-to-step noise with standard deviation ``noise``."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, steps)
    bumps = 1 + 4 * np.exp(-(((t - 0.3) / 0.05) ** 2)) + 8 * np.exp(-(((t - 0.7) / 0.08) ** 2))
    return (1e-2 * 30.0 ** (-t) * bumps * np.exp(rng.normal(size=steps) * noise)).astype(np.float32)


def simulate(
    rule: Any, true_max: np.ndarray, amplification: float, every: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Runs a scale rule (``loss_scale._rules``' ``DynamicRule`` or
    ``PredictiveRule``) against a simulated float16 backward pass: a step
    overflows when its largest value, ``amplification`` times the largest
    parameter gradient, exceeds float16's maximum once scaled. Returns the
    scale each step ran at and whether it overflowed.

    With ``every``, the backward peak is measured as
    ``ls.value_grad_and_peak(every=every)`` measures it: on steps whose
    ``good_steps`` is a multiple of ``every``, the step's own largest scaled
    value rounded to float16 (inf when it overflows), 0 on the others; the
    rule gets it as ``backward_peak`` (and knows nothing else of the
    amplification)."""

    def step(counters, g):
        largest = counters.scale * g * amplification  # the backward pass's largest value, scaled
        finite = largest <= F16_MAX
        peak = None
        if every is not None:
            measured = largest.astype(jnp.float16).astype(jnp.float32)
            peak = jnp.where(counters.good_steps % every == 0, jnp.where(finite, measured, jnp.inf), 0.0)
        new = rule.adjust(counters, finite, jnp.where(finite, g, jnp.inf), peak)
        return new, (counters.scale, ~finite)

    _, (scales, overflowed) = jax.lax.scan(step, rule.init(), jnp.asarray(true_max, jnp.float32))
    return np.asarray(scales), np.asarray(overflowed)

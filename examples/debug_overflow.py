#!/usr/bin/env python
"""Finding where float16 overflows come from, with ``locate_overflows``.

A small float16-compute regression model is trained on synthetic tabular data
in which one input column was left unnormalized (values around 300, the kind
of bug a forgotten preprocessing step leaves). The large activations it
causes make some weight gradient overflow float16 unless the scale is small,
so the scaler backs off again and again and trains with a scale far lower
than it could. ``ls.dynamic(..., locate_overflows=True)`` records which
gradient leaves were non-finite on the last skipped step, and
``ls.overflow_paths`` names them. The same model on standardized data skips
once (the initial scale is too high) and keeps a high scale. The table is
measured, not written in: read which leaf it names.

Usage::

    python examples/debug_overflow.py            # a few seconds on 2 CPU cores
    python examples/debug_overflow.py --steps 300
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls

try:  # run as a script (examples/ is on sys.path), or from the notebooks
    import _common
except ModuleNotFoundError as error:  # imported by file path (the tests, benchmarks/predictive.py)
    if error.name != "_common":
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16, name="encoder")(x))
        x = nn.relu(nn.Dense(64, dtype=jnp.float16, name="hidden")(x))
        return nn.Dense(1, dtype=jnp.float16, name="head")(x)


def make_data(n: int, unnormalized: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    if unnormalized:
        x[:, 3] = x[:, 3] * 50 + 300  # a raw feature, e.g. a price in cents, never standardized
    return x, y


def train(unnormalized: bool, steps: int, batch: int = 256) -> dict[str, Any]:
    x, y = make_data(4096, unnormalized)
    model = Regressor()
    params = model.init(jax.random.key(0), jnp.asarray(x[:1]))["params"]
    tx = ls.dynamic(optax.adam(1e-3), initial_scale=2.0**15, locate_overflows=True)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss_fn(p):
            pred = model.apply({"params": p}, xb.astype(jnp.float16)).astype(jnp.float32)
            return jnp.mean((pred - yb) ** 2)

        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    first_paths = None
    for i in range(steps):
        rows = slice((i * batch) % len(x), (i * batch) % len(x) + batch)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(x[rows]), jnp.asarray(y[rows]))
        if first_paths is None and bool(opt_state.skipped):
            first_paths = ls.overflow_paths(opt_state, params)
    metrics = {k: float(v) for k, v in ls.metrics(opt_state, prefix="").items()}
    return {
        "skipped_steps": int(metrics["skipped_steps"]),
        "final_scale": metrics["scale"],
        "steps_at_min": int(metrics["steps_at_min"]),
        "overflow_paths": ls.overflow_paths(opt_state, params),
        "first_overflow_paths": first_paths or [],
        "final_loss": float(loss),
    }


# The results table: (header, key in each run, format).
COLUMNS = (
    ("skipped", "skipped_steps", "d"),
    ("final scale", "final_scale", "g"),
    ("final loss", "final_loss", ".4f"),
    ("leaves that overflowed", "overflow_leaves", "s"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=100)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = {
        "unnormalized column": train(unnormalized=True, steps=args.steps),
        "normalized": train(unnormalized=False, steps=args.steps),
    }
    for r in results.values():
        r["overflow_leaves"] = ", ".join(r["overflow_paths"]) or "-"
    _common.print_table(results, COLUMNS, first="data")
    bad, good = results["unnormalized column"], results["normalized"]
    if bad["overflow_paths"]:
        print(
            f"\nWith the raw column: {bad['skipped_steps']} skipped steps, the scale ends at {bad['final_scale']:g} "
            f"(standardized: {good['skipped_steps']} skipped, {good['final_scale']:g}); the last overflow was in "
            f"{', '.join(bad['overflow_paths'])}. A weight gradient multiplies the activations feeding that layer "
            "by the error flowing back into it, so one unnormalized input inflates it; look at what feeds that leaf."
        )
    return results


if __name__ == "__main__":
    main()

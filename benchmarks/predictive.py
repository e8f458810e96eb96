#!/usr/bin/env python
"""Predictive loss scaling against the torch rule, on the example workloads.

Each workload is trained in float16 compute (float32 params, float16 forward
and backward, float32 loss) from the same initialization and batches with:

* ``torch rule``: ``ls.presets.torch(adam)``, torch.amp.GradScaler's rule and
  defaults (start at 2**16, halve on overflow, double after 2000 clean steps);
* ``ls.predictive``: ``ls.predictive(adam)`` with its defaults;

and, for reference, in float32 (``ls.static(adam, 1.0)``). For every run the
table gives the skipped steps; the fractions of (scaled) gradient elements
below float16's smallest normal (6.1e-5) and exactly 0, averaged over the
applied steps (``track_underflow=True``; for float32, what float16 without
scaling would face, and the gradients that are 0 in any precision); the
final evaluation loss, computed in float32 from the trained float32 params;
the final scale and the predictive rule's learned headroom.

The workloads are the repository's examples, imported from ``examples/``:

* ``digits CNN``: ``examples/cnn_digits.py`` (sklearn's digits; flax linen);
* ``stdlib LM``: ``examples/nnx_lm.py`` (a transformer LM over Python's
  standard-library sources; flax NNX);
* ``Zipf LM``: ``examples/quickstart.py`` (32768-class output, 1024 tokens a
  batch, where float16 without scaling fails);
* ``raw-column regression``: ``examples/debug_overflow.py``'s data with one
  unnormalized input column, whose gradients overflow float16 at high scales.

Usage::

    python benchmarks/predictive.py --out           # ~10 minutes on 2 CPU cores
    python benchmarks/predictive.py --steps-factor 0.2 --workloads cnn,regression
    python benchmarks/predictive.py --quick         # a smoke test, seconds

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import loss_scale as ls

try:  # run as a script: Python puts benchmarks/ first on sys.path
    from _harness import cli, provenance, tables
except ModuleNotFoundError as error:  # imported with the repository root on sys.path (the tests)
    if error.name != "_harness":
        raise
    from benchmarks._harness import cli, provenance, tables

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

PyTree = Any


@functools.cache
def example(name: str) -> ModuleType:
    """``examples/<name>.py``, imported by path on first use (the examples are
    scripts, not a package). It is registered in ``sys.modules`` before it
    runs, because flax modules and dataclasses look their module up there."""
    module_name = f"loss_scale_example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its data and its optimizer, trainable in any compute dtype.

    Attributes:
      name: the table's label.
      description: one line on what it is.
      params: the float32 initial params, shared by every run.
      loss_fn: ``(params, batch, compute_dtype) -> float32 loss``.
      batches: the batch of every step, indexed by step on the host.
      eval_batches: batches whose mean loss is the final evaluation loss.
      optimizer: makes the inner optimizer (a fresh one per run).
      steps: training steps.
    """

    name: str
    description: str
    params: PyTree
    loss_fn: Callable[[PyTree, Any, Any], jax.Array]
    batches: Any
    eval_batches: list
    optimizer: Callable[[], optax.GradientTransformation]
    steps: int


def cnn_workload(steps: int) -> Workload:
    cnn_digits = example("cnn_digits")
    args = cnn_digits.parse_args(["--steps", str(steps)])
    data = cnn_digits.make_data(args)
    images, labels = data["train"]
    params = cnn_digits.CNN().init(jax.random.key(args.seed), images[:1])["params"]

    def loss_fn(params, batch, dtype):
        x, y = batch
        logits = cnn_digits.CNN(dtype=dtype).apply({"params": params}, x.astype(dtype))
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return Workload(
        name="digits CNN",
        description="examples/cnn_digits.py: 2 conv + 2 dense, batch 64, Adam 2e-3",
        params=params,
        loss_fn=loss_fn,
        batches=[(images[i], labels[i]) for i in data["batches"]],
        eval_batches=[data["test"]],
        optimizer=lambda: optax.adam(args.lr),
        steps=steps,
    )


def lm_workload(steps: int) -> Workload:
    nnx_lm = example("nnx_lm")
    args = nnx_lm.parse_args(["--steps", str(steps)])
    data = nnx_lm.make_data(args)
    sizes = (args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    graphdefs = {}

    def module(dtype):
        # One graph per compute dtype; the params are the float32 ones either way.
        key = jnp.dtype(dtype).name
        if key not in graphdefs:
            model = nnx_lm.TransformerLM(*sizes, dtype=dtype, rngs=nnx.Rngs(args.seed))
            graphdefs[key] = nnx.split(model)
        return graphdefs[key]

    params = module(jnp.float32)[1]

    def loss_fn(params, batch, dtype):
        model = nnx.merge(module(dtype)[0], params)
        logits = model(batch[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, steps // 10 + 1, steps)
    return Workload(
        name="stdlib LM",
        description=f"examples/nnx_lm.py: {args.layers}-layer transformer, d={args.dim}, vocab {args.vocab}, AdamW",
        params=params,
        loss_fn=loss_fn,
        batches=data["batches"],
        eval_batches=data["val"],
        optimizer=lambda: optax.adamw(schedule),
        steps=steps,
    )


def zipf_workload(steps: int) -> Workload:
    quickstart = example("quickstart")
    args = quickstart.parse_args(["--steps", str(steps)])
    data = quickstart.make_data(args)
    model, teacher_probs = data["model"], data["teacher_probs"]

    def loss_fn(params, tokens, dtype):
        return quickstart.cross_entropy(model, params, tokens, teacher_probs, dtype)

    return Workload(
        name="Zipf LM",
        description=f"examples/quickstart.py: vocab {args.vocab}, {args.tokens} tokens a batch, Adam {args.lr:g}",
        params=data["params"],
        loss_fn=loss_fn,
        batches=data["tokens"],
        eval_batches=[jnp.arange(args.num_inputs)],
        optimizer=lambda: optax.adam(args.lr),
        steps=steps,
    )


class _Regressor(nn.Module):
    """``examples/debug_overflow.py``'s model, with the compute dtype as a field."""

    dtype: Any = jnp.float16

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=self.dtype, name="encoder")(x))
        x = nn.relu(nn.Dense(64, dtype=self.dtype, name="hidden")(x))
        return nn.Dense(1, dtype=self.dtype, name="head")(x)


def regression_workload(steps: int, batch: int = 256) -> Workload:
    debug_overflow = example("debug_overflow")
    x, y = debug_overflow.make_data(4096, unnormalized=True)
    x_test, y_test = debug_overflow.make_data(1024, unnormalized=True, seed=1)
    params = _Regressor().init(jax.random.key(0), jnp.asarray(x[:1]))["params"]

    def loss_fn(params, batch, dtype):
        xb, yb = batch
        pred = _Regressor(dtype=dtype).apply({"params": params}, xb.astype(dtype)).astype(jnp.float32)
        return jnp.mean((pred - yb) ** 2)

    starts = [(i * batch) % len(x) for i in range(steps)]
    return Workload(
        name="raw-column regression",
        description="examples/debug_overflow.py: MLP on data with one unnormalized column, Adam 1e-3",
        params=params,
        loss_fn=loss_fn,
        batches=[(jnp.asarray(x[s : s + batch]), jnp.asarray(y[s : s + batch])) for s in starts],
        eval_batches=[(jnp.asarray(x_test), jnp.asarray(y_test))],
        optimizer=lambda: optax.adam(1e-3),
        steps=steps,
    )


# name on the command line -> (builder, default steps)
WORKLOADS: dict[str, tuple[Callable[[int], Workload], int]] = {
    "cnn": (cnn_workload, 1500),
    "lm": (lm_workload, 400),
    "zipf": (zipf_workload, 60),
    "regression": (regression_workload, 1500),
}

# label -> (compute dtype, makes the loss-scaled optimizer from the inner one)
RULES: dict[str, tuple[Any, Callable[[optax.GradientTransformation], optax.GradientTransformation]]] = {
    # A static scale of 1 with track_underflow: float32 training, plus what
    # float16 without scaling would have flushed.
    "float32": (jnp.float32, lambda inner: ls.static(inner, 1.0, track_underflow=True)),
    "torch rule": (jnp.float16, lambda inner: ls.presets.torch(inner, track_underflow=True)),
    "ls.predictive": (jnp.float16, lambda inner: ls.predictive(inner, track_underflow=True)),
}


def train(workload: Workload, rule: str) -> dict[str, Any]:
    """One run: returns its totals and per-step history."""
    dtype, wrap = RULES[rule]
    tx = wrap(workload.optimizer())
    params = jax.tree.map(jnp.copy, workload.params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = ls.value_and_grad(workload.loss_fn)(opt_state, params, batch, dtype)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        state = ls.find_state(opt_state)
        return params, opt_state, (loss, state.scale, state.skipped, state.below_normal_fraction, state.zero_fraction)

    @jax.jit
    def eval_loss(params, batch):
        return workload.loss_fn(params, batch, jnp.float32)

    history = []
    start = time.perf_counter()
    for i in range(workload.steps):
        params, opt_state, out = step(params, opt_state, workload.batches[i])
        history.append(out)
    history = jax.device_get(history)
    seconds = time.perf_counter() - start
    losses, scales, skipped, below, zeros = (np.array(column) for column in zip(*history, strict=True))
    applied = ~skipped
    final = float(np.mean([float(eval_loss(params, b)) for b in workload.eval_batches]))
    headroom = ls.metrics(opt_state, prefix="").get("headroom")
    tail = max(1, workload.steps // 10)
    return {
        "skipped_steps": int(skipped.sum()),
        "below_normal": float(np.mean(below[applied])) if applied.any() else None,
        "zero": float(np.mean(zeros[applied])) if applied.any() else None,
        "eval_loss": final,
        "train_loss_tail": float(np.mean(losses[-tail:][np.isfinite(losses[-tail:])])),
        "final_scale": float(scales[-1]) if dtype == jnp.float16 else None,
        "headroom": None if headroom is None else int(headroom),
        "seconds": seconds,
        "scales": scales.tolist(),
        "skipped": skipped.tolist(),
        "below_normal_history": below.tolist(),
        "losses": losses.tolist(),
    }


# ---------------------------------------------------------------------------
# A float16 model in miniature, for runs longer than the examples
# ---------------------------------------------------------------------------

F16_MAX = 65504.0


def drifting_gradients(steps: int, noise: float = 0.25, seed: int = 0) -> np.ndarray:
    """The largest parameter gradient of each step of a made-up run: down 30x
    over the run with two slow rises (5x and 9x), times log-normal
    step-to-step noise with standard deviation ``noise``."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, steps)
    bumps = 1 + 4 * np.exp(-(((t - 0.3) / 0.05) ** 2)) + 8 * np.exp(-(((t - 0.7) / 0.08) ** 2))
    return (1e-2 * 30.0 ** (-t) * bumps * np.exp(rng.normal(size=steps) * noise)).astype(np.float32)


def simulate(rule: Any, true_max: np.ndarray, amplification: float) -> tuple[np.ndarray, np.ndarray]:
    """Runs a scale rule (``loss_scale._rules``' ``DynamicRule`` or
    ``PredictiveRule``) against a simulated float16 backward pass: a step
    overflows when its largest value, ``amplification`` times the largest
    parameter gradient, exceeds float16's maximum once scaled. Returns the
    scale each step ran at and whether it overflowed."""

    def step(counters, g):
        finite = counters.scale * g * amplification <= F16_MAX
        new = rule.adjust(counters, finite, jnp.where(finite, g, jnp.inf))
        return new, (counters.scale, ~finite)

    _, (scales, overflowed) = jax.lax.scan(step, rule.init(), jnp.asarray(true_max, jnp.float32))
    return np.asarray(scales), np.asarray(overflowed)


SIMULATIONS = (  # (steps, noise, amplification)
    (40000, 0.05, 40.0),
    (40000, 0.05, 3000.0),
    (20000, 0.25, 40.0),
    (20000, 0.25, 3000.0),
)


def simulation_table() -> str:
    """Skipped steps and median headroom of both rules on the simulated runs."""
    from loss_scale._rules.dynamic import DynamicRule
    from loss_scale._rules.predictive import PredictiveRule

    torch_rule = DynamicRule(initial_scale=2.0**16, min_scale=2.0**-30, max_scale=math.inf)
    rows = []
    for steps, noise, amplification in SIMULATIONS:
        grads = drifting_gradients(steps, noise)
        cells = []
        for rule in (torch_rule, PredictiveRule()):
            scales, skipped = simulate(rule, grads, amplification)
            headroom = np.log2(F16_MAX / (scales * grads * amplification))[100:]
            cells.append((int(skipped.sum()), float(np.median(headroom))))
        (a, ha), (b, hb) = cells
        rows.append([f"noise {noise}, amplification {amplification:g}", steps, f"{a} / {b} = {a / max(b, 1):.1f}x",
                     f"{ha:.1f} / {hb:.1f}"])  # fmt: skip
    headers = [
        "simulated run", "steps", "skipped: torch rule / ls.predictive", "median headroom (binades): torch / predictive"
    ]  # fmt: skip
    return tables.markdown(headers, rows)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


RUN_HEADERS = (
    "workload", "steps", "rule", "skipped steps", "below f16 normal", "exactly 0", "eval loss", "final scale",
    "headroom",
)  # fmt: skip
SUMMARY_HEADERS = ("workload", "skipped: torch rule / ls.predictive", "eval loss: ls.predictive - torch rule")


def format_table(results: dict[str, Any]) -> str:
    """Every run, then the torch rule against ls.predictive per workload."""
    rows = []
    for name, workload in results["workloads"].items():
        for rule, run in workload["runs"].items():
            rows.append([
                name, workload["steps"], rule, run["skipped_steps"] if rule != "float32" else "-",
                _fmt(run["below_normal"], ".2%"), _fmt(run["zero"], ".2%"), f"{run['eval_loss']:.4f}",
                _fmt(run["final_scale"], "g"), _fmt(run["headroom"], "d"),
            ])  # fmt: skip
    summary = []
    for name, workload in results["workloads"].items():
        runs = workload["runs"]
        torch_rule, predictive = runs["torch rule"], runs["ls.predictive"]
        a, b = torch_rule["skipped_steps"], predictive["skipped_steps"]
        ratio = f"{a} / {b}" + (f" = {a / b:.1f}x" if b else (" (none skipped by ls.predictive)" if a else ""))
        summary.append([name, ratio, f"{predictive['eval_loss'] - torch_rule['eval_loss']:+.4f}"])
    return tables.markdown(RUN_HEADERS, rows) + "\n\n" + tables.markdown(SUMMARY_HEADERS, summary)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    steps = ", ".join(f"{key} {default}" for key, (_, default) in WORKLOADS.items())
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--steps-factor", type=float, default=1.0, help=f"multiply every workload's steps ({steps})")
    parser.add_argument("--quick", action="store_true", help="6 steps of each workload, no simulation: a smoke test")
    parser.add_argument("--json", metavar="PATH", help="write the results (with per-step histories) to PATH")
    cli.add_out(parser, "predictive")
    args = parser.parse_args(argv)
    args.workloads = cli.split(args.workloads)
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    if not args.steps_factor > 0:
        parser.error("--steps-factor must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = provenance.environment(__file__, argv)
    report = tables.Report()
    results: dict[str, Any] = {"header": provenance.header(env), "environment": env, "workloads": {}}
    report.print(results["header"])
    start = time.perf_counter()
    for key in args.workloads:
        build, default_steps = WORKLOADS[key]
        steps = 6 if args.quick else max(1, round(default_steps * args.steps_factor))
        workload = build(steps)
        runs = {rule: train(workload, rule) for rule in RULES}
        results["workloads"][workload.name] = {"steps": steps, "description": workload.description, "runs": runs}
        seconds = sum(run["seconds"] for run in runs.values())
        report.print(f"{workload.name}: {workload.description}, {steps} steps ({seconds:.0f} s)")
    results["wall_s"] = time.perf_counter() - start
    report.print("\n" + format_table(results))
    if not args.quick:
        results["simulation"] = simulation_table()
        report.print("\n" + results["simulation"])
    report.print(f"\nwall time {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    if args.out is not None:
        report.save(args.out or tables.default_out("predictive", env["backend"]))
    return results


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Predictive loss scaling against the torch rule, on the example workloads.

Each workload is trained in float16 compute (float32 params, float16 forward
and backward, float32 loss) from the same initialization and batches with:

* ``torch rule``: ``ls.presets.torch(adam)``, torch.amp.GradScaler's rule and
  defaults (start at 2**16, halve on overflow, double after 2000 clean steps);
* ``ls.predictive``: ``ls.predictive(adam)`` with its defaults;
* ``ls.predictive + peak``: ``ls.predictive(adam, initial_scale=1.0)`` with
  the largest value of the whole backward pass measured every 16 steps
  (``ls.value_grad_and_peak(loss_fn, every=16)``) and passed on as
  ``backward_peak=``;

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
  unnormalized input column, whose gradients overflow float16 at high scales;
* ``amplified MLP``: a float16 MLP whose output passes through ``(z / k) *
  k`` with k = 4096 a runtime value, so that the backward pass's largest
  value is 4096 times the cotangent around it (``tests/test_predictive.py``'s
  model, on batches of a larger data set).

The simulated runs (a float16 backward pass in miniature, see ``simulate``)
compare the three rules over 20000-40000 steps.

``--timing`` times instead a training step of ``examples/nnx_lm.py``'s
transformer (float16 compute, ``ls.predictive`` + ``ls.apply_gradients``)
with ``ls.value_and_grad`` (not measuring) and with
``ls.value_grad_and_peak`` measuring every 16 steps (in the step, where a
``lax.cond`` on ``good_steps`` picks the evaluation; or from Python, calling
a second jitted step that measures on every 16th step) and every step: each
round runs 16 steps of every variant, interleaved, and the table gives the
paired per-round ratios to not measuring (median and 95% CI).

Usage::

    python benchmarks/predictive.py --out           # ~10 minutes on 2 CPU cores
    python benchmarks/predictive.py --steps-factor 0.2 --workloads cnn,regression
    python benchmarks/predictive.py --quick         # a smoke test, seconds
    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
        python benchmarks/predictive.py --timing --rounds 20 --out   # the measuring cost
    python benchmarks/predictive.py --timing --quick    # a smoke test of --timing

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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, provenance, tables, timing  # noqa: E402

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


def lm_workload(steps: int, sizes: Sequence[str] = ()) -> Workload:
    """``sizes``: more of ``examples/nnx_lm.py``'s flags (``--dim 16``...)."""
    nnx_lm = example("nnx_lm")
    args = nnx_lm.parse_args(["--steps", str(steps), *sizes])
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


def amplified_workload(steps: int, batch: int = 256, k: float = 2.0**12) -> Workload:
    """A float16 MLP whose output passes through ``(z / k) * k``, k a runtime
    value (in the batch, so that XLA cannot fold it away): between the two
    multiplications the backward pass's values are k times larger than
    around them."""
    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(16, 1))
    x = rng.normal(size=(4096 + 1024, 16)).astype(np.float32)
    y = (x @ teacher).astype(np.float32)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32), "w2": jnp.zeros((32, 1), jnp.float32)}

    def loss_fn(params, batch, dtype):
        xb, yb, kb = batch
        h = jnp.tanh(xb.astype(dtype) @ params["w1"].astype(dtype))
        z = h @ params["w2"].astype(dtype)
        pred = ((z / kb.astype(dtype)) * kb.astype(dtype)).astype(jnp.float32)
        return jnp.mean((pred - yb) ** 2)

    kk = jnp.float32(k)
    starts = [(i * batch) % 4096 for i in range(steps)]
    return Workload(
        name="amplified MLP",
        description=f"a float16 MLP whose backward pass amplifies an intermediate {k:g}x, batch {batch}, Adam 1e-2",
        params=params,
        loss_fn=loss_fn,
        batches=[(jnp.asarray(x[s : s + batch]), jnp.asarray(y[s : s + batch]), kk) for s in starts],
        eval_batches=[(jnp.asarray(x[4096:]), jnp.asarray(y[4096:]), kk)],
        optimizer=lambda: optax.adam(1e-2),
        steps=steps,
    )


# name on the command line -> (builder, default steps)
WORKLOADS: dict[str, tuple[Callable[[int], Workload], int]] = {
    "cnn": (cnn_workload, 1500),
    "lm": (lm_workload, 400),
    "zipf": (zipf_workload, 60),
    "regression": (regression_workload, 1500),
    "amplified": (amplified_workload, 300),
}

# Measured backward peaks: every this many steps (ls.value_grad_and_peak's default).
MEASURE_EVERY = 16
MEASURED = "ls.predictive + peak"


@dataclasses.dataclass(frozen=True)
class Rule:
    """A column of the tables.

    Attributes:
      dtype: the compute dtype.
      wrap: makes the loss-scaled optimizer from the inner one.
      measure_every: measure the backward peak every this many steps
        (``ls.value_grad_and_peak``), or ``None`` (``ls.value_and_grad``).
    """

    dtype: Any
    wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation]
    measure_every: int | None = None


RULES: dict[str, Rule] = {
    # A static scale of 1 with track_underflow: float32 training, plus what
    # float16 without scaling would have flushed.
    "float32": Rule(jnp.float32, lambda inner: ls.static(inner, 1.0, track_underflow=True)),
    "torch rule": Rule(jnp.float16, lambda inner: ls.presets.torch(inner, track_underflow=True)),
    "ls.predictive": Rule(jnp.float16, lambda inner: ls.predictive(inner, track_underflow=True)),
    # The first step measures at a scale that cannot overflow.
    MEASURED: Rule(
        jnp.float16, lambda inner: ls.predictive(inner, initial_scale=1.0, track_underflow=True), MEASURE_EVERY
    ),
}


def train(workload: Workload, rule: str) -> dict[str, Any]:
    """One run: returns its totals and per-step history."""
    spec = RULES[rule]
    dtype = spec.dtype
    tx = spec.wrap(workload.optimizer())
    params = jax.tree.map(jnp.copy, workload.params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        if spec.measure_every is None:
            loss, grads = ls.value_and_grad(workload.loss_fn)(opt_state, params, batch, dtype)
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        else:
            value_grad = ls.value_grad_and_peak(workload.loss_fn, every=spec.measure_every)
            loss, grads, peak = value_grad(opt_state, params, batch, dtype)
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, backward_peak=peak)
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
# A float16 model in miniature, for runs longer than the examples (the tests
# run the rules on a copy, tests/_simulation.py, that needs no flax;
# tests/test_benchmarks.py checks that the two simulate the same runs)
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


SIMULATIONS = (  # (steps, noise, amplification)
    (40000, 0.05, 40.0),
    (40000, 0.05, 3000.0),
    (20000, 0.25, 40.0),
    (20000, 0.25, 3000.0),
)


def simulation_runs() -> list[dict[str, Any]]:
    """Skipped steps and median headroom (binades between each step's
    largest value and float16's maximum, after the first 100 steps) of the
    torch rule, ``ls.predictive`` and ``ls.predictive`` with measured peaks
    (``initial_scale=1.0``, every ``MEASURE_EVERY`` steps) on the simulated
    runs."""
    from loss_scale._rules.dynamic import DynamicRule
    from loss_scale._rules.predictive import PredictiveRule

    rules = {
        "torch rule": (DynamicRule(initial_scale=2.0**16, min_scale=2.0**-30, max_scale=math.inf), None),
        "ls.predictive": (PredictiveRule(), None),
        MEASURED: (PredictiveRule(initial_scale=1.0), MEASURE_EVERY),
    }
    runs = []
    for steps, noise, amplification in SIMULATIONS:
        grads = drifting_gradients(steps, noise)
        run: dict[str, Any] = {"steps": steps, "noise": noise, "amplification": amplification}
        for label, (rule, every) in rules.items():
            scales, skipped = simulate(rule, grads, amplification, every)
            headroom = np.log2(F16_MAX / (scales * grads * amplification))[100:]
            run[label] = {"skipped_steps": int(skipped.sum()), "median_headroom": float(np.median(headroom))}
        runs.append(run)
    return runs


def _times_fewer(a: int, b: int) -> str:
    return f"{a} / {b}" + (f" = {a / b:.1f}x" if b else (" (none skipped)" if a else ""))


def simulation_table(runs: list[dict[str, Any]] | None = None) -> str:
    """The simulated runs as a table (``simulation_runs``)."""
    rows = []
    for run in runs if runs is not None else simulation_runs():
        torch_rule, predictive, measured = (run[k] for k in ("torch rule", "ls.predictive", MEASURED))
        rows.append([
            f"noise {run['noise']}, amplification {run['amplification']:g}", run["steps"],
            _times_fewer(torch_rule["skipped_steps"], predictive["skipped_steps"]),
            _times_fewer(torch_rule["skipped_steps"], measured["skipped_steps"]),
            " / ".join(f"{r['median_headroom']:.1f}" for r in (torch_rule, predictive, measured)),
        ])  # fmt: skip
    return tables.markdown(SIMULATION_HEADERS, rows)


SIMULATION_HEADERS = (
    "simulated run", "steps", "skipped: torch rule / ls.predictive", f"skipped: torch rule / {MEASURED}",
    f"median headroom (binades): torch / predictive / {MEASURED}",
)  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


RUN_HEADERS = (
    "workload", "steps", "rule", "skipped steps", "below f16 normal", "exactly 0", "eval loss", "final scale",
    "headroom",
)  # fmt: skip
SUMMARY_HEADERS = (
    "workload", "skipped: torch rule / ls.predictive", f"skipped: torch rule / {MEASURED}",
    "eval loss: ls.predictive - torch rule", f"eval loss: {MEASURED} - torch rule",
)  # fmt: skip


def format_table(results: dict[str, Any]) -> str:
    """Every run, then the torch rule against both predictive columns per
    workload."""
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
        torch_rule, predictive, measured = runs["torch rule"], runs["ls.predictive"], runs[MEASURED]
        a = torch_rule["skipped_steps"]
        summary.append([
            name, _times_fewer(a, predictive["skipped_steps"]), _times_fewer(a, measured["skipped_steps"]),
            f"{predictive['eval_loss'] - torch_rule['eval_loss']:+.4f}",
            f"{measured['eval_loss'] - torch_rule['eval_loss']:+.4f}",
        ])  # fmt: skip
    return tables.markdown(RUN_HEADERS, rows) + "\n\n" + tables.markdown(SUMMARY_HEADERS, summary)


# ---------------------------------------------------------------------------
# --timing: what measuring costs on a transformer's training step
# ---------------------------------------------------------------------------

NOT_MEASURING = "not measuring (ls.value_and_grad)"
# Measuring every 16 steps either inside the step (a lax.cond on good_steps)
# or by calling a second jitted step, which measures every time, on every
# 16th step from Python: no conditional in the plain step.
IN_PYTHON = "python"
MEASURE_EVERY = 16
TIMING_VARIANTS = {
    NOT_MEASURING: None,
    f"measuring every {MEASURE_EVERY} steps (lax.cond in the step)": MEASURE_EVERY,
    f"measuring every {MEASURE_EVERY}th step, chosen in Python": IN_PYTHON,
    "measuring every step": 1,
}
# examples/nnx_lm.py's flags for --timing --quick: a tiny transformer.
TINY_LM = ("--dim", "16", "--heads", "2", "--layers", "1", "--seq-len", "16", "--batch-size", "4", "--vocab", "256",
           "--max-bytes", "200000", "--val-batches", "1")  # fmt: skip
TIMING_HEADERS = ("variant", "ms per step (median)", "× not measuring, median [95% CI]", "compile s", "skipped steps")


def timing_results(rounds: int, warmup: int, block: int, quick: bool) -> dict[str, Any]:
    """Times ``block`` training steps of each variant per round, interleaved
    (``timing.round_robin``): examples/nnx_lm.py's transformer in float16
    compute, ``ls.predictive(adamw, initial_scale=1.0)`` and
    ``ls.apply_gradients`` (params and state donated), with the gradients of
    ``ls.value_and_grad`` or ``ls.value_grad_and_peak(every=...)``. Each
    variant carries its own params and state from block to block, so that
    its ``good_steps``, and with it which steps measure, advance as in
    training (every 16 steps: one measuring step in each block of 16)."""
    workload = lm_workload(max(block, 8), TINY_LM if quick else ())
    batches = workload.batches

    def make_step(every: int | None) -> Callable:
        tx = ls.predictive(workload.optimizer(), initial_scale=1.0)

        def step(params, opt_state, batch):
            if every is None:
                _, grads = ls.value_and_grad(workload.loss_fn)(opt_state, params, batch, jnp.float16)
                return ls.apply_gradients(tx, grads, opt_state, params)
            _, grads, peak = ls.value_grad_and_peak(workload.loss_fn, every=every)(
                opt_state, params, batch, jnp.float16
            )
            return ls.apply_gradients(tx, grads, opt_state, params, backward_peak=peak)

        return tx, step

    carried, compiled, compile_s = {}, {}, {}
    for name, every in TIMING_VARIANTS.items():
        # The Python-chosen variant: the plain step and one that measures every time.
        steps = [make_step(None), make_step(1)] if every == IN_PYTHON else [make_step(every)]
        params = jax.tree.map(jnp.copy, workload.params)
        opt_state = steps[0][0].init(params)
        compiled[name], compile_s[name] = [], 0.0
        for _, step in steps:
            fn, times = timing.compile_timed(
                step, (params, opt_state, batches[0]), donate_argnums=(0, 1),
                compiler_options=timing.quick_compiler_options() if quick else None,
            )  # fmt: skip
            compiled[name].append(fn)
            compile_s[name] += times.total_s
        carried[name] = (params, opt_state)
    counter = {name: 0 for name in TIMING_VARIANTS}

    def call(name: str) -> None:
        params, opt_state = carried[name]
        for _ in range(block):
            # One function, or the measuring one on every MEASURE_EVERY-th step.
            measure = len(compiled[name]) > 1 and counter[name] % MEASURE_EVERY == 0
            fn = compiled[name][1] if measure else compiled[name][0]
            params, opt_state = fn(params, opt_state, batches[counter[name] % len(batches)])
            counter[name] += 1
        carried[name] = jax.block_until_ready((params, opt_state))

    times = timing.round_robin(call, list(TIMING_VARIANTS), rounds, warmup)
    rows = []
    for name in TIMING_VARIANTS:
        stats = timing.ratio_stats(times[name], times[NOT_MEASURING])
        skipped = int(ls.find_state(carried[name][1]).skipped_steps)
        rows.append({"variant": name, "ratio": stats, "ms_per_step": stats["median_ms"] / block,
                     "compile_s": compile_s[name], "skipped_steps": skipped, "steps": counter[name]})  # fmt: skip
    return {"workload": workload.description, "rounds": rounds, "warmup": warmup, "block": block, "rows": rows}


def timing_table(result: dict[str, Any]) -> str:
    rows = [
        [
            row["variant"],
            f"{row['ms_per_step']:.2f}",
            tables.ratio(row["ratio"]),
            f"{row['compile_s']:.1f}",
            f"{row['skipped_steps']} of {row['steps']}",
        ]  # fmt: skip
        for row in result["rows"]
    ]
    note = (
        f"{result['workload']}, float16 compute; {result['rounds']} rounds of {result['block']} steps of each "
        f"variant, interleaved, after {result['warmup']} warm-up rounds. Ratios: per round, the variant's time "
        "over not measuring's in that round; the median over rounds and a distribution-free 95% confidence "
        "interval of it (order statistics; with fewer than 6 rounds, the range)."
    )
    return note + "\n\n" + tables.markdown(TIMING_HEADERS, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    steps = ", ".join(f"{key} {default}" for key, (_, default) in WORKLOADS.items())
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--steps-factor", type=float, default=1.0, help=f"multiply every workload's steps ({steps})")
    parser.add_argument(
        "--quick", action="store_true",
        help="6 steps of each workload, no simulation (with --timing: a tiny transformer, 2 rounds): a smoke test",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results (with per-step histories) to PATH")
    parser.add_argument(
        "--timing", action="store_true",
        help="time the transformer's training step measuring every 16 steps (in the step or from Python) and every "
        "step against not "
        "measuring, instead of training the workloads",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None, help="--timing: timed rounds (default: 20; --quick: 2)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="--timing: untimed rounds first (default: 2; --quick: 1)"
    )
    parser.add_argument("--block", type=int, default=16, help="--timing: steps of each variant per round")
    cli.add_out(parser, "predictive")
    args = parser.parse_args(argv)
    args.workloads = cli.split(args.workloads)
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    if not args.steps_factor > 0:
        parser.error("--steps-factor must be > 0")
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.rounds < 1 or args.warmup < 0 or args.block < 1:
        parser.error("--rounds and --block must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = provenance.environment(__file__, argv)
    report = tables.Report()
    results: dict[str, Any] = {"header": provenance.header(env), "environment": env, "workloads": {}}
    report.print(results["header"])
    start = time.perf_counter()
    if args.timing:
        if not timing.tuned_malloc_in_effect():
            report.print(f"(malloc at glibc's defaults; for steadier CPU timings run with {timing.malloc_flag_help()})")
        results["timing"] = timing_results(args.rounds, args.warmup, args.block, args.quick)
        report.print("\n" + timing_table(results["timing"]))
    else:
        for key in args.workloads:
            build, default_steps = WORKLOADS[key]
            steps = 6 if args.quick else max(1, round(default_steps * args.steps_factor))
            workload = build(steps)
            runs = {rule: train(workload, rule) for rule in RULES}
            results["workloads"][workload.name] = {"steps": steps, "description": workload.description, "runs": runs}
            seconds = sum(run["seconds"] for run in runs.values())
            report.print(f"{workload.name}: {workload.description}, {steps} steps ({seconds:.0f} s)")
        report.print("\n" + format_table(results))
        if not args.quick:
            results["simulation_runs"] = simulation_runs()
            results["simulation"] = simulation_table(results["simulation_runs"])
            report.print("\n" + results["simulation"])
    results["wall_s"] = time.perf_counter() - start
    report.print(f"\nwall time {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    if args.out is not None:
        script = "predictive_timing" if args.timing else "predictive"
        report.save(args.out or tables.default_out(script, env["backend"]))
    return results


if __name__ == "__main__":
    timing.fresh_compiles()
    main()

#!/usr/bin/env python
"""bfloat16/float16 parameters and optimizer state with ``ls.low_precision``
against float32 master weights: accuracy, memory and cost.

Models: the transformer LM and the MLP of ``_harness/models.py``, on real
data: the LM reads ASCII bytes of the running interpreter's standard-library
sources (next-byte prediction, held-out bytes for evaluation), the MLP
classifies scikit-learn's 8x8 digits (a fixed train/test split). AdamW with
a warmup and a cosine decay to zero, fixed seeds: the same initialization
and batches for every setup.

Setups (``SETUPS``):

* ``float32``: float32 params, float32 AdamW, float32 compute: the reference.
* ``bf16 nearest`` / ``bf16 kahan`` / ``bf16 stochastic``: bfloat16 params,
  ``ls.low_precision(adamw, rounding, state_dtype=jnp.bfloat16)``; the
  model computes in float32 (the harness casts the params up in the loss),
  so these runs differ from the reference only in how the params and the
  moments are stored and rounded.
* ``f16 master + ls.dynamic``: mixed precision as this library does it
  without ``low_precision``: float32 params and AdamW, float16 compute
  (the harness's ``mixed`` precision), ``ls.dynamic``.
* ``f16 nearest + ls.dynamic`` / ``f16 kahan + ls.dynamic``: float16 params,
  ``ls.dynamic(ls.low_precision(adamw, rounding, state_dtype=jnp.bfloat16))``,
  float16 compute.

Parts (``--parts``):

* ``accuracy``: trains every setup; the final held-out loss (and the MLP's
  test accuracy) and the gap to ``float32``'s.
* ``memory``: bytes per parameter of the params and of the optimizer state
  (everything the optimizer keeps besides the params the model runs with:
  float32 master weights count there), measured from the arrays; and XLA's
  planned temporary memory of the compiled train step
  (``jax.jit(step).lower(...).compile().memory_analysis()``, params and
  state donated), against float32 master weights with float32 AdamW.
* ``cost``: the jitted train step of ``kahan`` and ``stochastic`` against the
  same step with ``nearest`` rounding (bfloat16 params, no loss scaling;
  interleaved rounds, ratios paired by round with their 95% CI).

Usage::

    python benchmarks/low_precision.py --parts accuracy,memory --out   # ~4 min on 2 CPU cores
    python benchmarks/low_precision.py --parts cost --out PATH          # timing: run on an idle machine
    python benchmarks/low_precision.py --quick                          # a smoke test, seconds

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, models, provenance, tables, timing  # noqa: E402

import loss_scale as ls  # noqa: E402

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
PARTS = ("accuracy", "memory", "cost")
MODELS = ("transformer", "mlp")


class Setup(NamedTuple):
    """How one run stores and updates its params."""

    param_dtype: Any  # the params' dtype
    precision: str  # the harness model's compute precision: "f32" or "mixed" (float16)
    rounding: str | None  # ls.low_precision's rounding; None: the optimizer alone
    scaled: bool  # ls.dynamic around the optimizer


SETUPS = {
    "float32": Setup(F32, "f32", None, False),
    "bf16 nearest": Setup(BF16, "f32", "nearest", False),
    "bf16 kahan": Setup(BF16, "f32", "kahan", False),
    "bf16 stochastic": Setup(BF16, "f32", "stochastic", False),
    "f16 master + ls.dynamic": Setup(F32, "mixed", None, True),
    "f16 nearest + ls.dynamic": Setup(F16, "mixed", "nearest", True),
    "f16 kahan + ls.dynamic": Setup(F16, "mixed", "kahan", True),
}


def fresh_params(workload_params: Any, dtype: Any) -> Any:
    """The workload's params in ``dtype``, new arrays (the steps donate them)."""
    return jax.tree.map(jnp.copy, models.cast(workload_params, dtype))


def make_tx(setup: Setup, schedule: Any, state_dtype: Any = BF16) -> optax.GradientTransformation:
    tx = optax.adamw(schedule, weight_decay=0.01)
    if setup.rounding is not None:
        tx = ls.low_precision(tx, setup.rounding, state_dtype=state_dtype)
    return ls.dynamic(tx) if setup.scaled else tx


def make_step(loss_fn: Callable, tx: optax.GradientTransformation, scaled: bool) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def step(params, opt_state, batch):
        if scaled:
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, batch)
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return step


def make_update(tx: optax.GradientTransformation, scaled: bool) -> Callable:
    """``update(params, opt_state, grads) -> (params, opt_state)``: the optimizer step alone."""

    def update(params, opt_state, grads):
        if scaled:
            return ls.apply_gradients(tx, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


# ---------------------------------------------------------------------------
# Workloads: a harness model and real data
# ---------------------------------------------------------------------------


class Workload(NamedTuple):
    """A harness model (float32 params, one loss per precision) on real data."""

    name: str
    description: str
    params: Any
    loss_fns: dict[str, Callable]  # precision -> loss_fn(params, batch)
    batches: Callable[[int], Any]  # step -> training batch
    eval_batches: list[Any]
    accuracy: Callable[[Any, Any], float] | None


def stdlib_bytes(limit: int) -> np.ndarray:
    """ASCII bytes of the standard library's sources (sorted top-level modules)."""
    chunks, size = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_path("stdlib")).glob("*.py")):
        data = np.frombuffer(path.read_bytes(), np.uint8)
        chunks.append(data[data < 128])
        size += chunks[-1].size
        if size >= limit:
            break
    return np.concatenate(chunks)[:limit]


TRANSFORMER = {
    "quick": {"vocab": 128, "d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 4},
    "default": {"vocab": 128, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "batch_size": 16},
}
MLP = {"quick": ((64, 32, 10), 16), "default": ((64, 256, 256, 10), 64)}


def transformer(size: str) -> Workload:
    config = TRANSFORMER[size]
    text = stdlib_bytes(300_000 if size == "default" else 20_000)
    split = int(text.size * 0.9)
    train_text, eval_text = text[:split], text[split:]
    window = config["seq_len"] + 1
    built = {p: models.make_transformer(p, **config) for p in ("f32", "mixed")}

    def windows(source: np.ndarray, seed: int, n: int) -> jax.Array:
        starts = np.random.default_rng(seed).integers(0, source.size - window, n)
        return jnp.asarray(np.stack([source[s : s + window] for s in starts]).astype(np.int32))

    return Workload(
        "transformer",
        f"{built['f32'].description.split(', batch')[0]} on {text.size // 1000}k bytes of stdlib source "
        f"(90% train, 10% held out), batch {config['batch_size']}",
        built["f32"].params,
        {p: m.loss_fn for p, m in built.items()},
        lambda step: windows(train_text, step, config["batch_size"]),
        [windows(eval_text, 10_000 + i, 64) for i in range(4)],
        None,
    )


def mlp(size: str) -> Workload:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    sizes, batch_size = MLP[size]
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32), test_size=0.25, random_state=0
    )
    built = {p: models.make_mlp(p, sizes, batch_size) for p in ("f32", "mixed")}

    def batches(step: int) -> dict[str, jax.Array]:
        rows = np.random.default_rng(step).choice(len(y_train), batch_size, replace=False)
        return {"x": jnp.asarray(x_train[rows]), "y": jnp.asarray(y_train[rows])}

    def accuracy(params: Any, batch: Any) -> float:
        layers = [models.cast(layer, F32) for layer in params]
        logits = models._mlp_forward([(layer["w"], layer["b"]) for layer in layers], batch["x"])
        return float(jnp.mean(jnp.argmax(logits, -1) == batch["y"]))

    return Workload(
        "mlp",
        f"{built['f32'].description.split(', batch')[0]} on scikit-learn's digits (1347 train, 450 test), "
        f"batch {batch_size}",
        built["f32"].params,
        {p: m.loss_fn for p, m in built.items()},
        batches,
        [{"x": jnp.asarray(x_test), "y": jnp.asarray(y_test)}],
        accuracy,
    )


WORKLOADS = {"transformer": transformer, "mlp": mlp}


# ---------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------


def evaluate(workload: Workload, params: Any) -> tuple[float, float | None]:
    """Held-out loss (float32 compute) and, for a classifier, accuracy."""
    params32 = models.cast(params, F32)
    loss = float(np.mean([_jitted(workload.loss_fns["f32"])(params32, b) for b in workload.eval_batches]))
    accuracy = None
    if workload.accuracy is not None:
        accuracy = float(np.mean([workload.accuracy(params32, b) for b in workload.eval_batches]))
    return loss, accuracy


_JITTED: dict[Callable, Callable] = {}


def _jitted(fn: Callable) -> Callable:
    """``jax.jit(fn)``, made once per function (evaluation compiles once per workload)."""
    return _JITTED.setdefault(fn, jax.jit(fn))


def compile_step(step: Callable, args: Sequence[Any], quick: bool) -> Any:
    """The step compiled with params and state donated; a smoke run asks
    XLA:CPU to optimize less (its compile dominates a smoke run)."""
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
    return lowered.compile(timing.quick_compiler_options() if quick and jax.default_backend() == "cpu" else None)


def train(workload: Workload, setup: Setup, steps: int, lr: float, quick: bool = False) -> dict[str, Any]:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, 0.0)
    tx = make_tx(setup, schedule)
    params = fresh_params(workload.params, setup.param_dtype)
    opt_state = tx.init(params)
    step_fn = make_step(workload.loss_fns[setup.precision], tx, setup.scaled)
    step = compile_step(step_fn, (params, opt_state, workload.batches(0)), quick)
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, workload.batches(i))
        losses.append(loss)
    eval_loss, accuracy = evaluate(workload, params)
    return {
        "eval_loss": eval_loss,
        "accuracy": accuracy,
        "final_train_loss": float(np.mean([float(x) for x in losses[-max(1, steps // 10) :]])),
        "skipped_steps": int(ls.find_state(opt_state).skipped_steps) if setup.scaled else 0,
        "param_dtype": str(jnp.dtype(setup.param_dtype)),
    }


def accuracy_table(name: str, runs: dict[str, Any], description: str, steps: int, lr: float) -> str:
    reference = runs["float32"]["eval_loss"]
    rows = []
    for label, run in runs.items():
        gap = 100 * (run["eval_loss"] - reference) / reference
        rows.append(
            [
                label,
                f"{run['eval_loss']:.4f}",
                f"{gap:+.2f}%",
                "-" if run["accuracy"] is None else f"{100 * run['accuracy']:.1f}%",
                run["skipped_steps"],
            ]
        )
    headers = ["setup", "held-out loss", "vs float32", "test accuracy", "skipped"]
    return (
        f"{name}: {description}; AdamW (weight decay 0.01), peak lr {lr:g}, warmup {max(1, steps // 20)} steps "
        f"and cosine decay to 0 over {steps} steps\n\n" + tables.markdown(headers, rows)
    )


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

# (label, setup, state_dtype): the optimizer-state layouts the memory table compares.
MEMORY_SETUPS = (
    ("float32 params, float32 AdamW", SETUPS["float32"], None),
    ("float32 master weights + float32 AdamW, float16 compute (ls.dynamic)", SETUPS["f16 master + ls.dynamic"], None),
    ("bf16 params, nearest, state bf16", SETUPS["bf16 nearest"], BF16),
    ("bf16 params, kahan, state bf16", SETUPS["bf16 kahan"], BF16),
    ("bf16 params, stochastic, state bf16", SETUPS["bf16 stochastic"], BF16),
    ("bf16 params, kahan, state float32", SETUPS["bf16 kahan"], F32),
    ("f16 params, kahan, state bf16 (ls.dynamic)", SETUPS["f16 kahan + ls.dynamic"], BF16),
)
BASELINE = MEMORY_SETUPS[1][0]


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def memory(name: str, size: str, quick: bool = False) -> dict[str, Any]:
    """Bytes per parameter and the compiled step's memory, on the harness's
    own model of ``size`` and its batch (what the step allocates does not
    depend on the data); compiled, not run."""
    built = {p: models.build(name, p, size) for p in ("f32", "mixed")}
    n = models.n_params(built["f32"].params)
    rows = {}
    for label, setup, state_dtype in MEMORY_SETUPS:
        model = built[setup.precision]
        tx = make_tx(setup, 1e-3, state_dtype)
        params = fresh_params(model.params, setup.param_dtype)
        opt_state = tx.init(params)
        compiled = compile_step(make_step(model.loss_fn, tx, setup.scaled), (params, opt_state, model.batch), quick)
        # The optimizer alone, on gradients of the params' dtype: its own temporaries.
        grads = jax.tree.map(jnp.zeros_like, params)
        update_only = compile_step(make_update(tx, setup.scaled), (params, opt_state, grads), quick)
        # float32 master weights are optimizer state: the params the model runs with are float16 copies.
        master = setup.param_dtype == F32 and setup.precision == "mixed"
        run_bytes = 2 * n if master else nbytes(params)
        rows[label] = {
            "param_bytes": run_bytes / n,
            "state_bytes": (nbytes(opt_state) + (nbytes(params) if master else 0)) / n,
            "memory": timing.memory_mib(compiled),
            "update_memory": timing.memory_mib(update_only),
        }
    return {"n_params": n, "description": built["f32"].description, "rows": rows}


def memory_table(name: str, measured: dict[str, Any]) -> str:
    base = measured["rows"][BASELINE]
    rows = []
    for label, row in measured["rows"].items():
        rows.append(
            [
                label,
                f"{row['param_bytes']:.2f}",
                f"{row['state_bytes']:.2f}",
                f"{row['param_bytes'] + row['state_bytes']:.2f}",
                tables.mib(row["memory"], base["memory"], "temp_mib"),
                tables.mib(row["memory"], base["memory"], "argument_mib"),
                tables.mib(row["update_memory"], base["update_memory"], "temp_mib"),
            ]
        )
    headers = [
        "setup",
        "param bytes/param",
        "optimizer-state bytes/param",
        "total bytes/param",
        "step temp MiB (Δ master)",
        "step arguments MiB (Δ master)",
        "update-only temp MiB (Δ master)",
    ]
    return (
        f"{name}: {measured['description']} (the harness's model and batch). For float32 master weights "
        "the params the model runs with are the float16 copies made in the loss (2 bytes, not kept between "
        "steps) and the master weights count as optimizer state\n\n" + tables.markdown(headers, rows)
    )


# ---------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------

COST_SETUPS = ("bf16 nearest", "bf16 kahan", "bf16 stochastic")


def cost(workload: Workload, rounds: int, warmup: int) -> dict[str, Any]:
    compiled, live = {}, {}
    for label in COST_SETUPS:
        setup = SETUPS[label]
        tx = make_tx(setup, 1e-4)
        params = fresh_params(workload.params, setup.param_dtype)
        opt_state = tx.init(params)
        batch = workload.batches(0)
        exe, _ = timing.compile_timed(
            make_step(workload.loss_fns[setup.precision], tx, False), (params, opt_state, batch), donate_argnums=(0, 1)
        )
        compiled[label], live[label] = exe, [params, opt_state, batch]

    def call(label: str) -> None:
        params, opt_state, batch = live[label]
        params, opt_state, loss = compiled[label](params, opt_state, batch)
        jax.block_until_ready(loss)
        live[label][:2] = [params, opt_state]

    seconds = timing.round_robin(call, COST_SETUPS, rounds=rounds, warmup=warmup)
    return {
        label: {
            "median_ms": statistics.median(seconds[label]) * 1e3,
            "vs_nearest": timing.ratio_stats(seconds[label], seconds["bf16 nearest"]),
        }
        for label in COST_SETUPS
    }


def harness_workload(name: str, size: str) -> Workload:
    """The harness's own model of ``size`` and its batch, as a workload the
    cost part can time (the data does not change what a step costs)."""
    built = models.build(name, "f32", size)
    return Workload(name, built.description, built.params, {"f32": built.loss_fn}, lambda step: built.batch, [], None)


def cost_table(name: str, measured: dict[str, Any], description: str) -> str:
    rows = [[label, f"{row['median_ms']:.2f}", tables.ratio(row["vs_nearest"])] for label, row in measured.items()]
    return f"{name}: {description}\n\n" + tables.markdown(["setup", "step ms", "vs nearest [95% CI]"], rows)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--parts", default="accuracy,memory", help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated accuracy setups")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 600 LM, 1500 MLP)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3 LM, 3e-4 MLP)")
    parser.add_argument(
        "--memory-size", default="default", choices=models.SIZES, help="the harness model size the memory part compiles"
    )
    parser.add_argument(
        "--cost-size",
        default="default",
        choices=("accuracy", *models.SIZES),
        help="what the cost part times: the harness model of that size (default), or the accuracy part's models",
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds of the cost part")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke test")
    cli.add_out(parser, "low_precision")
    args = parser.parse_args(argv)
    for name, value, known in [
        ("parts", args.parts, PARTS),
        ("models", args.models, MODELS),
        ("setups", args.setups, SETUPS),
    ]:
        unknown = [v for v in cli.split(value) if v not in known]
        if unknown:
            parser.error(f"unknown --{name} {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.quick:
        args.steps, args.rounds, args.warmup = args.steps or 6, 2, 1
    return args


DEFAULT_STEPS = {"transformer": 600, "mlp": 1500}
DEFAULT_LR = {"transformer": 1e-3, "mlp": 3e-4}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    size = "quick" if args.quick else "default"
    report = tables.Report()
    env = provenance.environment(__file__, argv)
    report.print(provenance.header(env))
    results: dict[str, Any] = {"environment": env, "models": {}}
    parts = cli.split(args.parts)
    for name in cli.split(args.models):
        workload = WORKLOADS[name](size)
        steps, lr = args.steps or DEFAULT_STEPS[name], args.lr or DEFAULT_LR[name]
        out = results["models"][name] = {"description": workload.description}
        if "accuracy" in parts:
            setups = ["float32", *(s for s in cli.split(args.setups) if s != "float32")]
            out["accuracy"] = {label: train(workload, SETUPS[label], steps, lr, args.quick) for label in setups}
            report.print()
            report.print(accuracy_table(name, out["accuracy"], workload.description, steps, lr))
        if "memory" in parts:
            out["memory"] = memory(name, "quick" if args.quick else args.memory_size, args.quick)
            report.print()
            report.print(memory_table(name, out["memory"]))
        if "cost" in parts:
            timed = workload
            if not args.quick and args.cost_size != "accuracy":
                timed = harness_workload(name, args.cost_size)
            out["cost"] = cost(timed, args.rounds, args.warmup)
            report.print()
            report.print(cost_table(name, out["cost"], timed.description))
    if args.out is not None:
        report.save(args.out or tables.default_out("low_precision", jax.default_backend()))
    return results


if __name__ == "__main__":
    timing.fresh_compiles()
    main()

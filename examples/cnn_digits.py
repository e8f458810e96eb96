#!/usr/bin/env python
"""A small CNN on scikit-learn's digits, trained with flax linen in four precisions.

The data set is the 8x8 handwritten digits that ship inside scikit-learn
(``sklearn.datasets.load_digits``: 1,797 images, nothing is downloaded). The
same CNN, data order and optimizer (Adam) are trained four times:

* ``float32``: the reference;
* ``bfloat16``: float32 params, bfloat16 compute, no loss scaling;
* ``float16, no scaling``: float32 params, float16 compute, scale 1;
* ``float16 + ls.dynamic``: the same, with dynamic loss scaling;

and the script prints, for each, the final training loss, the test loss and
accuracy, how far its training loss strays from the float32 run's at the
same step (same data, same initialization), the skipped steps, the final
scale and the time per step.

The training loop is the plain linen one: a ``flax.training.train_state.
TrainState`` whose ``tx`` comes from ``Policy.loss_scaling`` (``ls.dynamic``
for float16, ``ls.no_op`` otherwise), gradients from ``ls.value_and_grad``,
and ``state.apply_gradients``, which leaves the params and the optimizer
state as they were when a step is skipped.

Usage::

    python examples/cnn_digits.py                    # about half a minute on 2 CPU cores
    python examples/cnn_digits.py --steps 3000 --plot digits.png
    python examples/cnn_digits.py --precisions float16,float16+dynamic --steps 1000

From Python, ``main(["--steps", "5"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm.auto import tqdm

import loss_scale as ls

# --precisions name: (label, policy string, whether float16 gets loss scaling)
MODES = {
    "float32": ("float32", "params=float32,compute=float32,output=float32", True),
    "bfloat16": ("bfloat16", "params=float32,compute=bfloat16,output=float32", True),
    "float16": ("float16, no scaling", "params=float32,compute=float16,output=float32", False),
    "float16+dynamic": ("float16 + ls.dynamic", "params=float32,compute=float16,output=float32", True),
}
PLAIN, SCALED = MODES["float16"][0], MODES["float16+dynamic"][0]


class CNN(nn.Module):
    """Two 3x3 convolutions, average pooling and two dense layers."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
        x = nn.relu(nn.Conv(16, (3, 3), **kw)(x))
        x = nn.relu(nn.Conv(32, (3, 3), **kw)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64, **kw)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, **kw)(x)


def make_data(args: argparse.Namespace) -> dict:
    """The digits, split 80/20 (stratified), and the training batches of every step."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # pixels 0..16, scaled to 0..1
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int32), test_size=0.2, random_state=args.seed, stratify=digits.target
    )
    rng = np.random.default_rng(args.seed)
    batches = np.stack([rng.choice(len(x_train), args.batch_size, replace=False) for _ in range(args.steps)])
    return {
        "train": (jnp.asarray(x_train), jnp.asarray(y_train)),
        "test": (jnp.asarray(x_test), jnp.asarray(y_test)),
        "batches": batches,  # example indices of every step, the same for every precision
    }


def train_one(label: str, policy_text: str, scaled: bool, data: dict, args: argparse.Namespace) -> dict:
    """Trains one precision from the same initialization; returns its metrics and per-step history."""
    policy = ls.Policy.from_string(policy_text)
    model = CNN(dtype=policy.compute_dtype)
    params = model.init(jax.random.key(args.seed), data["train"][0][:1])["params"]
    adam = optax.adam(args.lr)
    # A shorter growth interval than the default 2000, so that the scale can
    # adapt within a few hundred steps.
    tx = policy.loss_scaling(adam, growth_interval=args.growth_interval) if scaled else ls.no_op(adam)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, policy.cast_to_compute(x))
        return optax.softmax_cross_entropy_with_integer_labels(policy.cast_to_output(logits), y).mean()

    @jax.jit
    def train_step(state, images, labels, indices):
        x, y = images[indices], labels[indices]
        loss, grads = ls.value_and_grad(loss_fn)(state.opt_state, state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    @jax.jit
    def evaluate(params, x, y):
        logits = policy.cast_to_output(model.apply({"params": params}, policy.cast_to_compute(x)))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    losses, scales, skipped = [], [], []
    bar = tqdm(range(args.steps), desc=f"{label:>21}", disable=args.no_progress, leave=False)
    start = time.perf_counter()
    for step in bar:
        scales.append(float(ls.get_scale(state)))
        state, loss = train_step(state, *data["train"], data["batches"][step])
        losses.append(float(loss))
        skipped.append(bool(ls.find_state(state).skipped))
        if step == 0:
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
        if step % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}")
    ms_per_step = 1000 * (time.perf_counter() - start) / max(args.steps - 1, 1)
    test_loss, test_accuracy = (float(v) for v in evaluate(state.params, *data["test"]))
    tail = max(1, args.steps // 10)
    finite_tail = [x for x in losses[-tail:] if math.isfinite(x)]
    return {
        "policy": str(policy),
        "train_loss": float(np.mean(finite_tail)) if finite_tail else float("nan"),
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "skipped_steps": int(ls.find_state(state).skipped_steps),
        "final_scale": float(ls.get_scale(state)),
        "ms_per_step": ms_per_step,
        "compile_s": compile_s,
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
    }


def add_gaps(results: dict) -> None:
    """How closely each run follows float32: the mean over the steps of
    ``|training loss - float32's training loss|`` (same data, same init)."""
    if "float32" not in results["runs"]:
        for run in results["runs"].values():
            run["gap_to_float32"] = float("nan")
        return
    reference = np.asarray(results["runs"]["float32"]["losses"])
    for run in results["runs"].values():
        gap = np.abs(np.asarray(run["losses"]) - reference)
        run["gap_to_float32"] = float(np.mean(gap[np.isfinite(gap)])) if np.isfinite(gap).any() else float("nan")


def print_table(results: dict) -> None:
    header = (
        f"{'precision':<22}{'train loss':>11}{'test loss':>10}{'test acc':>10}{'|diff| vs f32':>15}"
        f"{'skipped':>9}{'final scale':>13}{'ms/step':>9}{'compile s':>11}"
    )
    print(header)
    print("-" * len(header))
    for label, r in results["runs"].items():
        print(
            f"{label:<22}{r['train_loss']:>11.4f}{r['test_loss']:>10.4f}{100 * r['test_accuracy']:>9.1f}%"
            f"{r['gap_to_float32']:>15.5f}{r['skipped_steps']:>9d}{r['final_scale']:>13g}"
            f"{r['ms_per_step']:>9.2f}{r['compile_s']:>11.1f}"
        )


def summarize(results: dict) -> str:
    """An honest comparison of float16 with and without loss scaling."""
    runs = results["runs"]
    if PLAIN not in runs or SCALED not in runs:
        return "(run both float16 and float16+dynamic to compare them)"
    plain, scaled = runs[PLAIN], runs[SCALED]
    gap = plain["test_accuracy"] - scaled["test_accuracy"]
    if not math.isfinite(plain["test_loss"]) or gap < -0.01:
        verdict = "float16 without scaling ends worse than with ls.dynamic"
    elif gap > 0.01:
        verdict = "float16 without scaling ends better than with ls.dynamic on this run"
    else:
        verdict = (
            "float16 without scaling trains as well as with ls.dynamic here (with 10 classes and batches "
            "of 64, the gradients stay inside float16's range)"
        )
    reference = runs.get("float32", {}).get("test_accuracy", math.nan)
    return (
        f"{verdict}: test accuracy {100 * plain['test_accuracy']:.1f}% vs {100 * scaled['test_accuracy']:.1f}% "
        f"(float32 {100 * reference:.1f}%); per step, the training loss differs from float32's by "
        f"{plain['gap_to_float32']:.5f} vs {scaled['gap_to_float32']:.5f} on average."
    )


def moving_average(values: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, averages)`` of a trailing moving average."""
    window = max(1, min(window, len(values)))
    averages = np.convolve(np.asarray(values, dtype=float), np.ones(window) / window, mode="valid")
    return np.arange(len(averages)) + window - 1, averages


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, gap_ax, scale_ax) = plt.subplots(1, 3, figsize=(17, 4.5))
    window = max(1, results["config"]["steps"] // 50)
    reference = np.asarray(results["runs"]["float32"]["losses"]) if "float32" in results["runs"] else None
    for i, (label, r) in enumerate(results["runs"].items()):
        color = f"C{i}"  # the same colour for a precision in every panel
        loss_ax.semilogy(*moving_average(r["losses"], window), color=color, label=label)
        if reference is not None and label != "float32":
            gap = np.abs(np.asarray(r["losses"]) - reference)
            gap_ax.semilogy(*moving_average(gap, window), color=color, label=label)
    loss_ax.set(title="Training loss (moving average)", xlabel="step", ylabel="cross-entropy (log axis)")
    gap_ax.set(
        title="Distance from the float32 run (moving average)",
        xlabel="step",
        ylabel="|loss - float32 loss| (log axis)",
    )
    if SCALED in results["runs"]:
        dyn = results["runs"][SCALED]
        scale_ax.semilogy(dyn["scales"], base=2, label="loss scale")
        skips = np.flatnonzero(dyn["skipped"])
        marks = np.asarray(dyn["scales"])[skips]
        scale_ax.semilogy(skips, marks, "rx", base=2, label=f"skipped step ({len(skips)})")
    scale_ax.set(title="float16 + ls.dynamic: loss scale", xlabel="step", ylabel="scale (log2 axis)")
    for ax in (loss_ax, gap_ax, scale_ax):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.suptitle(f"CNN on scikit-learn digits ({results['config']['steps']} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per precision")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--growth-interval", type=int, default=100, help="ls.dynamic growth interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precisions",
        default=",".join(MODES),
        help=f"comma-separated, from {', '.join(MODES)} (default: all)",
    )
    parser.add_argument("--plot", metavar="PATH", help="save a PNG of the training curves")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in args.precisions if p not in MODES]
    if unknown or not args.precisions:
        parser.error(f"--precisions: unknown {unknown}, choose from {', '.join(MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    data = make_data(args)
    print(
        f"digits: {len(data['train'][1])} train / {len(data['test'][1])} test images, {args.steps} steps of "
        f"{args.batch_size}, on {jax.devices()[0].platform} ({platform.machine()}, {jax.device_count()} device)"
    )
    results: dict = {"config": vars(args), "runs": {}}
    wall = time.perf_counter()
    for name in args.precisions:
        label, policy_text, scaled = MODES[name]
        results["runs"][label] = train_one(label, policy_text, scaled, data, args)
    results["wall_s"] = time.perf_counter() - wall
    add_gaps(results)
    print_table(results)
    results["summary"] = summarize(results)
    print(results["summary"])
    print(f"total wall time {results['wall_s']:.0f} s")
    if args.plot:
        plot(results, args.plot)
        print(f"plot saved to {args.plot}")
    return results


if __name__ == "__main__":
    main()

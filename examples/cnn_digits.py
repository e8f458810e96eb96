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

    python examples/cnn_digits.py                    # about 20 s on 2 idle CPU cores
    python examples/cnn_digits.py --steps 3000 --plot digits.png
    python examples/cnn_digits.py --precisions float16,float16+dynamic --steps 1000

From Python, ``main(["--steps", "5"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from tqdm import tqdm  # not tqdm.auto, whose notebook widget needs ipywidgets: the notebooks import this

import loss_scale as ls

try:  # run as a script (examples/ is on sys.path), or from the notebooks
    import _common
except ModuleNotFoundError as error:  # imported by file path (the tests, benchmarks/predictive.py)
    if error.name != "_common":
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common

# --precisions name: (label, policy string, whether float16 gets loss scaling)
MODES = _common.PRECISIONS
PLAIN, SCALED = _common.PLAIN, _common.SCALED


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
    x_train, x_test, y_train, y_test = _common.digits(args.seed)
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
    return {
        "policy": str(policy),
        "train_loss": _common.finite_tail_mean(losses, args.steps // 10),
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


# The results table: (header, key in each run, format).
COLUMNS = (
    ("train loss", "train_loss", ".4f"),
    ("test loss", "test_loss", ".4f"),
    ("test acc", "test_accuracy", ".1%"),
    ("|diff| vs f32", "gap_to_float32", ".5f"),
    ("skipped", "skipped_steps", "d"),
    ("final scale", "final_scale", "g"),
    ("ms/step", "ms_per_step", ".2f"),
    ("compile s", "compile_s", ".1f"),
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=400)
    parser.add_argument("--batch-size", type=int, default=64, help="images per training batch")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument("--growth-interval", type=int, default=100, help="ls.dynamic growth interval")
    _common.add_run_options(parser, precisions=True, plot=True, progress=True)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    data = make_data(args)
    print(
        f"digits: {len(data['train'][1])} train / {len(data['test'][1])} test images, {args.steps} steps of "
        f"{args.batch_size}, on {_common.device_line()}"
    )
    results: dict = {"config": vars(args), "runs": {}}
    wall = time.perf_counter()
    for name in args.precisions:
        label, policy_text, scaled = MODES[name]
        results["runs"][label] = train_one(label, policy_text, scaled, data, args)
    results["wall_s"] = time.perf_counter() - wall
    _common.add_gaps(results["runs"])
    title = f"CNN on scikit-learn digits ({args.steps} steps)"
    _common.report(results, COLUMNS, summarize(results), title=title)
    return results


if __name__ == "__main__":
    main()

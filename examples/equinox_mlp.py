#!/usr/bin/env python
"""An Equinox MLP computing in float16 on scikit-learn's digits, trained with ``loss_scale.equinox``.

An ``eqx.nn.MLP`` (the 64 pixels of an 8x8 digit -> two hidden layers -> 10
classes) learns the handwritten digits that ship inside scikit-learn
(``sklearn.datasets.load_digits``; nothing is downloaded). The model keeps
float32 arrays, the master weights that Adam updates; the loss function casts
the model and the images to float16 with ``ls.Policy.cast_to_compute``, so the
forward and backward passes run in float16, and the gradients come back to
float32 through the cast. One training step is::

    loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x, y)  # grads of loss * scale
    model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)      # unscale, check, skip or apply

with ``tx = policy.loss_scaling(optax.adam(lr))``: ``ls.dynamic`` for float16
compute, ``ls.no_op`` for float32 or bfloat16. The table has a row every few
steps: the mean training loss since the row before, the test loss and
accuracy, the loss scale and the skipped steps so far.

Usage::

    python examples/equinox_mlp.py                                # a few seconds on 2 CPU cores
    python examples/equinox_mlp.py --policy p=f32,c=f32,o=f32     # the float32 reference
    python examples/equinox_mlp.py --steps 2000 --plot mlp.png

From Python, ``main(["--steps", "50"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls
from loss_scale import equinox as lsq

try:  # run as a script (examples/ is on sys.path), or from the notebooks
    import _common
except ModuleNotFoundError as error:  # imported by file path (the tests, benchmarks/predictive.py)
    if error.name != "_common":
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common


def load_data(seed: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The digits as flat 64-pixel float32 rows: ``{"train": (x, y), "test": (x, y)}``."""
    x_train, x_test, y_train, y_test = _common.digits(seed)
    flat = lambda images: jnp.asarray(images.reshape(len(images), -1))  # noqa: E731
    return {"train": (flat(x_train), jnp.asarray(y_train)), "test": (flat(x_test), jnp.asarray(y_test))}


def make_model(key: jax.Array, width: int = 64, depth: int = 2) -> eqx.nn.MLP:
    """The MLP, float32 arrays (cast to the compute dtype inside the loss function)."""
    return eqx.nn.MLP(64, 10, width_size=width, depth=depth, activation=jax.nn.relu, key=key)


def make_loss_fn(policy: ls.Policy) -> Callable[[eqx.nn.MLP, jax.Array, jax.Array], jax.Array]:
    """``loss_fn(model, x, y)``: mean cross-entropy, the model and the images
    cast to the policy's compute dtype, the logits to its output dtype."""

    def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = jax.vmap(policy.cast_to_compute(model))(policy.cast_to_compute(x))
        return optax.softmax_cross_entropy_with_integer_labels(policy.cast_to_output(logits), y).mean()

    return loss_fn


def make_train_step(tx: optax.GradientTransformation, policy: ls.Policy) -> Callable:
    """``train_step(model, opt_state, x, y) -> (model, opt_state, loss)``, jitted."""
    loss_fn = make_loss_fn(policy)

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x, y)  # grads of loss * scale
        model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)  # unscale, check, skip or apply
        return model, opt_state, loss

    return train_step


def make_evaluate(policy: ls.Policy) -> Callable:
    """``evaluate(model, x, y) -> (loss, accuracy)``, in the policy's compute dtype, jitted."""
    loss_fn = make_loss_fn(policy)

    @eqx.filter_jit
    def evaluate(model, x, y):
        logits = jax.vmap(policy.cast_to_compute(model))(policy.cast_to_compute(x))
        return loss_fn(model, x, y), jnp.mean(jnp.argmax(logits, -1) == y)

    return evaluate


# The table: (header, key in each row, format).
COLUMNS = (
    ("train loss", "train_loss", ".4f"),
    ("test loss", "test_loss", ".4f"),
    ("test acc", "test_accuracy", ".1%"),
    ("scale", "scale", "g"),
    ("skipped", "skipped_steps", "d"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=300)
    parser.add_argument("--batch-size", type=int, default=64, help="images per training batch")
    parser.add_argument("--width", type=int, default=64, help="width of the hidden layers")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--growth-interval", type=int, default=100, help="ls.dynamic growth interval")
    parser.add_argument(
        "--policy", default="params=float32,compute=float16,output=float32", help="ls.Policy.from_string's text"
    )
    parser.add_argument("--rows", type=int, default=6, help="rows of the table (one every steps / rows steps)")
    _common.add_run_options(parser, plot=True)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains the MLP, prints the table and returns the results.

    Returns:
      ``{"config": vars(args), "policy": str, "rows": {step: row}, "runs": {label: run},
      "model": the trained eqx.nn.MLP, "initial_test_accuracy": float, "wall_s": float}``;
      the run has ``train_loss``, ``test_loss``, ``test_accuracy``, ``final_scale``,
      ``skipped_steps`` and the per-step ``losses``, ``scales`` and ``skipped``.
    """
    args = parse_args(argv)
    wall = time.perf_counter()
    policy = ls.Policy.from_string(args.policy)
    data = load_data(args.seed)
    model = make_model(jax.random.key(args.seed), args.width, args.depth)
    tx = policy.loss_scaling(optax.adam(args.lr), growth_interval=args.growth_interval)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    train_step, evaluate = make_train_step(tx, policy), make_evaluate(policy)
    x_train, y_train = data["train"]
    print(
        f"digits: {len(y_train)} train / {len(data['test'][1])} test images, {args.steps} steps of "
        f"{args.batch_size}, {policy}, on {_common.device_line()}"
    )

    initial_accuracy = float(evaluate(model, *data["test"])[1])
    rng = np.random.default_rng(args.seed)
    every = max(1, args.steps // max(1, args.rows))
    losses, scales, skipped, rows, previous = [], [], [], {}, 0
    for step in range(1, args.steps + 1):
        batch = rng.choice(len(y_train), args.batch_size, replace=False)
        scales.append(float(ls.get_scale(opt_state)))
        model, opt_state, loss = train_step(model, opt_state, x_train[batch], y_train[batch])
        losses.append(float(loss))
        skipped.append(bool(ls.find_state(opt_state).skipped))
        if step % every == 0 or step == args.steps:
            test_loss, test_accuracy = (float(v) for v in evaluate(model, *data["test"]))
            rows[str(step)] = {
                "train_loss": _common.finite_tail_mean(losses, step - previous),
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "scale": float(ls.get_scale(opt_state)),
                "skipped_steps": int(ls.find_state(opt_state).skipped_steps),
            }
            previous = step
    last = rows[str(args.steps)]
    run_label = f"{policy.compute_dtype.name} compute" + (" + ls.dynamic" if max(scales) > 1 else "")
    run = {
        "train_loss": last["train_loss"],
        "test_loss": last["test_loss"],
        "test_accuracy": last["test_accuracy"],
        "final_scale": last["scale"],
        "skipped_steps": last["skipped_steps"],
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
    }
    results = {
        "config": vars(args),
        "policy": str(policy),
        "rows": rows,
        "runs": {run_label: run},
        "model": model,
        "initial_test_accuracy": initial_accuracy,
        "wall_s": time.perf_counter() - wall,
    }
    _common.print_table(rows, COLUMNS, first="step")
    dtypes = sorted({leaf.dtype.name for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))})
    print(
        f"test accuracy {100 * initial_accuracy:.1f}% at initialization, {100 * run['test_accuracy']:.1f}% after "
        f"{args.steps} steps; the model's arrays stay {', '.join(dtypes)} (the master weights), the forward "
        f"and backward passes ran in {policy.compute_dtype.name}; total wall time {results['wall_s']:.0f} s"
    )
    if args.plot:
        title = f"Equinox MLP on scikit-learn digits, {policy}"
        _common.plot_runs(results["runs"], title=title, path=args.plot, smooth=max(1, args.steps // 50))
        print(f"plot saved to {args.plot}")
    return results


if __name__ == "__main__":
    main()

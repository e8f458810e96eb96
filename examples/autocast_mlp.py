#!/usr/bin/env python
"""An MLP written in float32, trained in float16 with ``ls.autocast`` and ``ls.dynamic``, against the hand-cast model.

The model is ``examples/equinox_mlp.py``'s Equinox MLP on scikit-learn's
digits (nothing is downloaded), and its loss function has no dtype in it::

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

``ls.autocast(loss_fn)`` runs its matrix products in float16 (the float32
parameters cast where the products read them, so their gradients stay
float32) and its softmax cross-entropy in float32, and ``ls.dynamic`` scales
the loss. Three runs from the same initialization, on the same batches:

* ``autocast + ls.dynamic``: ``ls.autocast(loss_fn)``;
* ``hand-cast + ls.dynamic``: the model cast by hand, as ``equinox_mlp.py``
  does it (the parameters and the images cast to float16, the logits to
  float32 for the loss);
* ``float32``: ``loss_fn`` itself, with ``ls.no_op``.

Each run's final loss is the float32 cross-entropy of its trained model on
the whole training set. The script checks that the autocast run's is within
``--tolerance`` (1%) of the hand-cast run's, and exits with an error if not.

Usage::

    python examples/autocast_mlp.py                     # 7 to 12 s on 2 CPU cores
    python examples/autocast_mlp.py --steps 1000 --plot autocast.png

From Python, ``main(["--steps", "100"])`` returns the results as a dict.
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
import numpy as np
import optax

import loss_scale as ls
from loss_scale import equinox as lsq

try:  # run as a script (examples/ is on sys.path), or from the notebooks
    import _common
    import equinox_mlp
except ModuleNotFoundError as error:  # imported by file path (the tests)
    if error.name not in ("_common", "equinox_mlp"):
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common
    import equinox_mlp

AUTOCAST, HAND_CAST, FLOAT32 = "autocast + ls.dynamic", "hand-cast + ls.dynamic", "float32"


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy of the model's logits: float32, no cast anywhere."""
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def losses_to_train(growth_interval: int, lr: float) -> dict[str, tuple[Callable, optax.GradientTransformation]]:
    """``{label: (loss function, optimizer)}`` of the three runs."""
    half = ls.Policy.from_string("params=float32,compute=float16,output=float32")
    return {
        AUTOCAST: (ls.autocast(loss_fn), ls.dynamic(optax.adam(lr), growth_interval=growth_interval)),
        HAND_CAST: (equinox_mlp.make_loss_fn(half), ls.dynamic(optax.adam(lr), growth_interval=growth_interval)),
        FLOAT32: (loss_fn, ls.no_op(optax.adam(lr))),
    }


def product_dtypes(fn: Callable, *args: Any) -> dict[str, int]:
    """``{dtype name: count}`` of the matrix products (``dot_general``) in the
    jaxpr of ``fn(*args)``, the bodies of the calls inside it included, by
    the dtype they multiply in (their operands': under autocast the logits'
    product returns its float32 accumulation of float16 operands)."""
    counts: dict[str, int] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                name = eqn.invars[0].aval.dtype.name
                counts[name] = counts.get(name, 0) + 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return dict(sorted(counts.items()))


def train(
    fn: Callable, tx: optax.GradientTransformation, data: dict, args: argparse.Namespace
) -> tuple[eqx.nn.MLP, dict[str, Any]]:
    """Trains a fresh model with ``fn`` and ``tx``; returns it and its run."""
    model = equinox_mlp.make_model(jax.random.key(args.seed), args.width, args.depth)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = lsq.filter_value_and_grad(fn)(opt_state, model, x, y)  # grads of loss * scale
        model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)  # unscale, check, skip or apply
        return model, opt_state, loss

    x_train, y_train = data["train"]
    rng = np.random.default_rng(args.seed)  # the same batches for every run
    losses, scales, skipped = [], [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        batch = rng.choice(len(y_train), args.batch_size, replace=False)
        scales.append(float(ls.get_scale(opt_state)))
        model, opt_state, loss = train_step(model, opt_state, x_train[batch], y_train[batch])
        losses.append(float(loss))
        skipped.append(bool(ls.find_state(opt_state).skipped))
    wall = time.perf_counter() - start
    evaluate = eqx.filter_jit(lambda model, x, y: (loss_fn(model, x, y), (jax.vmap(model)(x).argmax(-1) == y).mean()))
    final_loss = float(evaluate(model, *data["train"])[0])
    test_loss, test_accuracy = (float(v) for v in evaluate(model, *data["test"]))
    return model, {
        "final_loss": final_loss,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "final_scale": float(ls.get_scale(opt_state)),
        "skipped_steps": int(ls.find_state(opt_state).skipped_steps),
        "wall_s": wall,
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
    }


# The table: (header, key in each run, format).
COLUMNS = (
    ("final loss", "final_loss", ".4f"),
    ("vs hand-cast", "gap_to_hand_cast", "+.2%"),
    ("test loss", "test_loss", ".4f"),
    ("test acc", "test_accuracy", ".1%"),
    ("scale", "final_scale", "g"),
    ("skipped", "skipped_steps", "d"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=200)
    parser.add_argument("--batch-size", type=int, default=64, help="images per training batch")
    parser.add_argument("--width", type=int, default=64, help="width of the hidden layers")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--growth-interval", type=int, default=100, help="ls.dynamic growth interval")
    parser.add_argument(
        "--tolerance", type=float, default=0.01, help="largest relative gap to the hand-cast run's final loss"
    )
    _common.add_run_options(parser, plot=True)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains the three runs, prints the table and returns the results.

    Returns:
      ``{"config": vars(args), "runs": {label: run}, "product_dtypes": {label: {dtype: count}},
      "gap_to_hand_cast": float, "within_tolerance": bool, "summary": str, "wall_s": float}``;
      each run has ``final_loss`` (on the training set, in float32), ``gap_to_hand_cast``,
      ``test_loss``, ``test_accuracy``, ``final_scale``, ``skipped_steps`` and the
      per-step ``losses``, ``scales`` and ``skipped``.
    """
    args = parse_args(argv)
    wall = time.perf_counter()
    data = equinox_mlp.load_data(args.seed)
    print(
        f"digits: {len(data['train'][1])} train / {len(data['test'][1])} test images, {args.steps} steps of "
        f"{args.batch_size}, on {_common.device_line()}"
    )
    model0 = equinox_mlp.make_model(jax.random.key(args.seed), args.width, args.depth)
    params, static = eqx.partition(model0, eqx.is_inexact_array)
    batch = (data["train"][0][: args.batch_size], data["train"][1][: args.batch_size])
    runs, dtypes = {}, {}
    for label, (fn, tx) in losses_to_train(args.growth_interval, args.lr).items():
        # The products of the gradient computation: forward and backward.
        grad_of = jax.grad(lambda p, x, y, fn=fn: fn(eqx.combine(p, static), x, y))
        dtypes[label] = product_dtypes(grad_of, params, *batch)
        runs[label] = train(fn, tx, data, args)[1]
    reference = runs[HAND_CAST]["final_loss"]
    for run in runs.values():
        run["gap_to_hand_cast"] = (run["final_loss"] - reference) / reference
    gap = runs[AUTOCAST]["gap_to_hand_cast"]
    within = abs(gap) <= args.tolerance
    summary = (
        f"autocast's final loss {runs[AUTOCAST]['final_loss']:.4f} is {abs(gap):.2%} from the hand-cast model's "
        f"{reference:.4f} ({'within' if within else 'NOT within'} {args.tolerance:.0%}); float32's is "
        f"{runs[FLOAT32]['final_loss']:.4f}"
    )
    results = {
        "config": vars(args),
        "runs": runs,
        "product_dtypes": dtypes,
        "gap_to_hand_cast": gap,
        "within_tolerance": within,
        "summary": summary,
        "wall_s": time.perf_counter() - wall,
    }
    for label, counts in dtypes.items():
        print(f"{label}: matrix products of a gradient step, by the dtype they multiply in: {counts}")
    _common.print_table(runs, COLUMNS, first="run")
    print(summary)
    print(f"total wall time {results['wall_s']:.0f} s")
    if args.plot:
        title = "Equinox MLP on scikit-learn digits: ls.autocast against the hand-cast model"
        _common.plot_runs(runs, title=title, path=args.plot, smooth=max(1, args.steps // 50))
        print(f"plot saved to {args.plot}")
    return results


if __name__ == "__main__":
    if not main()["within_tolerance"]:
        sys.exit("autocast's final loss is not within the tolerance of the hand-cast model's")

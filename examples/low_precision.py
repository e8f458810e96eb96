#!/usr/bin/env python
"""An MLP trained with bfloat16 parameters and optimizer state, ``ls.low_precision``, against float32.

The model is ``examples/equinox_mlp.py``'s Equinox MLP on scikit-learn's
digits (nothing is downloaded); AdamW with a cosine decay to zero, the same
initialization and batches for every run:

* ``float32``: float32 params and AdamW (12 bytes per parameter);
* ``bfloat16, nearest``: the params and AdamW's moments in bfloat16,
  rounded to nearest, what ``optax.apply_updates`` does alone: updates
  below half a bfloat16 step of their weight are lost;
* ``bfloat16, kahan``: ``ls.low_precision(adamw, "kahan",
  state_dtype=jnp.bfloat16)``, a compensation buffer keeps what rounding
  lost (6 bytes per parameter of optimizer state);
* ``bfloat16, stochastic``: ``ls.low_precision(adamw, "stochastic",
  state_dtype=jnp.bfloat16)``, unbiased rounding (4 bytes).

The bfloat16 runs compute in bfloat16 (the images cast to it, the logits to
float32 for the loss). Each run's final loss is the float32 cross-entropy of
its trained model on the whole training set; the script checks that the
Kahan and stochastic runs end within ``--tolerance`` (5%) of float32's, and
exits with an error if not.

Usage::

    python examples/low_precision.py                     # 50 s to 2 min on 2 CPU cores
    python examples/low_precision.py --steps 3000 --lr 1e-4

From Python, ``main(["--steps", "200"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Sequence
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
    import equinox_mlp
except ModuleNotFoundError as error:  # imported by file path (the tests)
    if error.name not in ("_common", "equinox_mlp"):
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common
    import equinox_mlp

FLOAT32 = "float32"
RUNS = {  # label: (params' dtype, ls.low_precision's rounding or None)
    FLOAT32: (jnp.float32, None),
    "bfloat16, nearest": (jnp.bfloat16, "nearest"),
    "bfloat16, kahan": (jnp.bfloat16, "kahan"),
    "bfloat16, stochastic": (jnp.bfloat16, "stochastic"),
}
CHECKED = ("bfloat16, kahan", "bfloat16, stochastic")


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy; the model computes in its params' dtype, the loss in float32."""
    dtype = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))[0].dtype
    logits = jax.vmap(model)(x.astype(dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_tx(rounding: str | None, schedule: optax.Schedule) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule, weight_decay=1e-4)
    return adamw if rounding is None else ls.low_precision(adamw, rounding, state_dtype=jnp.bfloat16)


def state_bytes_per_param(opt_state: Any, params: Any) -> float:
    """Bytes the optimizer keeps per parameter (the step count and the key included)."""
    n = sum(x.size for x in jax.tree.leaves(params))
    return sum(x.nbytes for x in jax.tree.leaves(opt_state)) / n


def train(dtype: Any, rounding: str | None, data: dict, args: argparse.Namespace) -> dict[str, Any]:
    model = equinox_mlp.make_model(jax.random.key(args.seed), args.width, args.depth)
    model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    tx = make_tx(rounding, optax.cosine_decay_schedule(args.lr, args.steps))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    state_bytes = state_bytes_per_param(opt_state, eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        # optax.apply_updates inside: the sum cast back to each param's dtype
        # (eqx.apply_updates would leave bfloat16 + float32 update as float32).
        model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)
        return model, opt_state, loss

    x_train, y_train = data["train"]
    rng = np.random.default_rng(args.seed)  # the same batches for every run
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        batch = rng.choice(len(y_train), args.batch_size, replace=False)
        model, opt_state, loss = train_step(model, opt_state, x_train[batch], y_train[batch])
        losses.append(float(loss))
    wall = time.perf_counter() - start
    as_float32 = jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, model)
    evaluate = eqx.filter_jit(lambda model, x, y: (loss_fn(model, x, y), (jax.vmap(model)(x).argmax(-1) == y).mean()))
    return {
        "param_dtype": str(jnp.dtype(dtype)),
        "final_loss": float(evaluate(as_float32, *data["train"])[0]),
        "test_accuracy": float(evaluate(as_float32, *data["test"])[1]),
        "state_bytes": state_bytes,
        "wall_s": wall,
        "losses": losses,
    }


COLUMNS = (
    ("final loss", "final_loss", ".4f"),
    ("vs float32", "gap_to_float32", "+.1%"),
    ("test acc", "test_accuracy", ".1%"),
    ("state bytes/param", "state_bytes", ".2f"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=800)
    parser.add_argument("--batch-size", type=int, default=64, help="images per training batch")
    parser.add_argument("--width", type=int, default=256, help="width of the hidden layers")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW's peak learning rate (cosine decay to 0)")
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="largest relative gap of kahan and stochastic to float32"
    )
    _common.add_run_options(parser)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains the four runs, prints the table and returns the results.

    Returns:
      ``{"config": vars(args), "runs": {label: run}, "within_tolerance": bool, "summary": str}``;
      each run has ``final_loss`` (on the training set, in float32), ``gap_to_float32``,
      ``test_accuracy``, ``state_bytes`` (per parameter), ``param_dtype`` and the per-step ``losses``.
    """
    args = parse_args(argv)
    data = equinox_mlp.load_data(args.seed)
    print(
        f"digits: {len(data['train'][1])} train / {len(data['test'][1])} test images, {args.steps} steps of "
        f"{args.batch_size}, on {_common.device_line()}"
    )
    runs = {label: train(dtype, rounding, data, args) for label, (dtype, rounding) in RUNS.items()}
    reference = runs[FLOAT32]["final_loss"]
    for run in runs.values():
        run["gap_to_float32"] = (run["final_loss"] - reference) / reference
    within = all(abs(runs[label]["gap_to_float32"]) <= args.tolerance for label in CHECKED)
    nearest = runs["bfloat16, nearest"]["gap_to_float32"]
    summary = (
        f"kahan and stochastic end {max(abs(runs[label]['gap_to_float32']) for label in CHECKED):.1%} or less "
        f"from float32's final loss ({'within' if within else 'NOT within'} {args.tolerance:.0%}); rounding to "
        f"nearest ends {nearest:+.1%} from it"
    )
    _common.print_table(runs, COLUMNS, first="run")
    print(summary)
    return {"config": vars(args), "runs": runs, "within_tolerance": within, "summary": summary}


if __name__ == "__main__":
    if not main()["within_tolerance"]:
        sys.exit("kahan or stochastic rounding did not end within the tolerance of float32")

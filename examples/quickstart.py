#!/usr/bin/env python
"""Quickstart: float16 training with and without dynamic loss scaling.

In a language model, float16 gradients underflow first at the output layer.
The loss is a mean cross-entropy over many tokens and a large vocabulary, and
the gradient with respect to each logit is ``(p - q) / tokens``, with ``p``
the model's probability of that class and ``q`` the target's. With 1,024
tokens per batch and 32,768 classes, a typical class has ``p`` near
``1 / 32768`` and a gradient near ``2**-25`` (3e-8): half of float16's
smallest subnormal, which rounds to exactly 0. Without loss scaling most
logit gradients vanish, and the small probabilities are never learned (a
class is neither pushed down where the model gives it too much, nor up where
it gives too little). ``ls.dynamic`` multiplies the loss by the scale (2**15
to start) before the backward pass, which keeps these gradients in float16's
range, and ``tx.update`` divides them by the scale again, in float32.

The task: a fixed random "teacher" gives each of 256 input tokens a
next-token distribution over the vocabulary (a Zipf prior over the classes,
as in text, reweighted by a rank-16 factor that depends on the input token).
A small flax linen student (embedding -> MLP -> dense to vocabulary logits)
learns it by minimizing the mean cross-entropy against the teacher's
probabilities. The data are synthetic, drawn from a fixed seed; nothing is
downloaded. The same student, initialization, batches and optimizer (Adam)
are trained three times:

* ``float32``: the reference;
* ``float16, no scaling``: float32 params, cast to float16 inside the loss
  function; float16 compute; the loss in float32; ``ls.no_op(adam)``;
* ``float16 + ls.dynamic``: the same with ``ls.dynamic(adam)``.

The table has, per run: the training loss (mean of the last few steps); the
eval loss, the exact expected cross-entropy over all input tokens, computed
in float32 with the float32 params, and its excess over the best possible
loss (the teacher's entropy); the fraction of logit gradients that are
exactly 0 (last batch, end of training); the final scale; the skipped steps.

Usage::

    python examples/quickstart.py                # 20 to 70 s on 2 CPU cores (20 s idle)
    python examples/quickstart.py --steps 100    # float32 and ls.dynamic get close to the best loss
    python examples/quickstart.py --vocab 4096   # half the logit gradients flush, with no effect on the loss here
    python examples/quickstart.py --steps 100 --plot quickstart.png

The harm grows with tokens x vocabulary: here it shows from about 2**25
(the default), where a class at ``p = 1 / vocab`` gets a gradient of 2**-25.

From Python, ``main(["--steps", "5", "--no-progress"])`` returns the results
as a dict.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm  # not tqdm.auto, whose notebook widget needs ipywidgets: the notebooks import this

import loss_scale as ls

try:  # run as a script (examples/ is on sys.path), or from the notebooks
    import _common
except ModuleNotFoundError as error:  # imported by file path (the tests, benchmarks/predictive.py)
    if error.name != "_common":
        raise
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import _common

Params = Any

# (label, compute dtype, whether the loss is scaled)
RUNS: tuple[tuple[str, Any, bool], ...] = (
    ("float32", jnp.float32, False),
    ("float16, no scaling", jnp.float16, False),
    ("float16 + ls.dynamic", jnp.float16, True),
)


class Student(nn.Module):
    """Embedding -> residual MLP -> dense to vocabulary logits.

    The layers take their dtype from their inputs and params, so the same
    module computes in float16 when it is given float16 params.
    """

    num_inputs: int
    vocab: int
    width: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = nn.Embed(self.num_inputs, self.width)(tokens)
        h = h + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return nn.Dense(self.vocab)(h)


def make_teacher(rng: np.random.Generator, args: argparse.Namespace) -> np.ndarray:
    """The teacher's next-token log-probabilities, ``[num_inputs, vocab]`` float32.

    A Zipf prior over the vocabulary (a few frequent tokens, a long tail of
    rare ones, as in text) plus a rank-16 term that depends on the input
    token, which the student can represent exactly. Built in NumPy: it is
    made once, and NumPy needs no compilation.
    """
    rank = 16
    prior = -np.log(rng.permutation(np.arange(1, args.vocab + 1)))
    factors = rng.standard_normal((args.num_inputs, rank)) @ rng.standard_normal((rank, args.vocab))
    logits = prior + args.temperature * factors / math.sqrt(rank)
    logits -= logits.max(axis=-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))).astype(np.float32)


def cross_entropy(
    model: Student, params: Params, tokens: jax.Array, teacher_probs: jax.Array, compute_dtype: Any
) -> jax.Array:
    """Mean cross-entropy of the student against the teacher, a float32 scalar.

    The params stay float32 (the optimizer updates them in float32); they are
    cast to ``compute_dtype`` here, so the forward and backward passes run in
    float16 and the gradients arrive back in float32 through the cast. The
    logits are cast to float32 before the softmax: the loss itself is float32.
    """
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = model.apply(params, tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy(logits, teacher_probs[tokens]).mean()


def make_train_step(model: Student, tx: optax.GradientTransformation, compute_dtype: Any) -> Callable:
    """The jitted step: scaled gradients, then ``tx.update`` unscales, checks and applies."""

    def loss_fn(params: Params, tokens: jax.Array, teacher_probs: jax.Array) -> jax.Array:
        return cross_entropy(model, params, tokens, teacher_probs, compute_dtype)

    def train_step(params: Params, opt_state: optax.OptState, tokens: jax.Array, teacher_probs: jax.Array):
        # The loss is unscaled; the grads are those of loss * scale.
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, tokens, teacher_probs)
        updates, opt_state = tx.update(grads, opt_state, params)
        state = ls.find_state(opt_state)
        # Returned as outputs: arrays inside opt_state are donated to the next step.
        return optax.apply_updates(params, updates), opt_state, (loss, state.scale, state.skipped)

    # Params and optimizer state are donated: their buffers are reused for the new ones.
    return jax.jit(train_step, donate_argnums=(0, 1))


def make_logit_grad_zero_fraction(model: Student, compute_dtype: Any) -> Callable:
    """Fraction of the gradients w.r.t. the logits (at the current scale) that are exactly 0.

    Those are where float16 underflows first. They are read as the gradient
    with respect to a zero offset added to the float16 logits, a diagnostic
    kept out of the training step.
    """

    def loss_fn(params: Params, offset: jax.Array, tokens: jax.Array, teacher_probs: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = (model.apply(params, tokens) + offset).astype(jnp.float32)
        return optax.softmax_cross_entropy(logits, teacher_probs[tokens]).mean()

    @jax.jit
    def zero_fraction(params: Params, opt_state: optax.OptState, tokens: jax.Array, teacher_probs: jax.Array):
        offset = jnp.zeros((tokens.shape[0], teacher_probs.shape[1]), compute_dtype)
        _, logit_grads = ls.value_and_grad(loss_fn, argnums=1)(opt_state, params, offset, tokens, teacher_probs)
        return jnp.mean(logit_grads == 0)

    return zero_fraction


def train_one(label: str, compute_dtype: Any, scaled: bool, data: dict, args: argparse.Namespace) -> dict:
    """Trains one run from the shared init and batches; returns its row of the table and its curves."""
    model = data["model"]
    adam = optax.adam(args.lr)
    # ls.no_op keeps the same state (scale 1, counters) without scaling, so
    # every run has the same loop; float32 needs no scaling.
    tx = ls.dynamic(adam, growth_interval=args.growth_interval) if scaled else ls.no_op(adam)
    # Copy the shared init: the step donates (and so invalidates) the params it is given.
    params = jax.tree.map(jnp.copy, data["params"])
    opt_state = tx.init(params)
    train_step = make_train_step(model, tx, compute_dtype)
    teacher_probs = data["teacher_probs"]

    losses, scales, skipped = [], [], []
    bar = tqdm(range(args.steps), desc=f"{label:>20}", disable=args.no_progress, leave=False)
    start = time.perf_counter()
    compile_s = 0.0
    for step in bar:
        params, opt_state, (loss, scale, was_skipped) = train_step(
            params, opt_state, data["tokens"][step], teacher_probs
        )
        losses.append(loss)
        scales.append(scale)
        skipped.append(was_skipped)
        if step == 0:
            jax.block_until_ready(loss)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
        if step % 5 == 0 or step == args.steps - 1:
            # Reading a value waits for the step; do it only every few steps.
            bar.set_postfix(loss=f"{float(loss):.3f}", scale=f"{float(scale):g}")
    jax.block_until_ready(params)
    ms_per_step = 1000 * (time.perf_counter() - start) / max(args.steps - 1, 1)

    losses = [float(x) for x in losses]
    tail = max(1, min(5, args.steps // 4))
    zero_fraction = make_logit_grad_zero_fraction(model, compute_dtype)
    eval_loss = float(data["eval_loss"](params, teacher_probs))
    return {
        "train_loss": float(np.mean(losses[-tail:])),
        "eval_loss": eval_loss,
        "excess_loss": eval_loss - data["teacher_entropy"],
        "zero_grad_fraction": float(zero_fraction(params, opt_state, data["tokens"][-1], teacher_probs)),
        "final_scale": float(ls.get_scale(opt_state)),
        "skipped_steps": int(ls.find_state(opt_state).skipped_steps),
        "ms_per_step": ms_per_step,
        "compile_s": compile_s,
        "losses": losses,
        "scales": [float(x) for x in scales],
        "skipped": [bool(x) for x in skipped],
    }


def make_data(args: argparse.Namespace) -> dict:
    """Teacher, batches, the student and its initial params: shared by all runs."""
    rng = np.random.default_rng(args.seed)
    teacher_logp = make_teacher(rng, args)
    teacher_probs = np.exp(teacher_logp)
    model = Student(args.num_inputs, args.vocab, args.width)

    @jax.jit
    def eval_loss(params: Params, teacher_probs: jax.Array) -> jax.Array:
        # Every input token once, in float32: the exact expected loss, no sampling noise.
        return cross_entropy(model, params, jnp.arange(args.num_inputs), teacher_probs, jnp.float32)

    return {
        "model": model,
        "params": jax.jit(model.init)(jax.random.PRNGKey(args.seed), jnp.zeros((1,), jnp.int32)),
        # Teacher probabilities are an argument of the jitted functions, not a
        # closed-over constant, which XLA would spend seconds constant-folding.
        "teacher_probs": jnp.asarray(teacher_probs),
        "teacher_entropy": float(-np.mean(np.sum(teacher_probs * teacher_logp, axis=-1))),
        # The input tokens of every step, drawn up front.
        "tokens": jnp.asarray(rng.integers(0, args.num_inputs, size=(args.steps, args.tokens), dtype=np.int32)),
        "eval_loss": eval_loss,
    }


# The results table: (header, key in each run, format).
COLUMNS = (
    ("train loss", "train_loss", ".3f"),
    ("eval loss", "eval_loss", ".3f"),
    ("excess", "excess_loss", ".3f"),
    ("zero logit grads", "zero_grad_fraction", ".1%"),
    ("final scale", "final_scale", "g"),
    ("skipped", "skipped_steps", "d"),
    ("ms/step", "ms_per_step", ".0f"),
)


def summarize(results: dict) -> str:
    """What this run's numbers say, in two sentences; nothing in them is assumed."""
    runs = results["runs"]
    ref, plain, scaled = (runs[label] for label, _, _ in RUNS)
    gap = plain["excess_loss"] - scaled["excess_loss"]
    if not math.isfinite(plain["eval_loss"]) or gap > 0.01:
        verdict = f"float16 without loss scaling ends worse, by {gap:.3f} nats of eval loss"
    elif gap < -0.01:
        verdict = f"float16 without loss scaling ends better on this run, by {-gap:.3f} nats of eval loss"
    else:
        verdict = "float16 with and without loss scaling end level on this run"
    return (
        f"{verdict} (excess over the best possible loss: {plain['excess_loss']:.3f} without scaling, "
        f"{scaled['excess_loss']:.3f} with ls.dynamic, {ref['excess_loss']:.3f} in float32).\n"
        f"Why: the gradient of each logit is (p - q) / {results['config']['tokens']} tokens; without scaling "
        f"{100 * plain['zero_grad_fraction']:.1f}% of them fell below 2**-25 (half float16's smallest "
        f"subnormal) and became exactly 0, so those (token, class) pairs gave no gradient at all; with the loss "
        f"scaled by {scaled['final_scale']:g}, {100 * scaled['zero_grad_fraction']:.1f}% did."
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=15)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per batch (the mean's denominator)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size (output classes)")
    parser.add_argument("--num-inputs", type=int, default=256, help="distinct input tokens")
    parser.add_argument("--width", type=int, default=64, help="embedding and MLP width")
    parser.add_argument("--temperature", type=float, default=2.5, help="teacher: weight of the token-dependent term")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate")
    parser.add_argument("--growth-interval", type=int, default=2000, help="ls.dynamic growth interval")
    _common.add_run_options(parser, plot=True, progress=True)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains the three runs, prints the table and returns the results.

    Returns:
      ``{"config": vars(args), "teacher_entropy": float, "runs": {label: {...}},
      "summary": str, "wall_s": float}``; each run has ``train_loss``,
      ``eval_loss``, ``excess_loss``, ``zero_grad_fraction``, ``final_scale``,
      ``skipped_steps``, ``ms_per_step``, ``compile_s`` and the per-step
      ``losses``, ``scales`` and ``skipped``.
    """
    args = parse_args(argv)
    wall = time.perf_counter()
    data = make_data(args)
    print(
        f"{args.steps} steps of {args.tokens} tokens, vocabulary {args.vocab}, width {args.width}; "
        f"best possible loss (teacher entropy) {data['teacher_entropy']:.3f}; on {_common.device_line()}"
    )
    results: dict = {"config": vars(args), "teacher_entropy": data["teacher_entropy"], "runs": {}}
    for label, compute_dtype, scaled in RUNS:
        results["runs"][label] = train_one(label, compute_dtype, scaled, data, args)
    results["wall_s"] = time.perf_counter() - wall
    title = f"float16 LM head, vocabulary {args.vocab} ({args.steps} steps of {args.tokens} tokens)"
    _common.report(results, COLUMNS, summarize(results), title=title)
    return results


if __name__ == "__main__":
    main()

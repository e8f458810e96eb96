#!/usr/bin/env python
"""A small transformer language model, trained with flax NNX in four precisions.

A causal transformer learns to continue Python source code: the text is the
standard library of the interpreter running this script, read from disk
(nothing is downloaded), cut into word pieces (identifiers, numbers,
symbols, indentation; the 2,047 most frequent, plus one for the rest). The
same model, data order and optimizer (AdamW) are trained four times:

* ``float32``: the reference;
* ``bfloat16``: float32 params, bfloat16 compute, no loss scaling;
* ``float16, no scaling``: float32 params, float16 compute, scale 1;
* ``float16 + ls.dynamic``: the same, with dynamic loss scaling;

and the script prints, for each, the final training and validation loss
(cross-entropy in nats per token), how far its training loss strays from
the float32 run's at the same step (same data, same initialization), the
skipped steps, the final scale, the largest fraction of gradient elements
that were exactly zero in one step (float16 rounds gradients below 2**-25
to zero; loss scaling is what keeps them), and the time per step.

The training loop is plain NNX: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
with ``tx`` from ``Policy.loss_scaling`` (``ls.dynamic`` for float16,
``ls.no_op`` otherwise) and ``loss_scale.flax.nnx_value_and_grad``.

``NextToken`` is a smaller model of the same text (the previous few word
pieces through one hidden layer), which notebooks 02 and 03 train.

Usage::

    python examples/nnx_lm.py                     # about a minute on 2 CPU cores
    python examples/nnx_lm.py --steps 2000 --plot lm.png
    python examples/nnx_lm.py --precisions float16,float16+dynamic --steps 1000

From Python, ``main(["--steps", "5"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import re
import sys
import sysconfig
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm  # not tqdm.auto, whose notebook widget needs ipywidgets: the notebooks import this

import loss_scale as ls
import loss_scale.flax as lsf

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


def load_text(max_bytes: int) -> bytes:
    """Python's standard-library sources, as one byte string.

    The top-level modules of the running interpreter's stdlib, in sorted
    order, so that every run (and every precision) sees the same text.
    """
    stdlib = pathlib.Path(sysconfig.get_path("stdlib"))
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size < 100_000:
        raise RuntimeError(f"found only {size} bytes of Python source under {stdlib}")
    return b"".join(chunks)[:max_bytes]


# Python-aware word pieces: an identifier, number or symbol with at most one
# leading space, a newline with the indentation after it, or other whitespace.
TOKEN_RE = re.compile(rb" ?[A-Za-z_][A-Za-z0-9_]*| ?[0-9]+|\n[ \t]*|[ \t]+| ?[^\sA-Za-z0-9_]|\s")


def tokenize(text: bytes, vocab_size: int) -> tuple[np.ndarray, list[bytes]]:
    """Token ids for ``text``: the ``vocab_size - 1`` most frequent pieces, and 0 for the rest."""
    pieces = TOKEN_RE.findall(text)
    vocab = [b"<unk>"] + [piece for piece, _ in collections.Counter(pieces).most_common(vocab_size - 1)]
    index = {piece: i for i, piece in enumerate(vocab)}
    return np.fromiter((index.get(piece, 0) for piece in pieces), np.int32, len(pieces)), vocab


def make_data(args: argparse.Namespace) -> dict:
    """Token windows for every training step (the same for every precision) and a fixed validation set."""
    text = load_text(args.max_bytes)
    tokens, _ = tokenize(text, args.vocab)
    split = int(0.9 * len(tokens))
    train, val = tokens[:split], tokens[split:]
    rng = np.random.default_rng(args.seed)
    span = args.seq_len + 1
    offsets = np.arange(span)
    starts = rng.integers(0, len(train) - span, size=(args.steps, args.batch_size))
    n_val = args.val_batches * args.batch_size
    val_starts = np.arange(n_val) * ((len(val) - span) // n_val)
    return {
        "bytes": len(text),
        "tokens": len(tokens),
        "unknown": float(np.mean(tokens == 0)),
        # Host arrays: each step's batch is copied in by the jitted step itself.
        "batches": train[starts[..., None] + offsets],
        "val": list(val[val_starts[:, None] + offsets].reshape(args.val_batches, args.batch_size, span)),
    }


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention, with the softmax in float32.

    Written out rather than ``nnx.MultiHeadAttention``: in flax 0.12 that
    calls ``jax.nn.dot_product_attention``, which asks for float16 matmuls
    with float32 results, and XLA:CPU rejects those ("precision F16_F16_F32
    is not supported by dot_general on CPU").
    """

    def __init__(self, dim: int, heads: int, *, dtype: Any, rngs: nnx.Rngs):
        self.heads, self.dtype = heads, dtype
        self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(dim, dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, dim // self.heads), 3, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(dim // self.heads)
        causal = jnp.tril(jnp.ones((1, 1, length, length), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(self.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, dim))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, *, dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(dim, **kw)
        self.attn = CausalSelfAttention(dim, heads, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, **kw)
        self.up = nnx.Linear(dim, 4 * dim, **kw)
        self.down = nnx.Linear(4 * dim, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class TransformerLM(nnx.Module):
    """A causal transformer over word pieces; computes in ``dtype``, keeps float32 params."""

    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int, *, dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.dtype = dtype
        self.embed = nnx.Embed(vocab, dim, **kw)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
        self.blocks = nnx.List([Block(dim, heads, dtype=dtype, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(dim, **kw)
        self.head = nnx.Linear(dim, vocab, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None, : tokens.shape[-1]].astype(self.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class NextToken(nnx.Module):
    """A small next-token model: embeds the previous ``context`` tokens and
    predicts the next one through a hidden layer; computes in ``dtype``,
    keeps float32 params. Trained by notebooks 02 and 03: its softmax over
    the whole vocabulary is where float16 gradients get small.
    """

    def __init__(self, vocab: int, context: int, dim: int = 64, hidden: int = 128, *, dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(vocab, dim, **kw)
        self.hidden = nnx.Linear(context * dim, hidden, **kw)
        self.norm = nnx.LayerNorm(hidden, **kw)
        self.head = nnx.Linear(hidden, vocab, **kw)

    def __call__(self, context: jax.Array) -> jax.Array:
        x = self.embed(context).reshape(context.shape[0], -1)
        return self.head(nnx.gelu(self.norm(self.hidden(x))))


def next_token_batch(
    tokens: np.ndarray, rng: np.random.Generator, batch_size: int, context: int
) -> tuple[jax.Array, jax.Array]:
    """``(contexts [batch, context], next tokens [batch])`` at random places in ``tokens``."""
    start = rng.integers(0, len(tokens) - context, batch_size)
    window = jnp.asarray(tokens[start[:, None] + np.arange(context + 1)])
    return window[:, :-1], window[:, -1]


def make_loss_fn(policy: ls.Policy):
    def loss_fn(model: TransformerLM, batch: jax.Array) -> jax.Array:
        logits = policy.cast_to_output(model(batch[:, :-1]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return loss_fn


def zero_fraction(grads: nnx.State) -> jax.Array:
    """Fraction of gradient elements that are exactly zero, outside the
    embedding table (whose rows for tokens absent from the batch are zero in
    any precision)."""
    leaves = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "embed" not in jax.tree_util.keystr(path)]
    zeros = sum(jnp.sum(g == 0) for g in leaves)
    return zeros / sum(g.size for g in leaves)


def train_one(label: str, policy_text: str, scaled: bool, data: dict, args: argparse.Namespace) -> dict:
    """Trains one precision from the same initialization; returns its metrics and per-step history."""
    policy = ls.Policy.from_string(policy_text)
    sizes = (args.vocab, args.seq_len, args.dim, args.heads, args.layers)
    model = TransformerLM(*sizes, dtype=policy.compute_dtype, rngs=nnx.Rngs(args.seed))
    adamw = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10 + 1, args.steps))
    # A shorter growth interval than the default 2000, so that the scale can
    # adapt within a few hundred steps.
    tx = policy.loss_scaling(adamw, growth_interval=args.growth_interval) if scaled else ls.no_op(adamw)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss_fn = make_loss_fn(policy)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = lsf.nnx_value_and_grad(loss_fn)(optimizer, model, batch)
        optimizer.update(model, grads)
        return loss, zero_fraction(grads)

    @nnx.jit
    def eval_loss(model, batch):
        return loss_fn(model, batch)

    losses, scales, skipped, zeros = [], [], [], []
    bar = tqdm(range(args.steps), desc=f"{label:>21}", disable=args.no_progress, leave=False)
    start = time.perf_counter()
    for step in bar:
        scales.append(float(lsf.get_scale(optimizer)))
        loss, zero = train_step(model, optimizer, data["batches"][step])
        state = lsf.find_state(optimizer)
        losses.append(float(loss))
        zeros.append(float(zero))
        skipped.append(bool(state.skipped))
        if step == 0:
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}")
    ms_per_step = 1000 * (time.perf_counter() - start) / max(args.steps - 1, 1)
    val = np.mean([float(eval_loss(model, b)) for b in data["val"]])
    return {
        "policy": str(policy),
        "train_loss": _common.finite_tail_mean(losses, args.steps // 10),
        "val_loss": float(val),
        "skipped_steps": int(lsf.find_state(optimizer).skipped_steps),
        "final_scale": float(lsf.get_scale(optimizer)),
        "zero_grad_peak": float(np.max(zeros)),
        "ms_per_step": ms_per_step,
        "compile_s": compile_s,
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "zero_fractions": zeros,
    }


# The results table: (header, key in each run, format).
COLUMNS = (
    ("train loss", "train_loss", ".4f"),
    ("val loss", "val_loss", ".4f"),
    ("|diff| vs f32", "gap_to_float32", ".5f"),
    ("skipped", "skipped_steps", "d"),
    ("final scale", "final_scale", "g"),
    ("max zero grads", "zero_grad_peak", ".2%"),
    ("ms/step", "ms_per_step", ".1f"),
    ("compile s", "compile_s", ".1f"),
)


def summarize(results: dict) -> str:
    """An honest comparison of float16 with and without loss scaling."""
    runs = results["runs"]
    if PLAIN not in runs or SCALED not in runs:
        return "(run both float16 and float16+dynamic to compare them)"
    plain, scaled = runs[PLAIN], runs[SCALED]
    difference = plain["val_loss"] - scaled["val_loss"]
    if not math.isfinite(plain["val_loss"]) or difference > 0.02:
        verdict = "float16 without scaling ends worse than with ls.dynamic"
    elif difference < -0.02:
        verdict = "float16 without scaling ends better than with ls.dynamic on this run"
    else:
        verdict = "float16 without scaling ends about as well as with ls.dynamic on this run"
    reference = runs.get("float32", {}).get("val_loss", math.nan)
    return (
        f"{verdict}: validation loss {plain['val_loss']:.4f} vs {scaled['val_loss']:.4f} "
        f"(float32 {reference:.4f}). Per step, its training loss differs from float32's "
        f"by {plain['gap_to_float32']:.5f} on average, vs {scaled['gap_to_float32']:.5f} with ls.dynamic. "
        f"At worst {100 * plain['zero_grad_peak']:.2f}% of its gradient elements were exactly zero in a step "
        f"(underflow), vs {100 * scaled['zero_grad_peak']:.2f}% with ls.dynamic."
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _common.make_parser(__doc__, steps=150)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per training batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (warmup, cosine decay)")
    parser.add_argument("--growth-interval", type=int, default=100, help="ls.dynamic growth interval")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size (word pieces)")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="bytes of stdlib source to read")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches")
    _common.add_run_options(parser, precisions=True, plot=True, progress=True)
    return _common.parse(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    data = make_data(args)
    print(
        f"{data['bytes'] / 1e6:.1f} MB of Python stdlib source = {data['tokens']:,} tokens "
        f"({100 * data['unknown']:.1f}% out of vocabulary), {args.steps} steps of {args.batch_size}x{args.seq_len} "
        f"tokens, {args.layers} layers x {args.dim} dims, "
        f"on {_common.device_line()}"
    )
    results: dict = {"config": vars(args), "runs": {}}
    wall = time.perf_counter()
    for name in args.precisions:
        label, policy_text, scaled = MODES[name]
        results["runs"][label] = train_one(label, policy_text, scaled, data, args)
    results["wall_s"] = time.perf_counter() - wall
    _common.add_gaps(results["runs"])
    title = f"Transformer LM on the Python stdlib ({args.steps} steps)"
    _common.report(results, COLUMNS, summarize(results), title=title, log_loss=False)
    return results


if __name__ == "__main__":
    main()

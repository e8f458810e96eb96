#!/usr/bin/env python
"""Writes the notebooks in this folder from the cell sources below and runs them.

The ``.ipynb`` files are committed with their outputs, so that they render
on GitHub; edit the cells here, then regenerate and re-execute them with::

    python notebooks/_build.py            # every notebook
    python notebooks/_build.py 01         # the ones whose name contains "01"
    python notebooks/_build.py --no-execute   # write them without outputs (to lint them)

``tests/test_notebooks.py`` executes the committed notebooks again.
"""

from __future__ import annotations

import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}

INSTALL = """\
# On Colab or in a fresh environment, install loss_scale (with flax and matplotlib)
# when it is not importable: from this checkout if the notebook runs inside one,
# else by name (set SOURCE to a git URL, "git+https://...", to install from a fork).
try:
    import loss_scale  # noqa: F401
except ImportError:
    import pathlib

    SOURCE = ".." if (pathlib.Path("..") / "pyproject.toml").exists() else "loss_scale"
    %pip install -q "{SOURCE}[examples]"
""".rstrip()

# Word pieces of the Python standard library: real text that is on every
# machine with Python (Colab included), so nothing is downloaded.
STDLIB_TOKENS = '''\
def stdlib_tokens(vocab_size, max_bytes=1_000_000):
    """Token ids of the running interpreter's standard-library sources.

    Word pieces (an identifier, number or symbol with one leading space, or a
    newline with its indentation); the vocab_size - 1 most frequent, 0 for the rest.
    """
    stdlib = pathlib.Path(sysconfig.get_path("stdlib"))
    text = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py")))[:max_bytes]
    pieces = re.findall(rb" ?[A-Za-z_][A-Za-z0-9_]*| ?[0-9]+|\\n[ \\t]*|[ \\t]+| ?[^\\sA-Za-z0-9_]|\\s", text)
    vocab = [b"<unk>"] + [p for p, _ in collections.Counter(pieces).most_common(vocab_size - 1)]
    index = {p: i for i, p in enumerate(vocab)}
    return np.array([index.get(p, 0) for p in pieces], np.int32)'''

# The next-token model of notebooks 02 and 03, with its data.
NEXT_TOKEN = """\
VOCAB, CONTEXT, BATCH = 2048, 3, 512
tokens = stdlib_tokens(VOCAB, max_bytes=600_000)


# Embeds the previous CONTEXT tokens and predicts the next one through a hidden layer.
class NextToken(nnx.Module):
    def __init__(self, dim=64, hidden=128, *, dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(VOCAB, dim, **kw)
        self.hidden = nnx.Linear(CONTEXT * dim, hidden, **kw)
        self.norm = nnx.LayerNorm(hidden, **kw)
        self.head = nnx.Linear(hidden, VOCAB, **kw)

    def __call__(self, context):
        x = self.embed(context).reshape(context.shape[0], -1)
        return self.head(nnx.gelu(self.norm(self.hidden(x))))"""

WHY = [
    (
        "markdown",
        """\
# Why loss scaling?

float16 has 5 exponent bits: it represents magnitudes from about $6 \\times 10^{-8}$ to
$65504$. Gradients of real models are often far smaller than that, and the ones below the
range are rounded to **zero** in the backward pass: that part of the training signal is gone.
**Loss scaling** multiplies the loss by a scale $S$ before differentiating, so every
gradient is $S$ times larger and lands inside the range; the optimizer then divides by
$S$ in float32. Dynamic loss scaling (`loss_scale.dynamic`) picks $S$ by itself: when a
gradient overflows to inf the step is skipped and $S$ halves; after a run of clean steps
$S$ doubles.

This notebook shows, on CPU in under a minute:

1. the float16 number line, next to bfloat16 and float32;
2. the gradient magnitudes of a small language model on real text, against that range;
3. a linear regression whose gradients underflow in float16, with and without a scale;
4. what fraction of gradient elements flush to zero, as a function of the scale.""",
    ),
    ("code", INSTALL),
    (
        "code",
        """\
import collections
import pathlib
import re
import sysconfig

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import loss_scale as ls

print("jax", jax.__version__, "on", jax.devices()[0].platform, "| loss_scale", ls.__version__)""",
    ),
    (
        "markdown",
        """\
## 1. The float16 number line

Every floating-point format has a **normal** range, where the relative precision is
constant, **subnormals** below it, which trade precision for range (the last one has a
single significant bit), then zero. Above the largest finite value lies **overflow** (inf).
bfloat16 keeps float32's 8 exponent bits: its range is float32's, with less precision.""",
    ),
    (
        "code",
        """\
formats = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
print(f"{'':9} {'smallest subnormal':>19} {'smallest normal':>16} {'largest':>11} {'epsilon':>9}")
for name, dtype in formats.items():
    fi = jnp.finfo(dtype)
    limits = (fi.smallest_subnormal, fi.tiny, fi.max, fi.eps)
    print(f"{name:9} " + " ".join(f"{float(v):{w}.3g}" for v, w in zip(limits, (19, 16, 11, 9), strict=True)))""",
    ),
    (
        "code",
        """\
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
for row, dtype in enumerate(formats.values()):
    fi = jnp.finfo(dtype)
    sub, tiny, big = (np.log10(float(v)) for v in (fi.smallest_subnormal, fi.tiny, fi.max))
    ax.barh(row, tiny - sub, left=sub, color="tab:orange", alpha=0.6, label="subnormal" if row == 0 else None)
    ax.barh(row, big - tiny, left=tiny, color="tab:blue", alpha=0.6, label="normal" if row == 0 else None)
ax.set_yticks(range(len(formats)), list(formats))
ax.set_xlim(-46, 40)
# float16's limits, labelled under its bar (staggered: the first two are close).
for x, text, dy in (
    (np.log10(2.0**-24), "5.96e-8", -0.55),
    (np.log10(2.0**-14), "6.10e-5", -0.75),
    (np.log10(65504), "65504", -0.55),
):
    ax.axvline(x, color="k", lw=0.8, ls="--")
    ax.annotate(text, (x, dy), ha="center", fontsize=8)
ax.set_ylim(-0.9, 2.5)
ax.set(title="Representable magnitudes", xlabel="log10 |x|")
ax.legend(loc="lower left")

# The spacing between neighbouring float16 numbers, relative to the number itself.
x = np.logspace(-9, 5.5, 2000)
with np.errstate(over="ignore"):  # the largest x overflow float16 on purpose
    x16 = x.astype(np.float16)
ok = (x16 > 0) & np.isfinite(x16)
ax2.loglog(x[ok], np.spacing(x16[ok]).astype(np.float64) / x[ok], color="tab:blue")
ax2.axvspan(1e-9, 2.0**-25, color="tab:red", alpha=0.15, label="rounds to 0")
ax2.axvspan(2.0**-25, 2.0**-14, color="tab:orange", alpha=0.15, label="subnormal")
ax2.axvspan(65520, 10**5.5, color="tab:purple", alpha=0.15, label="overflows to inf")
ax2.set(title="float16: relative spacing of neighbouring numbers", xlabel="|x|", ylabel="spacing / |x|")
ax2.legend(loc="upper right")
fig.tight_layout()
plt.show()""",
    ),
    (
        "markdown",
        """\
## 2. Gradient magnitudes of a real model

A small language model on real text: Python's own standard library, read from the
interpreter's install directory (on Colab too; nothing is downloaded), cut into word
pieces with a vocabulary of 4,096. The model embeds the two previous tokens and predicts
the next one through a hidden layer. It is trained for a few dozen steps in float32,
and then we look at the magnitudes of its gradients: the gradient of the loss with respect to
the logits (the first activation gradient of the backward pass, which flows back through
every layer) and the gradients of the weights.

The loss is a mean over $N = 1024$ tokens, so each token contributes $(p - y)/N$ to the
gradient of its logits: for the many tokens the model gives a small probability, that is
far below $10^{-5}$.""",
    ),
    ("code", STDLIB_TOKENS),
    (
        "code",
        """\
VOCAB, DIM, HIDDEN, TOKENS = 4096, 64, 128, 1024
tokens = stdlib_tokens(VOCAB)
rng = np.random.default_rng(0)


def sample_batch():
    start = rng.integers(0, len(tokens) - 3, TOKENS)
    return jnp.asarray(np.stack([tokens[start], tokens[start + 1]], 1)), jnp.asarray(tokens[start + 2])


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": 0.02 * jax.random.normal(k1, (VOCAB, DIM)),
        "hidden": jax.random.normal(k2, (2 * DIM, HIDDEN)) / np.sqrt(2 * DIM),
        "head": jax.random.normal(k3, (HIDDEN, VOCAB)) / np.sqrt(HIDDEN),
    }


def logits_fn(params, context, dtype=jnp.float32):
    p = jax.tree.map(lambda w: w.astype(dtype), params)
    h = p["embed"][context].reshape(context.shape[0], -1)
    return jax.nn.relu(h @ p["hidden"]) @ p["head"]


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


params = init(jax.random.key(0))
tx = optax.adam(3e-3)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, context, targets):
    loss, grads = jax.value_and_grad(lambda p: cross_entropy(logits_fn(p, context), targets))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


context, targets = sample_batch()
params_at_init = params
for _ in range(60):
    params, opt_state, loss = train_step(params, opt_state, *sample_batch())
print(f"{len(tokens):,} tokens; loss after 60 steps: {float(loss):.2f} nats (uniform: {np.log(VOCAB):.2f})")""",
    ),
    (
        "code",
        """\
@jax.jit
def float32_gradients(params, context, targets):
    logits = logits_fn(params, context)
    logit_grads = jax.grad(cross_entropy)(logits, targets)
    weight_grads = jax.grad(lambda p: cross_entropy(logits_fn(p, context), targets))(params)
    return logit_grads, weight_grads


def regions(g):
    g = np.abs(np.asarray(g, np.float64).ravel())
    g = g[g > 0]
    return {
        "rounds to 0 in float16": np.mean(g < 2.0**-25),
        "subnormal": np.mean((g >= 2.0**-25) & (g < 2.0**-14)),
        "normal": np.mean(g >= 2.0**-14),
    }


fig, axes = plt.subplots(1, 2, figsize=(14, 4.2), sharey=False)
bins = np.arange(-45, 5, 0.5)
for ax, (title, which) in zip(axes, (("dL/dlogits (activation gradient)", 0), ("dL/dW, all weights", 1)), strict=True):
    for label, p in (("at initialization", params_at_init), ("after 60 steps", params)):
        g = jax.tree.leaves(float32_gradients(p, context, targets)[which])
        g = np.concatenate([np.abs(np.asarray(x)).ravel() for x in g])
        g = g[g > 0]
        # Anything below the first bin is counted in it.
        ax.hist(np.clip(np.log2(g), bins[0], None), bins=bins, alpha=0.55, label=label)
        print(f"{title:34} {label:18}", {k: f"{100 * v:.1f}%" for k, v in regions(g).items()})
    ax.axvspan(bins[0], -25, color="tab:red", alpha=0.12, label="float16: rounds to 0")
    ax.axvspan(-25, -14, color="tab:orange", alpha=0.12, label="float16: subnormal")
    ax.axvline(-25 - 15, color="k", ls=":", label="where 0 starts with a scale of 2^15")
    ax.set(title=title, xlabel="log2 |gradient|  (float32 reference)", ylabel="number of elements")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()""",
    ),
    (
        "markdown",
        """\
At initialization every logit gradient is about $1/(4096 \\cdot 1024) = 2^{-22}$: subnormal
in float16, with only three significant bits. After a few dozen steps the model is
confident about many tokens and most logit gradients are below $2^{-25}$: float16 rounds
them to zero. The weight gradients, sums over the batch, are larger, but most of them are
still subnormal in float16, where the precision is poor.

With a scale $S = 2^{15}$ (the default initial scale of `ls.dynamic`) every gradient is
$2^{15}$ times larger, so float16's cut-off moves from $2^{-25}$ to $2^{-40}$ in the
original units (the dotted line): almost everything survives, with full precision.

## 3. A linear regression that float16 cannot finish without a scale

Fit $y = Xw^*$ (no noise) by gradient descent on the mean squared error over $N = 16384$
samples, with float32 master weights and the forward and backward pass in float16. The
gradient of the loss with respect to each prediction is $2r_i/N$: once a residual $r_i$ is
below $2^{-25} N / 2 \approx 2.4 \times 10^{-4}$ (the targets are about $0.01$), that
gradient is rounded to zero in float16, and the weights stop moving long before float16's
own rounding of the predictions (a few times $10^{-6}$ here) would stop them. This is the mechanism
described in the mixed-precision training literature (Micikevicius et al., *Mixed
Precision Training*, ICLR 2018), reproduced on a problem small enough to see everything.""",
    ),
    (
        "code",
        """\
N, D = 16384, 16
key_x, key_w = jax.random.split(jax.random.key(1))
X = jax.random.normal(key_x, (N, D))
w_true = 0.0025 * jax.random.normal(key_w, (D,))
y = X @ w_true


def regression_loss(w, X, y, dtype):
    pred = X.astype(dtype) @ w.astype(dtype)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def prediction_grad_zeros(w, X, y, dtype, scale):
    # The gradient that float16 carries back from the loss to the predictions.
    pred = X.astype(dtype) @ w.astype(dtype)
    g = jax.grad(lambda p: scale * jnp.mean((p.astype(jnp.float32) - y) ** 2))(pred)
    return jnp.mean(g == 0)


def fit(dtype, tx, steps=200):
    w = jnp.zeros(D)
    state = tx.init(w)

    @jax.jit
    def step(w, state, X, y):
        loss, grads = ls.value_and_grad(regression_loss)(state, w, X, y, dtype)
        zeros = prediction_grad_zeros(w, X, y, dtype, ls.get_scale(state))
        updates, state = tx.update(grads, state, w)
        return optax.apply_updates(w, updates), state, loss, zeros

    history = {"loss": [], "zeros": [], "scale": []}
    for _ in range(steps):
        history["scale"].append(float(ls.get_scale(state)))
        w, state, loss, zeros = step(w, state, X, y)
        history["loss"].append(float(loss))
        history["zeros"].append(float(zeros))
    history["weight error"] = float(jnp.linalg.norm(w - w_true) / jnp.linalg.norm(w_true))
    history["skipped"] = int(ls.find_state(state).skipped_steps)
    return history


sgd = optax.sgd(0.2)
runs = {
    "float32": fit(jnp.float32, ls.no_op(sgd)),
    "float16, no scaling": fit(jnp.float16, ls.no_op(sgd)),
    "float16 + ls.dynamic": fit(jnp.float16, ls.dynamic(sgd)),
}
for name, h in runs.items():
    print(
        f"{name:22} final loss {h['loss'][-1]:.2e}   relative weight error {h['weight error']:.1e}   "
        f"skipped steps {h['skipped']}   final scale {h['scale'][-1]:g}"
    )""",
    ),
    (
        "code",
        """\
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.2))
for name, h in runs.items():
    ax1.semilogy(h["loss"], label=name)
    ax2.plot(100 * np.asarray(h["zeros"]), label=name)
ax1.set(title="Linear regression: training loss", xlabel="step", ylabel="mean squared error (log axis)")
ax2.set(
    title="Gradient w.r.t. the predictions: elements that are exactly 0",
    xlabel="step",
    ylabel="% of the N = 16384 elements",
)
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend()
fig.tight_layout()
plt.show()""",
    ),
    (
        "markdown",
        """\
Without a scale, float16 gets stuck where the per-sample gradients underflow: the loss
plateaus orders of magnitude above float32's, and nearly all of the gradient elements are
zero. With `ls.dynamic` the same float16 computation keeps going until float16's own
rounding of the predictions, not underflow, limits it. (float32's zeros at the end are
residuals that are exactly 0: it has converged.)

## 4. How much flushes to zero, as a function of the scale

Back to the language model of section 2 (trained weights, float32 master copy). Here its
forward and backward pass run in float16 with the loss multiplied by $S$, for
$S = 2^0 \\dots 2^{30}$. Too small a scale loses gradients to zero; too large a scale
overflows to inf, which is the step `ls.dynamic` skips before backing off.""",
    ),
    (
        "code",
        """\
@jax.jit
def float16_gradients(params, context, targets, scale):
    logits, vjp = jax.vjp(lambda p: logits_fn(p, context, jnp.float16), params)
    logit_grads = jax.grad(lambda z: scale * cross_entropy(z, targets))(logits)  # float16, like the backward pass
    (weight_grads,) = vjp(logit_grads)
    return logit_grads, weight_grads


exponents = np.arange(0, 31, 2)
_, reference = float32_gradients(params, context, targets)
reference = np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(reference)])
stats = {"logit gradients = 0": [], "weight gradients inf/nan": [], "weight gradient error": []}
for k in exponents:
    logit_grads, weight_grads = float16_gradients(params, context, targets, jnp.float32(2.0**k))
    w = np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(weight_grads)]) / 2.0**k
    stats["logit gradients = 0"].append(np.mean(np.asarray(logit_grads) == 0))
    stats["weight gradients inf/nan"].append(np.mean(~np.isfinite(w)))
    error = np.linalg.norm(w - reference) / np.linalg.norm(reference)
    stats["weight gradient error"].append(error if np.isfinite(error) else np.nan)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.2))
ax1.plot(exponents, 100 * np.asarray(stats["logit gradients = 0"]), "o-", label="logit gradients that are 0")
ax1.plot(exponents, 100 * np.asarray(stats["weight gradients inf/nan"]), "o-", label="weight gradients: inf/nan")
ax1.set(title="float16 gradients lost, by loss scale", xlabel="log2(loss scale S)", ylabel="% of elements")
ax2.semilogy(exponents, stats["weight gradient error"], "o-", color="tab:green")
ax2.set(
    title="Relative error of the float16 weight gradient (vs float32)",
    xlabel="log2(loss scale S)",
    ylabel="||g16 / S - g32|| / ||g32||  (log axis)",
)
for ax in (ax1, ax2):
    ax.set_xlim(-1, 31)
    ax.axvline(15, color="k", ls=":", label="ls.dynamic's initial scale, 2^15")
    ax.grid(alpha=0.3)
    ax.legend()
fig.tight_layout()
plt.show()
for k, zeros, bad, error in zip(exponents, *stats.values(), strict=True):
    if k % 6 == 0:
        print(
            f"S = 2^{k:<2}  logit grads = 0: {100 * zeros:5.1f}%   weight grads inf/nan: {100 * bad:5.1f}%   "
            f"weight grad error: {error:.1e}"
        )""",
    ),
    (
        "markdown",
        """\
**Reading the plots.** At $S = 1$ most logit gradients are exactly zero (every token the
model considers unlikely contributes less than $2^{-25}$), and the weight gradients built
from them are off by a large relative error. Raising the scale recovers them; once the
largest gradients exceed 65504 they overflow to inf (the error is then undefined, and the
step has to be skipped). `ls.dynamic` finds that window by itself, and keeps finding it
as the gradients change during training.

Next: `02_train_with_flax.ipynb` trains flax linen and NNX models with `ls.dynamic`.""",
    ),
]

FLAX = [
    (
        "markdown",
        """\
# Training flax models in float16 with `loss_scale`

Two complete training loops, each run in float32 and in float16 with dynamic loss
scaling (the NNX one also in float16 without scaling), with plots of the loss, the loss
scale and the skipped steps:

1. **flax linen**: a small CNN on scikit-learn's handwritten digits (bundled with
   scikit-learn, nothing is downloaded), with `flax.training.train_state.TrainState`;
2. **flax NNX**: a small next-token model on Python's standard-library sources (a softmax
   over 2,048 word pieces, where float16 gradients get small), with `nnx.Optimizer` and
   `loss_scale.flax.nnx_value_and_grad`.

The precision comes from one string, `ls.Policy.from_string(...)`, and
`policy.loss_scaling(optimizer)` picks the loss scaling it needs: `ls.dynamic` for float16,
`ls.no_op` for bfloat16 and float32 (same state layout, so the loop does not change).
Parameters stay in float32 (the "master weights"): an Adam update smaller than half the
spacing of float16 numbers around a weight would round away.

Runs on CPU in about a minute.""",
    ),
    ("code", INSTALL.replace('[examples]"', '[examples]" scikit-learn')),
    (
        "code",
        """\
import collections
import pathlib
import re
import sysconfig

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import loss_scale as ls
import loss_scale.flax as lsf

for text in ("params=float32,compute=float32,output=float32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"):
    policy = ls.Policy.from_string(text)
    tx = policy.loss_scaling(optax.adam(1e-3))
    print(f"{str(policy):46} -> loss scale {float(ls.get_scale(tx.init(jnp.zeros(1)))):g}")""",
    ),
    (
        "code",
        """\
def plot_runs(runs, title):
    \"\"\"Loss of each run, and the loss scale with the skipped steps of the scaled one.\"\"\"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.2))
    for name, h in runs.items():
        loss = np.asarray(h["loss"], dtype=float)
        window = max(1, len(loss) // 40)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax1.plot(np.arange(len(smooth)) + window - 1, smooth, label=name)
    ax1.set(title=f"{title}: training loss (moving average)", xlabel="step", ylabel="cross-entropy (log axis)")
    ax1.set_yscale("log")
    for name, h in runs.items():
        if max(h["scale"]) > 1:
            skipped = np.flatnonzero(h["skipped"])
            ax2.semilogy(h["scale"], base=2, label=f"{name}: loss scale")
            marks = np.asarray(h["scale"])[skipped]
            ax2.semilogy(skipped, marks, "rx", base=2, label=f"skipped steps ({len(skipped)})")
    ax2.set(title=f"{title}: loss scale", xlabel="step", ylabel="scale (log2 axis)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    plt.show()""",
    ),
    (
        "markdown",
        """\
## 1. flax linen: a CNN on the digits, with `TrainState`

The layers compute in `policy.compute_dtype` and keep `param_dtype=float32`. The train step
is the usual linen one, with two changes: gradients come from
`ls.value_and_grad(loss_fn)(state.opt_state, ...)` (the gradients of `loss * scale`), and
the optimizer is wrapped by `policy.loss_scaling`. `state.apply_gradients` then unscales,
checks, and skips or applies: on a skipped step the params and the optimizer state stay as
they were (only `state.step` still counts it).""",
    ),
    (
        "code",
        """\
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

digits = load_digits()
images = (digits.images / 16.0).astype(np.float32)[..., None]
x_train, x_test, y_train, y_test = train_test_split(
    images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
)


class CNN(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
        x = nn.relu(nn.Conv(16, (3, 3), **kw)(x))
        x = nn.relu(nn.Conv(32, (3, 3), **kw)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64, **kw)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, **kw)(x)


def train_linen(policy_text, steps=200, batch_size=64, **dynamic_kwargs):
    policy = ls.Policy.from_string(policy_text)
    model = CNN(dtype=policy.compute_dtype)
    params = model.init(jax.random.key(0), x_train[:1])["params"]
    tx = policy.loss_scaling(optax.adam(2e-3), **dynamic_kwargs)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, policy.cast_to_compute(x))
            return optax.softmax_cross_entropy_with_integer_labels(policy.cast_to_output(logits), y).mean()

        loss, grads = ls.value_and_grad(loss_fn)(state.opt_state, state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    history = {"loss": [], "scale": [], "skipped": []}
    for _ in range(steps):
        batch = rng.choice(len(x_train), batch_size, replace=False)
        history["scale"].append(float(ls.get_scale(state)))
        state, loss = train_step(state, x_train[batch], y_train[batch])
        history["loss"].append(float(loss))
        history["skipped"].append(bool(ls.find_state(state).skipped))
    logits = jax.jit(state.apply_fn)({"params": state.params}, policy.cast_to_compute(x_test))
    history["test accuracy"] = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    history["state"] = state
    return history


linen_runs = {
    "float32": train_linen("p=f32,c=f32,o=f32"),
    # growth_interval=40 instead of 2000, so that the scale moves within 200 steps.
    "float16 + ls.dynamic": train_linen("p=f32,c=f16,o=f32", growth_interval=40),
}
for name, h in linen_runs.items():
    print(
        f"{name:22} test accuracy {100 * h['test accuracy']:.1f}%   final loss {np.mean(h['loss'][-30:]):.4f}   "
        f"skipped {sum(h['skipped'])}   final scale {h['scale'][-1]:g}"
    )
state = linen_runs["float16 + ls.dynamic"]["state"]
print("TrainState.step:", int(state.step), "| applied Adam steps:", int(ls.find_state(state).inner_state[0].count))
print({k: float(v) for k, v in ls.metrics(state).items() if "grad" not in k})""",
    ),
    ("code", 'plot_runs({k: v for k, v in linen_runs.items()}, "linen CNN, digits")'),
    (
        "markdown",
        """\
The scale starts at $2^{15}$ and doubles every 40 clean steps until a gradient overflows
float16; that step is skipped (red cross), the scale halves, and training goes on. The
float16 loss follows the float32 one. On this small classification task float16 would
train well even without a scale (the gradients of a 10-class cross-entropy over 64
images stay inside float16's range); the next-token model below, with its softmax over
2,048 classes, is where the gradients get small.

## 2. flax NNX: a next-token model, with `nnx.Optimizer`

`nnx.Optimizer(model, tx, wrt=nnx.Param)` takes the loss-scaled optimizer as it is.
`loss_scale.flax.nnx_value_and_grad(loss_fn)(optimizer, model, batch)` returns the loss and
the gradients of `loss * scale` with respect to the optimizer's `wrt` variables, and
`optimizer.update(model, grads)` unscales, checks, and skips or applies.
`lsf.get_scale(optimizer)` and `lsf.metrics(optimizer)` read the scaler's state as plain
arrays (`nnx.Optimizer` wraps its state in `nnx.Variable`s).

To show the scale moving within 150 steps, it grows every 20 clean steps instead of the
default 2,000.""",
    ),
    ("code", STDLIB_TOKENS),
    (
        "code",
        NEXT_TOKEN
        + """


def train_nnx(policy_text, steps=150, scaled=True, **dynamic_kwargs):
    policy = ls.Policy.from_string(policy_text)
    model = NextToken(dtype=policy.compute_dtype, rngs=nnx.Rngs(0))
    adamw = optax.adamw(3e-3)
    tx = policy.loss_scaling(adamw, **dynamic_kwargs) if scaled else ls.no_op(adamw)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, context, targets):
        logits = policy.cast_to_output(model(context))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @nnx.jit
    def train_step(model, optimizer, context, targets):
        loss, grads = lsf.nnx_value_and_grad(loss_fn)(optimizer, model, context, targets)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    history = {"loss": [], "scale": [], "skipped": []}
    for _ in range(steps):
        start = rng.integers(0, len(tokens) - CONTEXT, BATCH)
        window = jnp.asarray(tokens[start[:, None] + np.arange(CONTEXT + 1)])
        history["scale"].append(float(lsf.get_scale(optimizer)))
        history["loss"].append(float(train_step(model, optimizer, window[:, :-1], window[:, -1])))
        history["skipped"].append(bool(lsf.find_state(optimizer).skipped))
    history["optimizer"] = optimizer
    return history


nnx_runs = {
    "float32": train_nnx("p=f32,c=f32,o=f32"),
    "float16, no scaling": train_nnx("p=f32,c=f16,o=f32", scaled=False),
    "float16 + ls.dynamic": train_nnx("p=f32,c=f16,o=f32", growth_interval=20),
}
for name, h in nnx_runs.items():
    print(
        f"{name:22} final loss {np.mean(h['loss'][-20:]):.3f}   skipped {sum(h['skipped'])}   "
        f"final scale {h['scale'][-1]:g}"
    )
optimizer = nnx_runs["float16 + ls.dynamic"]["optimizer"]
applied = int(lsf.find_state(optimizer).inner_state[0].count)
print("nnx.Optimizer.step:", int(optimizer.step[...]), "| applied AdamW steps:", applied)
print({k: float(v) for k, v in lsf.metrics(optimizer).items() if "grad" not in k})""",
    ),
    ("code", 'plot_runs(nnx_runs, "NNX next-token model")'),
    (
        "markdown",
        """\
The scale grows from $2^{15}$ every 20 clean steps until the largest gradients overflow
float16; each of those steps is skipped (params and AdamW moments untouched, so a skipped
step costs only its time) and the scale halves. The float16 runs follow float32 here:
over 150 steps, the underflow of float16 without scaling (see `01_why_loss_scaling.ipynb`
for how much of the gradient it loses) does not yet show in the loss.

`examples/cnn_digits.py` and `examples/nnx_lm.py` (a transformer language model trained with
NNX) run the same comparisons with bfloat16 as well, for longer, with timings.""",
    ),
]

DIAGNOSTICS = [
    (
        "markdown",
        """\
# What the scaler tells you

A loss scaler sees every gradient of every step. `loss_scale` keeps what it sees in its
state, as plain arrays, and `ls.metrics(opt_state)` hands them to any logger. This notebook
uses them on a small next-token model trained on real text (Python's standard-library
sources, on every machine), on CPU in about a minute:

1. **underflow**: which fraction of the gradient elements float16 cannot represent well, at
   no scale, with `ls.dynamic` and with `ls.predictive` (`track_underflow=True`);
2. **a run about to diverge**: what the gradient norm, the scale and the skip rate do
   before a training blows up (`track_grad_norm=True`).""",
    ),
    ("code", INSTALL),
    (
        "code",
        """\
import collections
import pathlib
import re
import sysconfig

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import loss_scale as ls
import loss_scale.flax as lsf""",
    ),
    ("code", STDLIB_TOKENS),
    (
        "code",
        NEXT_TOKEN
        + """


def train(tx, steps):
    \"\"\"Trains a fresh float16 NextToken with `tx`; returns the loss and ls.metrics of every step.\"\"\"
    model = NextToken(dtype=jnp.float16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, context, targets):
        logits = model(context).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @nnx.jit
    def train_step(model, optimizer, context, targets):
        loss, grads = lsf.nnx_value_and_grad(loss_fn)(optimizer, model, context, targets)
        optimizer.update(model, grads)
        return loss, lsf.metrics(optimizer, prefix="")

    rng = np.random.default_rng(0)
    history = collections.defaultdict(list)
    for _ in range(steps):
        start = rng.integers(0, len(tokens) - CONTEXT, BATCH)
        window = jnp.asarray(tokens[start[:, None] + np.arange(CONTEXT + 1)])
        loss, metrics = train_step(model, optimizer, window[:, :-1], window[:, -1])
        history["loss"].append(float(loss))
        for name, value in metrics.items():
            history[name].append(float(value))
    return {name: np.asarray(values) for name, values in history.items()}""",
    ),
    (
        "markdown",
        """\
## 1. Underflow, measured

With `track_underflow=True` the state records, for every step, the fraction of the
(scaled) gradient elements that are exactly zero (`zero_fraction`) and the fraction below
float16's smallest normal number, $6.1 \\times 10^{-5}$ (`below_normal_fraction`): those are
subnormal in a float16 backward pass, with fewer significant bits, or flushed to zero. A
large and *growing* `below_normal_fraction` says the scale is too low. Three float16 runs of
the same model, the same batches:

* `ls.static(adam, 1.0)`: no scaling (scale 1), only counted;
* `ls.dynamic(adam)`: starts at $2^{15}$, doubles after 2,000 clean steps;
* `ls.predictive(adam)`: starts at $2^{15}$, then follows the gradients' peak.""",
    ),
    (
        "code",
        """\
STEPS = 120
underflow_runs = {
    "no scaling (scale 1)": train(ls.static(optax.adam(3e-3), 1.0, track_underflow=True), STEPS),
    "ls.dynamic": train(ls.dynamic(optax.adam(3e-3), track_underflow=True), STEPS),
    "ls.predictive": train(ls.predictive(optax.adam(3e-3), track_underflow=True), STEPS),
}
print(f"{'':22} {'below normal':>13} {'exactly 0':>10} {'final scale':>12} {'skipped':>8} {'final loss':>11}")
for name, h in underflow_runs.items():
    print(
        f"{name:22} {h['below_normal_fraction'][-20:].mean():13.2%} {h['zero_fraction'][-20:].mean():10.2%} "
        f"{h['scale'][-1]:12g} {int(h['skipped_steps'][-1]):8d} {h['loss'][-20:].mean():11.4f}"
    )

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.2))
for name, h in underflow_runs.items():
    (line,) = ax1.plot(h["below_normal_fraction"], label=f"{name}: below normal")
    ax1.plot(h["zero_fraction"], ":", color=line.get_color(), label=f"{name}: exactly 0")
    ax2.semilogy(h["scale"], base=2, label=name)
ax1.set(title="gradient elements float16 represents badly", xlabel="step", ylabel="fraction of elements")
ax2.set(title="loss scale", xlabel="step", ylabel="scale (log2 axis)")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()""",
    ),
    (
        "markdown",
        """\
Without a scale, three quarters of this model's gradient elements end up below float16's
normal range once training gets going. About a quarter are exactly 0 in any precision (the
embedding rows of tokens absent from a batch): that is the floor of every curve. Both scaled
runs sit on that floor from the first step: every other gradient element is in float16's
normal range. `ls.predictive` read the gradients' peak on its first step and raised the
scale while there was room ($2^{18}$ against `ls.dynamic`'s $2^{15}$), with no skipped step.
The final loss is the same for all three over 120 steps: the statistic tells you the scale
is too low before it shows in the loss, if it ever does.

## 2. A run about to diverge

Now an LR range test: SGD with momentum whose learning rate rises exponentially, from 0.05
to about 20 over the 260 steps, under `ls.dynamic(..., track_grad_norm=True)` (growth every 20 clean
steps, so that the scale can move within the run). Watch the four panels together.""",
    ),
    (
        "code",
        """\
STEPS = 260
lr = lambda step: 0.05 * 1000.0 ** (jnp.minimum(step, 300) / 300)  # noqa: E731
h = train(ls.dynamic(optax.sgd(lr, momentum=0.9), growth_interval=20, track_grad_norm=True), STEPS)
steps = np.arange(STEPS)
skipped = h["skipped"].astype(bool)
skip_rate = np.convolve(skipped, np.ones(20) / 20)[:STEPS]  # over the last 20 steps

fig, axes = plt.subplots(2, 2, figsize=(14, 7), sharex=True)
axes[0, 0].semilogy(steps[~skipped], h["loss"][~skipped])
axes[0, 0].set(title="training loss (applied steps)", ylabel="cross-entropy (log axis)")
norm = np.where(skipped, np.nan, h["grad_norm"])
axes[0, 1].semilogy(steps, norm, label="global norm")
axes[0, 1].semilogy(steps, np.where(skipped, np.nan, h["grad_max"]), label="largest element")
axes[0, 1].set(title="unscaled gradient (applied steps)", ylabel="log axis")
axes[0, 1].legend()
axes[1, 0].semilogy(steps, h["scale"], base=2)
axes[1, 0].semilogy(steps[skipped], h["scale"][skipped], "rx", base=2, label="skipped step")
axes[1, 0].set(title="loss scale", xlabel="step", ylabel="scale (log2 axis)")
axes[1, 0].legend()
axes[1, 1].plot(steps, skip_rate)
axes[1, 1].set(title="skip rate, last 20 steps", xlabel="step", ylabel="fraction skipped")
for ax in axes.flat:
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

first_run = np.flatnonzero(h["consecutive_skips"] >= 5)
print("learning rate at step 0, 150, 200, 250:", [round(float(lr(s)), 2) for s in (0, 150, 200, 250)])
print(
    "skipped steps:",
    int(h["skipped_steps"][-1]),
    "| first of 5 skips in a row at step:",
    int(first_run[0]) if len(first_run) else None,
    "| steps at min_scale:",
    int(h["steps_at_min"][-1]),
)""",
    ),
    (
        "markdown",
        """\
The signature, read from left to right:

* **healthy** (the first ~200 steps): the loss falls, then flattens; the gradient norm is
  flat; the scale climbs every 20 clean steps, and the skips are single (a growth one step
  too far, undone at once) or pairs;
* **about to diverge** (from ~step 200, learning rate ~5): the loss turns up, the gradient
  norm and the largest gradient element climb, skips come every few steps, and the scale
  stops climbing and steps down;
* **diverged** (from ~step 225): every step overflows, the scale backs off to `min_scale`
  within about ten steps and stays there (`steps_at_min` and `consecutive_skips` count up);
  nothing is applied any more.

The skip rate and the scale move together with the gradient norm, and they are recorded at
no cost (the norm costs a sum of squares, which is why `track_grad_norm` is off by default).
Skipping protected the parameters: no non-finite update was ever applied. To stop such a
run instead of letting it skip forever, build the transformation with
`max_consecutive_skips=n`: the n-th skip in a row raises `ls.SkippedStepsError` on the host,
naming the gradient leaves that overflowed. Logging `ls.metrics(opt_state)` every step (to
wandb, tensorboard or clu) gives these curves for any training.""",
    ),
]


def make_notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["colab"] = {"provenance": []}
    for kind, source in cells:
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(source))
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs every cell in a fresh python3 kernel, working directory notebooks/."""
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


NOTEBOOKS = {
    "01_why_loss_scaling.ipynb": WHY,
    "02_train_with_flax.ipynb": FLAX,
    "03_diagnostics.ipynb": DIAGNOSTICS,
}


def main(argv: list[str]) -> None:
    run = "--no-execute" not in argv
    argv = [a for a in argv if a != "--no-execute"]
    for name, cells in NOTEBOOKS.items():
        if argv and not any(a in name for a in argv):
            continue
        start = time.perf_counter()
        nb = make_notebook(cells)
        if run:
            execute(nb)
        # Stable ids keep diffs small when the notebooks are regenerated.
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{i:02d}"
        nbformat.write(nb, HERE / name)
        print(f"{name}: {'executed in' if run else 'written in'} {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])

# %% [markdown]
# # Why loss scaling?
#
# float16 has 5 exponent bits: it represents magnitudes from about $6 \times 10^{-8}$ to
# $65504$. Gradients of real models are often far smaller than that, and the ones below the
# range are rounded to **zero** in the backward pass: that part of the training signal is gone.
# **Loss scaling** multiplies the loss by a scale $S$ before differentiating, so every
# gradient is $S$ times larger and lands inside the range; the optimizer then divides by
# $S$ in float32. Dynamic loss scaling (`loss_scale.dynamic`) picks $S$ by itself: when a
# gradient overflows to inf the step is skipped and $S$ halves; after a run of clean steps
# $S$ doubles.
#
# This notebook shows, on CPU in under a minute:
#
# 1. the float16 number line, next to bfloat16 and float32;
# 2. the gradient magnitudes of a small language model on real text, against that range;
# 3. a linear regression whose gradients underflow in float16, with and without a scale;
# 4. what fraction of gradient elements flush to zero, as a function of the scale.

# %%
# Setup: run this cell first. loss_scale is not on the package index and its repository has no
# public address yet: the code comes from a copy of the repository you were given, a clone or an
# archive of one. Nothing is installed by name from the index: that name there is not this project's.
# Run the notebook from the copy's notebooks/ folder, or name the copy's folder (the one with
# pyproject.toml) in the LOSS_SCALE_REPOSITORY environment variable or in place of ".." below; on
# Colab, upload the archive, `!unzip` it and run `%env LOSS_SCALE_REPOSITORY=/content/loss_scale`.
# Where loss_scale is not installed, this cell installs the copy with pip and makes it importable
# in the running kernel: no restart is needed.
import importlib.util
import os
import pathlib
import subprocess
import sys

try:
    repository = pathlib.Path(os.environ["LOSS_SCALE_REPOSITORY"]).expanduser().resolve()
except KeyError:
    repository = pathlib.Path("..").resolve()  # this notebook's folder is the copy's notebooks/
if not (repository / "pyproject.toml").is_file() or not (repository / "examples" / "_common.py").is_file():
    raise FileNotFoundError(
        f"no copy of the loss_scale repository in {repository}. The package is not on the package index and its "
        "repository has no public address yet: get a copy (a clone, or an archive of one) from whoever gave you "
        "this notebook, put it where this kernel can read it (on Colab: upload the archive and `!unzip` it), name "
        "its folder in the LOSS_SCALE_REPOSITORY environment variable (`%env LOSS_SCALE_REPOSITORY=/path/to/it`) "
        'or in place of ".." in this cell, and run this cell again.'
    )
# Not installed, or only the copy's own folder named loss_scale in the working directory (a
# namespace package, with no origin).
if getattr(importlib.util.find_spec("loss_scale"), "origin", None) is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{repository}[examples]"], check=True)
    # pip's editable install takes effect in the next kernel (a .pth file read at start-up): in this
    # one the package is imported from the copy itself, and the dependencies pip just added are seen.
    sys.path.append(str(repository))
    importlib.invalidate_caches()
sys.path.insert(0, str(repository / "examples"))  # the notebooks' models and data

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import nnx_lm  # examples/nnx_lm.py: the word pieces of Python's standard library
import numpy as np
import optax

import loss_scale as ls

print("jax", jax.__version__, "on", jax.devices()[0].platform, "| loss_scale", ls.__version__)

# %% [markdown]
# ## 1. The float16 number line
#
# Every floating-point format has a **normal** range, where the relative precision is
# constant, **subnormals** below it, which trade precision for range (the last one has a
# single significant bit), then zero. Above the largest finite value lies **overflow** (inf).
# bfloat16 keeps float32's 8 exponent bits: its range is float32's, with less precision.

# %%
formats = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
print(f"{'':9} {'smallest subnormal':>19} {'smallest normal':>16} {'largest':>11} {'epsilon':>9}")
for name, dtype in formats.items():
    fi = jnp.finfo(dtype)
    limits = (fi.smallest_subnormal, fi.tiny, fi.max, fi.eps)
    print(f"{name:9} " + " ".join(f"{float(v):{w}.3g}" for v, w in zip(limits, (19, 16, 11, 9), strict=True)))

# %%
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
plt.show()


# %% [markdown]
# ## 2. Gradient magnitudes of a real model
#
# A small language model on real text: Python's own standard library, read from the
# interpreter's install directory (on Colab too; nothing is downloaded), cut into word
# pieces with a vocabulary of 4,096 by the tokenizer of `examples/nnx_lm.py`. The model
# embeds the two previous tokens and predicts the next one through a hidden layer. It is
# trained for a few dozen steps in float32, and then we look at the magnitudes of its
# gradients: the gradient of the loss with respect to the logits (the first activation
# gradient of the backward pass, which flows back through every layer) and the gradients of
# the weights.
#
# The loss is a mean over $N = 1024$ tokens, so each token contributes $(p - y)/N$ to the
# gradient of its logits: for the many tokens the model gives a small probability, that is
# far below $10^{-5}$.


# %%
VOCAB, DIM, HIDDEN, TOKENS = 4096, 64, 128, 1024
tokens, _ = nnx_lm.tokenize(nnx_lm.load_text(max_bytes=1_000_000), VOCAB)
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
print(f"{len(tokens):,} tokens; loss after 60 steps: {float(loss):.2f} nats (uniform: {np.log(VOCAB):.2f})")


# %%
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
plt.show()

# %% [markdown]
# At initialization every logit gradient is about $1/(4096 \cdot 1024) = 2^{-22}$: subnormal
# in float16, with only three significant bits. After a few dozen steps the model is
# confident about many tokens and most logit gradients are below $2^{-25}$: float16 rounds
# them to zero. The weight gradients, sums over the batch, are larger, but most of them are
# still subnormal in float16, where the precision is poor.
#
# With a scale $S = 2^{15}$ (the default initial scale of `ls.dynamic`) every gradient is
# $2^{15}$ times larger, so float16's cut-off moves from $2^{-25}$ to $2^{-40}$ in the
# original units (the dotted line): almost everything survives, with full precision.
#
# ## 3. A linear regression that float16 cannot finish without a scale
#
# Fit $y = Xw^*$ (no noise) by gradient descent on the mean squared error over $N = 16384$
# samples, with float32 master weights and the forward and backward pass in float16. The
# gradient of the loss with respect to each prediction is $2r_i/N$: once a residual $r_i$ is
# below $2^{-25} N / 2 \approx 2.4 \times 10^{-4}$ (the targets are about $0.01$), that
# gradient is rounded to zero in float16, and the weights stop moving long before float16's
# own rounding of the predictions (a few times $10^{-6}$ here) would stop them. This is the mechanism
# described in the mixed-precision training literature (Micikevicius et al., *Mixed
# Precision Training*, ICLR 2018), reproduced on a problem small enough to see everything.

# %%
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
    )

# %%
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
plt.show()


# %% [markdown]
# Without a scale, float16 gets stuck where the per-sample gradients underflow: the loss
# plateaus orders of magnitude above float32's, and nearly all of the gradient elements are
# zero. With `ls.dynamic` the same float16 computation keeps going until float16's own
# rounding of the predictions, not underflow, limits it. (float32's zeros at the end are
# residuals that are exactly 0: it has converged.)
#
# ## 4. How much flushes to zero, as a function of the scale
#
# Back to the language model of section 2 (trained weights, float32 master copy). Here its
# forward and backward pass run in float16 with the loss multiplied by $S$, for
# $S = 2^0 \dots 2^{30}$. Too small a scale loses gradients to zero; too large a scale
# overflows to inf, which is the step `ls.dynamic` skips before backing off.


# %%
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
        )

# %% [markdown]
# **Reading the plots.** At $S = 1$ most logit gradients are exactly zero (every token the
# model considers unlikely contributes less than $2^{-25}$), and the weight gradients built
# from them are off by a large relative error. Raising the scale recovers them; once the
# largest gradients exceed 65504 they overflow to inf (the error is then undefined, and the
# step has to be skipped). `ls.dynamic` finds that window by itself, and keeps finding it
# as the gradients change during training.
#
# Next: `02_train_with_flax.ipynb` trains flax linen and NNX models with `ls.dynamic`.

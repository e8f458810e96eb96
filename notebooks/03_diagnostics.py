# %% [markdown]
# # What the scaler tells you
#
# A loss scaler sees every gradient of every step. `loss_scale` keeps what it sees in its
# state, as plain arrays, and `ls.metrics(opt_state)` hands them to any logger. This notebook
# uses them on a small next-token model trained on real text (Python's standard-library
# sources, on every machine), on CPU in about a minute:
#
# 1. **underflow**: which fraction of the gradient elements float16 cannot represent well, at
#    no scale, with `ls.dynamic` and with `ls.predictive` (`track_underflow=True`);
# 2. **a run about to diverge**: what the gradient norm, the scale and the skip rate do
#    before a training blows up (`track_grad_norm=True`).

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
import collections

import jax.numpy as jnp
import matplotlib.pyplot as plt
import nnx_lm  # examples/nnx_lm.py: the next-token model and the stdlib word pieces
import numpy as np
import optax
from flax import nnx

import loss_scale as ls
import loss_scale.flax as lsf

# %% [markdown]
# The model is `nnx_lm.NextToken` from `examples/nnx_lm.py`: it embeds the previous three
# word pieces of the text and predicts the next one (a softmax over 2,048 pieces) through a
# hidden layer, computing in float16 with float32 parameters.

# %%
VOCAB, CONTEXT, BATCH = 2048, 3, 512
tokens, _ = nnx_lm.tokenize(nnx_lm.load_text(max_bytes=600_000), VOCAB)


def train(tx, steps):
    """Trains a fresh float16 NextToken with `tx`; returns the loss and ls.metrics of every step."""
    model = nnx_lm.NextToken(VOCAB, CONTEXT, dtype=jnp.float16, rngs=nnx.Rngs(0))
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
        loss, metrics = train_step(model, optimizer, *nnx_lm.next_token_batch(tokens, rng, BATCH, CONTEXT))
        history["loss"].append(float(loss))
        for name, value in metrics.items():
            history[name].append(float(value))
    return {name: np.asarray(values) for name, values in history.items()}


# %% [markdown]
# ## 1. Underflow, measured
#
# With `track_underflow=True` the state records, for every step, the fraction of the
# (scaled) gradient elements that are exactly zero (`zero_fraction`) and the fraction below
# float16's smallest normal number, $6.1 \times 10^{-5}$ (`below_normal_fraction`): those are
# subnormal in a float16 backward pass, with fewer significant bits, or flushed to zero. A
# large and *growing* `below_normal_fraction` says the scale is too low. Three float16 runs of
# the same model, the same batches:
#
# * `ls.static(adam, 1.0)`: no scaling (scale 1), only counted;
# * `ls.dynamic(adam)`: starts at $2^{15}$, doubles after 2,000 clean steps;
# * `ls.predictive(adam)`: starts at $2^{15}$, then follows the gradients' peak.

# %%
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
plt.show()

# %% [markdown]
# Without a scale, three quarters of this model's gradient elements end up below float16's
# normal range once training gets going. About a quarter are exactly 0 in any precision (the
# embedding rows of tokens absent from a batch): that is the floor of every curve. Both scaled
# runs sit on that floor from the first step: every other gradient element is in float16's
# normal range. `ls.predictive` read the gradients' peak on its first step and raised the
# scale while there was room ($2^{18}$ against `ls.dynamic`'s $2^{15}$), with no skipped step.
# The final loss is the same for all three over 120 steps: the statistic tells you the scale
# is too low before it shows in the loss, if it ever does.
#
# ## 2. A run about to diverge
#
# Now an LR range test: SGD with momentum whose learning rate rises exponentially, from 0.05
# to about 20 over the 260 steps, under `ls.dynamic(..., track_grad_norm=True)` (growth every 20 clean
# steps, so that the scale can move within the run). Watch the four panels together.

# %%
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
)

# %% [markdown]
# The signature, read from left to right:
#
# * **healthy** (the first ~200 steps): the loss falls, then flattens; the gradient norm is
#   flat; the scale climbs every 20 clean steps, and the skips are single (a growth one step
#   too far, undone at once) or pairs;
# * **about to diverge** (from ~step 200, learning rate ~5): the loss turns up, the gradient
#   norm and the largest gradient element climb, skips come every few steps, and the scale
#   stops climbing and steps down;
# * **diverged** (from ~step 235): every step overflows, the scale backs off to `min_scale`
#   within about ten steps and stays there (`steps_at_min` and `consecutive_skips` count up);
#   nothing is applied any more.
#
# The skip rate and the scale move together with the gradient norm, and they are recorded at
# no cost (the norm costs a sum of squares, which is why `track_grad_norm` is off by default).
# Skipping protected the parameters: no non-finite update was ever applied. To stop such a
# run instead of letting it skip forever, call `ls.check_skips(opt_state, n)` after each step:
# from the n-th skip in a row it raises `ls.SkippedStepsError`, saying how many steps were
# skipped and the scale now. (Built with `max_consecutive_skips=n`, the transformation raises it
# itself, naming the gradient leaves that overflowed; inside `jit` that reaches you as a
# `jax.errors.JaxRuntimeError` whose message contains `SkippedStepsError: loss_scale: `.)
# Logging `ls.metrics(opt_state)` every step (to wandb, tensorboard or clu) gives these curves
# for any training.

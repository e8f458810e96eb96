# %% [markdown]
# # Why did my float16 run fail?
#
# A float16 run that trains for a while, then stops: the loss scaler skips more and more
# steps, its scale falls to its minimum, and from then on every step is skipped. The scaler's
# metrics say *that* the gradients overflow, and `ls.overflow_paths` which parameters got a
# non-finite gradient (all of them, once the overflow has travelled back through the whole
# backward pass). Neither says *which operation* overflowed. `ls.range_report` does: it runs
# the loss function forward and backward once, at a loss scale, and reports the range of every
# value the loss function computes and of the cotangent that reaches it in the backward pass.
#
# This notebook trains a small next-token model on real text (Python's standard-library
# sources, nothing is downloaded) until its float16 run fails, asks `ls.range_report` why,
# computes the op it names in float32, and trains again. Runs on CPU in well under a minute.

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

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import nnx_lm  # examples/nnx_lm.py: the next-token model and the stdlib word pieces
import numpy as np
import optax
from flax import nnx

import loss_scale as ls
import loss_scale.flax as lsf

# %% [markdown]
# ## The model, and a loss function as it is often written
#
# The model is `nnx_lm.NextToken` from `examples/nnx_lm.py`: it embeds the previous three word
# pieces of the text and predicts the next one (a softmax over 2,048 pieces) through a hidden
# layer with a LayerNorm, computing in float16 with float32 parameters. The subclass below
# only names its layers with `jax.named_scope`, so that the report can say which layer a value
# belongs to (flax linen records its module names by itself; NNX does not).
#
# The loss is the textbook formula, the log of the softmax probability of the right next
# token, written as it reads: `jnp.log(jax.nn.softmax(logits))`. In float32 this is fine.

# %%
VOCAB, CONTEXT, BATCH, STEPS = 2048, 3, 256, 160
tokens, _ = nnx_lm.tokenize(nnx_lm.load_text(max_bytes=600_000), VOCAB)
rng = np.random.default_rng(0)
batches = [nnx_lm.next_token_batch(tokens, rng, BATCH, CONTEXT) for _ in range(STEPS)]  # the same for every run


class NamedNextToken(nnx_lm.NextToken):
    """nnx_lm.NextToken, each layer under a jax.named_scope (the report's "where" column)."""

    def __call__(self, context):
        with jax.named_scope("embed"):
            x = self.embed(context).reshape(context.shape[0], -1)
        with jax.named_scope("hidden"):
            x = self.hidden(x)
        with jax.named_scope("norm_gelu"):
            x = nnx.gelu(self.norm(x))
        with jax.named_scope("head"):
            return self.head(x)


def textbook_loss(model, context, targets):
    logits = model(context)  # float16 in a float16 model
    log_probs = jnp.log(jax.nn.softmax(logits))
    return -jnp.take_along_axis(log_probs, targets[:, None], axis=-1).mean()


def train(loss_fn, dtype, steps=STEPS):
    """Trains a fresh model computing in `dtype` with ls.dynamic(adam); returns it, and the loss
    and ls.metrics of every step."""
    model = NamedNextToken(VOCAB, CONTEXT, dtype=dtype, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ls.dynamic(optax.adam(3e-3)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, context, targets):
        loss, grads = lsf.nnx_value_and_grad(loss_fn)(optimizer, model, context, targets)
        optimizer.update(model, grads)
        return loss, lsf.metrics(optimizer, prefix="")

    history = collections.defaultdict(list)
    for context, targets in batches[:steps]:
        loss, metrics = train_step(model, optimizer, context, targets)
        history["loss"].append(float(loss))
        for name, value in metrics.items():
            history[name].append(float(value))
    return model, {name: np.asarray(values) for name, values in history.items()}


def summary(runs):
    print(f"{'':38} {'skipped':>8} {'at min scale':>13} {'final scale':>12} {'loss, last 20 steps':>20}")
    for name, (_, h) in runs.items():
        print(
            f"{name:38} {int(h['skipped_steps'][-1]):8d} {int(h['steps_at_min'][-1]):13d} "
            f"{h['scale'][-1]:12g} {h['loss'][-20:].mean():20.3f}"
        )


# %% [markdown]
# ## The failing run
#
# The same model, data and optimizer twice: computing in float32, and in float16 with
# `ls.dynamic` (initial scale $2^{15}$, halved on every overflow, `min_scale` 1).

# %%
runs = {
    "float32": train(textbook_loss, jnp.float32),
    "float16 + ls.dynamic": train(textbook_loss, jnp.float16),
}
summary(runs)
failed = runs["float16 + ls.dynamic"][1]
stuck = np.flatnonzero(failed["steps_at_min"] > 0)
print("first step at the minimum scale:", int(stuck[0]) if len(stuck) else None)
print("last 20 steps: skipped", int(failed["skipped"][-20:].sum()), "of 20")


def plot_runs(runs, title):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.2))
    for name, (_, h) in runs.items():
        applied = ~h["skipped"].astype(bool)
        ax1.plot(np.flatnonzero(applied), h["loss"][applied], label=name, lw=1)
        (line,) = ax2.semilogy(h["scale"], base=2, label=name)
        skipped = np.flatnonzero(~applied)
        ax2.semilogy(skipped, h["scale"][skipped], "x", color=line.get_color(), ms=4, base=2)
    ax1.set(title=f"{title}: training loss (applied steps)", xlabel="step", ylabel="cross-entropy")
    ax2.set(title="loss scale (x: skipped step)", xlabel="step", ylabel="scale (log2 axis)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    plt.show()


plot_runs(runs, "jnp.log(jax.nn.softmax(logits))")

# %% [markdown]
# The float32 run trains. The float16 run skips a step on its first batch, and then again and
# again: every skip halves the scale, and after a while the scale is at its minimum, 1, and
# steps still overflow there (the crosses on the right), more of them the longer it trains: the
# scaler has nothing left to give. Its loss curve falls behind the float32 one. The
# gradients that the scaler checks are those of the parameters, and they are all non-finite by
# the time they reach it: the overflow happened somewhere inside the backward pass and
# travelled back from there through every layer.
#
# ## Which operation overflows?
#
# `ls.range_report` runs the loss function once, forward and backward, on the failed model and
# a batch on which it still overflows (the last such batch of the run, found with one jitted
# check per batch), at the scale the run is stuck at, with a float16 forward pass as in
# training. Each row is one value the loss function computes: where it
# comes from (`jax.named_scope` names, then file:line and function), the primitive that
# produced it, its forward `max |x|`, the `max |cotangent|` that reaches it in the backward
# pass, the fractions of that cotangent that are 0 and below float16's smallest normal number,
# and its headroom (how many times larger its cotangent could be before it overflows, at the
# report's `max_safe_scale`). The table lists the widest offenders first; the first row of
# `report.overflowing` is the value that overflows first as the scale grows.

# %%
model, _ = runs["float16 + ls.dynamic"]
scale = float(failed["scale"][-1])


@nnx.jit
def overflows(model, context, targets):
    """Whether the float16 backward pass at `scale` gives a non-finite parameter gradient."""
    grads = nnx.grad(lambda m: textbook_loss(m, context, targets).astype(jnp.float32) * scale)(model)
    return jnp.logical_not(ls.all_finite(grads))


last = next(i for i in reversed(range(STEPS)) if overflows(model, *batches[i]))
context, targets = batches[last]
print(f"the failed model overflows on the batch of step {last} (of {STEPS}) at scale {scale:g}")
report = ls.range_report(textbook_loss, model, context, targets, scale=scale)
print(report)
first = report.overflowing[0]
print("\nfirst to overflow:", first.primitive, "at", first.where, "| max safe scale:", report.max_safe_scale)
assert first.primitive == "div" and "textbook_loss" in first.where, first  # the softmax's division

# %% [markdown]
# The value that overflows first is the output of a `div` in `textbook_loss`, on the line
# `jnp.log(jax.nn.softmax(logits))`: the division inside `jax.nn.softmax`, that is, the
# probabilities. Its forward maximum is below 1, but the cotangent that reaches it is not
# finite, and neither is any cotangent the backward pass computes after it (the rows below it
# in the table: the logits, the head, the LayerNorm, down to the embedding and the parameter
# gradients). The `log` row after it says why: its forward maximum is inf. Some probabilities
# are exactly 0: float16's smallest positive number is about $6 \times 10^{-8}$, and the
# probability of a token whose logit is more than about 17 below the largest rounds to 0 (the
# `sub` row, $x - \max x$, reaches that). Their log is $-\infty$, which does no harm in the
# forward pass, since the loss only picks the right token's log-probability. But the backward
# pass of $\log p$ divides the incoming cotangent by $p$, and for those tokens that is
# $0 / 0$, NaN, at any scale: `max_safe_scale` is `None` (no power of two down to $2^{-64}$
# keeps the backward pass finite). On the way there, the scale fell step by step for a milder
# form of the same division: the right token's probability gets the cotangent $-s / (N p)$ at
# scale $s$ with $N$ tokens per batch, which exceeds 65,504 at $s = 2^{15}$ already at the first
# step, where $p$ is about $1 / 2048$. In numbers, on this batch:

# %%
probs16 = jax.nn.softmax(model(context))  # float16, as in training
right = jnp.take_along_axis(probs16, targets[:, None], axis=-1)
_, log_vjp = jax.vjp(jnp.log, probs16)
(cotangent,) = log_vjp(jnp.zeros_like(probs16))  # the backward pass of log, for the tokens not picked
print(f"probabilities exactly 0 in float16: {int((probs16 == 0).sum()):,} of {probs16.size:,}")
print(
    f"cotangents of log that are NaN (0 / 0) even with a zero incoming cotangent: {int(jnp.isnan(cotangent).sum()):,}"
)
print(f"smallest probability of a right token: {float(right.min()):.2g}")
print(f"first step: 2**15 / (N p) with p = 1/{VOCAB}: {2.0**15 / (BATCH / VOCAB):,.0f} (float16 max: 65,504)")

# %% [markdown]
# ## The fix: that op in float32
#
# The division by `p` has to go. `optax.softmax_cross_entropy_with_integer_labels` computes the
# log-probabilities as `logits - logsumexp(logits)`, whose backward pass is
# `softmax(logits) - onehot(targets)`: never larger than 1 per token, whatever `p` is. And the
# logits go to float32 first, the usual rule for losses in mixed precision (the model still
# computes in float16; the loss is a few operations on one array).


# %%
def fixed_loss(model, context, targets):
    logits = model(context).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


runs["float16 + ls.dynamic, loss in float32"] = train(fixed_loss, jnp.float16)
summary(runs)
plot_runs(runs, "before and after the fix")

# %% [markdown]
# With the loss in float32 the float16 run skips no step or almost none (the table is
# measured), keeps its scale from $2^{15}$ on, and follows the float32 run step for step: the
# two loss curves lie on top of each other. The float32 run of the textbook loss and the fixed
# loss compute the same numbers, up to rounding.
#
# ## The backward pass against the float16 range
#
# The same report for the fixed model, on the same batch, at the scale its run ended with, and
# a plot of both: for every value of the forward pass, the largest cotangent that reaches it,
# by layer (the `jax.named_scope` names; "loss" is what `textbook_loss` or `fixed_loss` compute
# on the logits, "params" the parameter gradients), each report at its own scale. The dashed
# lines are float16's range: its largest number, 65,504, and its smallest normal number,
# $6.1 \times 10^{-5}$ (below it, values lose precision as subnormals, then become 0). Values
# that are not finite are drawn above the top line, zero cotangents are left out.

# %%
fixed_model, fixed_history = runs["float16 + ls.dynamic, loss in float32"]
fixed_report = ls.range_report(fixed_loss, fixed_model, context, targets, scale=float(fixed_history["scale"][-1]))
print(str(fixed_report).split("\n")[0])
assert not fixed_report.overflowing

F16 = jnp.finfo(jnp.float16)
LAYERS = ["params", "embed", "hidden", "norm_gelu", "head", "loss"]
NOT_FINITE = 3e6  # where the plot draws inf and NaN


def layer(row):
    if row.primitive == "argument":
        return "params"
    name = row.where.split(" ")[0].split("/")[0]
    return name if name in LAYERS else "loss"


fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), sharey=True)
for ax, rep, title in [(axes[0], report, "failed model"), (axes[1], fixed_report, "fixed model (loss in float32)")]:
    for i, name in enumerate(LAYERS):
        peaks = np.array([r.backward_max for r in rep.rows if layer(r) == name])
        peaks = np.where(np.isfinite(peaks), peaks, NOT_FINITE)
        peaks = peaks[peaks > 0]  # a zero cotangent has no place on a log axis
        x = i + np.linspace(-0.3, 0.3, len(peaks))
        finite = peaks < NOT_FINITE
        ax.scatter(x[finite], peaks[finite], s=12, color="C0")
        ax.scatter(x[~finite], peaks[~finite], s=20, marker="x", color="red")
    ax.axhline(float(F16.max), color="red", ls="--", lw=1, label="float16 max, 65504")
    ax.axhline(float(F16.smallest_normal), color="gray", ls="--", lw=1, label="float16 smallest normal")
    ax.set_yscale("log")
    ax.set_xticks(range(len(LAYERS)), LAYERS)
    ax.set(title=f"{title}, scale 2^{int(np.log2(rep.scale))}", xlabel="layer (forward order)")
    ax.grid(alpha=0.3)
axes[0].text(-0.45, 1.1e6, "x: not finite (inf or NaN)", fontsize=9, color="red")
axes[0].set_ylabel("max |cotangent| of each value")
axes[0].legend(loc="lower left", fontsize=8)
fig.tight_layout()
plt.show()
for name, rep in [("failed", report), ("fixed", fixed_report)]:
    print(f"{name} model: {sum(r.overflows for r in rep.rows)} of {len(rep.rows)} cotangents not finite")
params = [r for r in fixed_report.rows if r.primitive == "argument"]
print(
    f"fixed model, parameter gradient elements exactly 0: {np.mean([r.backward_zero for r in params]):.1%}, "
    f"below the smallest normal (zeros included): {np.mean([r.backward_below_normal for r in params]):.1%}"
)

# %% [markdown]
# In the failed model, the cotangents of the loss's first few values are finite (the loss is),
# then the probabilities' is not, and from there every layer's, back to the parameters, is
# inf or NaN. In the fixed model, at a scale thousands of times higher, every cotangent is
# finite and sits inside float16's range, the largest below 65,504 with room to spare
# (`max_safe_scale` in the first line of its report). Compare the two fractions printed last:
# where they are equal, every parameter gradient element below the smallest normal is an
# exact zero, which it is in any precision (the embedding rows of tokens absent from the
# batch, for example), and none is lost to float16.
#
# ## What to take away
#
# * When a float16 run skips more and more steps and its scale falls to the minimum, an
#   operation inside the loss function overflows, or divides by zero, at any scale: the scaler
#   cannot fix it, and the parameters it checks only carry the result.
# * `ls.range_report(loss_fn, *args, scale=...)` on the model and batch of a skipped step
#   names it: `report.overflowing[0]` is the value whose cotangent fails first (with its
#   `jax.named_scope` names, file:line and primitive), and a `max_safe_scale` below the
#   scaler's `min_scale`, or `None`, says that no scale will do.
# * The usual culprits divide by a small number in the backward pass (`log`, `sqrt`, a
#   normalization with an epsilon float16 rounds to 0) or add up many values in the forward
#   pass (a sum of squares, a softmax without its maximum subtracted): compute those in
#   float32. Here the loss went to float32 (`optax`'s cross-entropy on float32 logits), and the
#   float16 run follows the float32 one.

# %% [markdown]
# # Automatic mixed precision: a float32 model trained in float16
#
# Mixed precision is usually written by hand: the parameters and the inputs are cast to float16
# inside the loss function, and the logits back to float32 for the loss. `ls.autocast(loss_fn)`
# does it for a function written entirely in float32: its matrix products (and convolutions)
# run in float16, with the float32 parameters cast where the products read them; the
# operations that lose range or accuracy in float16 (exponentials, logarithms, sums,
# `rsqrt`) run in float32, so the softmax, the cross-entropy and a layer norm's statistics stay
# float32; everything else follows its inputs. float16 holds magnitudes from about
# $6 \times 10^{-8}$ to $65504$, so the backward pass still needs a loss scale: `ls.dynamic`.
#
# This notebook, on a CPU in under a minute:
#
# 1. writes a small classifier in float32 (no dtype anywhere) and autocasts it;
# 2. shows the dtype each operation of its jaxpr runs in, forward and backward;
# 3. trains it 200 steps with `ls.dynamic`, against the same model cast by hand and float32;
# 4. compares `ls.range_report` before and after autocast.

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

import _common  # examples/_common.py: scikit-learn's bundled digits
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import loss_scale as ls

print(f"JAX {jax.__version__} on {_common.device_line()}")

# %% [markdown]
# ## A model written in float32
#
# A two-hidden-layer MLP with layer norm and gelu, classifying scikit-learn's 8x8 digits (nothing
# is downloaded). Nothing in it names a dtype: the parameters and the images are float32.

# %%
x_train, x_test, y_train, y_test = _common.digits(0)
x_train, x_test = (jnp.asarray(x.reshape(len(x), -1)) for x in (x_train, x_test))  # 64 pixels in 0..1
y_train, y_test = jnp.asarray(y_train), jnp.asarray(y_test)


def init(key, sizes=(64, 128, 128, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (m, n)) * np.sqrt(2 / m),
            "b": jnp.zeros(n),
            "scale": jnp.ones(n),
            "shift": jnp.zeros(n),
        }
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def layer_norm(h, scale, shift, eps=1e-5):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + eps) * scale + shift


def logits_fn(params, x):
    h = x
    for layer in params[:-1]:
        h = jax.nn.gelu(layer_norm(h @ layer["w"] + layer["b"], layer["scale"], layer["shift"]))
    return h @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    log_probs = jax.nn.log_softmax(logits_fn(params, x))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


params0 = init(jax.random.key(0))
f16_loss = ls.autocast(loss_fn)  # the same signature: (params, x, y) -> float32 loss
x, y = x_train[:64], y_train[:64]
print(f"float32 loss {float(loss_fn(params0, x, y)):.5f}, autocast loss {float(f16_loss(params0, x, y)):.5f}")
print("gradient dtypes:", {g.dtype.name for g in jax.tree.leaves(jax.grad(f16_loss)(params0, x, y))})

# %% [markdown]
# ## What runs in which dtype
#
# `jax.make_jaxpr` of the autocast function shows the program it runs. The helper below walks
# it (into the bodies of jitted calls such as `jax.nn.log_softmax`) and counts the operations
# by primitive and output dtype. The three products read float16 operands; two return
# float16, and the logits' product, which the log-softmax reads, returns its float32
# accumulation (it runs inside a small `custom_jvp` function, the `custom_jvp_call` row, whose
# derivative runs its products in float16, as a hand-cast `(h @ w).astype(float32)` does).
# `exp`, `log`, the sums and
# `rsqrt` are float32; `convert_element_type` rows are the casts autocast inserted where a
# float32 value is read by a float16 operation, or the reverse. The gelus' `tanh` and
# `integer_pow` are float32 too: they read a layer norm's output, a value computed in float32,
# and an operation that only follows its inputs (arithmetic, `tanh`, comparisons) stays in
# float32 then, as JAX's promotion would have it. The log-softmax runs in float32 from the
# float16 logits on: its shift by the largest logit (`reduce_max`) is on the float32 list.


# %%
def dtype_counts(fn, *args):
    """``{primitive: {dtype: count}}`` of the floating outputs of every equation of ``fn``'s jaxpr."""
    counts = collections.defaultdict(collections.Counter)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                if jnp.issubdtype(var.aval.dtype, jnp.floating):
                    counts[eqn.primitive.name][var.aval.dtype.name] += 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return {name: dict(sorted(c.items())) for name, c in sorted(counts.items())}


for name, dtypes in dtype_counts(f16_loss, params0, x, y).items():
    print(f"{name:22s} {dtypes}")

# %% [markdown]
# The backward pass is JAX's derivative of that program: each product's transposes are float16
# products too (the one float32 result is the logits' forward product), and the parameters'
# gradients come back to float32 through the casts.

# %%
print("forward products: ", dtype_counts(f16_loss, params0, x, y)["dot_general"])
print("gradient products:", dtype_counts(jax.grad(f16_loss), params0, x, y)["dot_general"])
print("float32 model:    ", dtype_counts(jax.grad(loss_fn), params0, x, y)["dot_general"])

# %% [markdown]
# ## Training: autocast, the hand-cast model, float32
#
# Three runs from the same initialization, on the same batches, Adam, 200 steps:
#
# * `autocast + ls.dynamic`: `ls.value_and_grad(ls.autocast(loss_fn))` and `ls.dynamic(adam)`;
# * `hand-cast + ls.dynamic`: the same model cast by hand, the way jmp and MPX users write it
#   (the parameters and the images cast to float16, the logits to float32), with `ls.dynamic`;
# * `float32`: `loss_fn` itself, with `ls.no_op(adam)` (scale 1).
#
# The final loss of each is the float32 loss of its trained parameters on the whole training set.


# %%
def hand_cast_loss(params, x, y):
    half = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    log_probs = jax.nn.log_softmax(logits_fn(half, x.astype(jnp.float16)).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


STEPS, BATCH = 200, 64


def train(fn, tx):
    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = ls.value_and_grad(fn)(opt_state, params, x, y)  # grads of loss * scale
        updates, opt_state = tx.update(grads, opt_state, params)  # unscale, check, skip or apply
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, losses, scales = params0, tx.init(params0), [], []
    rng = np.random.default_rng(0)  # the same batches for every run
    for _ in range(STEPS):
        batch = rng.choice(len(y_train), BATCH, replace=False)
        scales.append(float(ls.get_scale(opt_state)))
        params, opt_state, loss = step(params, opt_state, x_train[batch], y_train[batch])
        losses.append(float(loss))
    return params, opt_state, np.asarray(losses), scales


runs = {
    "autocast + ls.dynamic": train(ls.autocast(loss_fn), ls.dynamic(optax.adam(1e-3))),
    "hand-cast + ls.dynamic": train(hand_cast_loss, ls.dynamic(optax.adam(1e-3))),
    "float32": train(loss_fn, ls.no_op(optax.adam(1e-3))),
}
final = {name: float(loss_fn(run[0], x_train, y_train)) for name, run in runs.items()}
for name, (params, opt_state, _, _) in runs.items():
    accuracy = float(jnp.mean(jnp.argmax(logits_fn(params, x_test), -1) == y_test))
    print(
        f"{name:24s} final loss {final[name]:.5f}   test accuracy {accuracy:.1%}   "
        f"scale {float(ls.get_scale(opt_state)):g}   skipped {int(ls.find_state(opt_state).skipped_steps)}"
    )
gap = final["autocast + ls.dynamic"] / final["hand-cast + ls.dynamic"] - 1
against_float32 = final["autocast + ls.dynamic"] / final["float32"] - 1
print(f"autocast against the hand-cast model: {gap:+.3%}; against float32: {against_float32:+.3%}")
assert abs(gap) < 0.01, gap

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
reference = runs["float32"][2]
for name, (_, _, losses, _) in runs.items():
    left.semilogy(np.convolve(losses, np.ones(10) / 10, mode="valid"), label=name)
    if name != "float32":
        right.semilogy(np.abs(losses - reference) + 1e-9, label=name, alpha=0.7)
left.set(xlabel="step", ylabel="training loss (10-step mean)", title="training loss")
right.set(xlabel="step", ylabel="|loss - float32 loss|", title="distance from the float32 run, per step")
left.legend()
right.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The autocast run follows the hand-cast one: the products, which carry the rounding, are
# float16 in both. Where they differ, autocast keeps more in float32 (the layer norms'
# statistics, the log-softmax's exponentials and sums), the hand-cast model computes them in
# float16.
#
# ## Before and after, in the range report
#
# `ls.range_report(fn, ...)` runs the loss forward and backward once at a loss scale and reports
# every floating value: where it is computed (file:line), its dtype, its forward max and the max
# of its cotangent. Handed the autocast function, it shows the program autocast runs: the same
# lines of `logits_fn`, now with float16 values, and a largest safe scale that is no longer
# float32's.

# %%
before = ls.range_report(loss_fn, params0, x, y)
after = ls.range_report(ls.autocast(loss_fn), params0, x, y)
for name, report in (("before", before), ("after", after)):
    dtypes = collections.Counter(str(row.dtype) for row in report.rows)
    print(f"{name}: {dict(sorted(dtypes.items()))}, largest safe scale 2**{int(np.log2(report.max_safe_scale))}")
print()
print("after, the float16 values:")
for row in after.rows:
    if str(row.dtype) == "float16":
        where = row.where.rpartition(" ")[2]  # the function; the file is the notebook's cell
        print(f"  {where:12s} {row.primitive:21s} max {row.forward_max:6.3g}, cotangent max {row.backward_max:8.3g}")

# %%
fig, ax = plt.subplots(figsize=(11, 3.5))
for name, report, marker in (("before (float32)", before, "o"), ("after (autocast)", after, "x")):
    for dtype, color in (("float32", "C0"), ("float16", "C1")):
        rows = [row for row in report.rows if str(row.dtype) == dtype and row.backward_max > 0]
        if rows:
            ax.scatter(
                [row.forward_max for row in rows],
                [row.backward_max for row in rows],
                marker=marker,
                color=color,
                label=f"{name}: {dtype} values",
            )
ax.axhline(65504, color="k", lw=0.8, ls="--", label="float16's largest, 65504")
ax.set(xscale="log", yscale="log", xlabel="forward max", ylabel="backward max at scale $2^{15}$")
ax.set_title("every value of the loss, before and after autocast")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The float16 values (orange crosses) are the three products, the casts of what they read and
# the bias additions; every other value is where it was, in float32. At the report's default
# scale, $2^{15}$, every float16 cotangent is below 65504; the largest safe scale went from
# float32's $2^{127}$ to $2^{17}$, and the scale `ls.dynamic` trained at, $2^{15}$, stays below it.
#
# ## Keeping a region in float32
#
# `ls.full_precision(fn)` marks a function whose calls stay float32 inside `ls.autocast`, its
# products included (outside autocast it is `fn`). Here the output layer is kept in float32:


# %%
def logits_fp32_head(params, x):
    h = x
    for layer in params[:-1]:
        h = jax.nn.gelu(layer_norm(h @ layer["w"] + layer["b"], layer["scale"], layer["shift"]))
    head = ls.full_precision(lambda h, w, b: h @ w + b)
    return head(h, params[-1]["w"], params[-1]["b"])


print("products:", dtype_counts(ls.autocast(logits_fp32_head), params0, x)["dot_general"])

# %% [markdown]
# The guide "Automatic mixed precision" (`docs/guides/autocast.md`) has the rules and the
# three operation lists in full, bfloat16, `ls.Policy.autocast`, what is kept as declared
# (random bits, sorting, callbacks, Pallas and custom calls) and how `custom_jvp`/`custom_vjp`
# functions behave under differentiation; `examples/autocast_mlp.py` trains an Equinox MLP the
# same way from the command line.

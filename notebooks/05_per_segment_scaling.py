# %% [markdown]
# # When one scale cannot fit: per-segment loss scaling
#
# Every loss scaler multiplies the whole backward pass by one number. When the cotangents of
# different parts of a model lie more binades apart than float16 holds (about 40, from
# $2^{-24}$ to 65504), no single scale fits: the scale that keeps the largest cotangent finite
# leaves the smallest part's cotangents below $2^{-24}$, where they are flushed to zero, and
# that part of the model stops learning. This notebook shows it on a deep sigmoid network (the
# textbook vanishing gradient), then fixes it with `ls.segment` boundaries and
# `ls.predictive(..., segments=...)`, which give each part of the backward pass a scale of its
# own. About a minute on a CPU.

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
import numpy as np
import optax

import loss_scale as ls

# %% [markdown]
# ## The model
#
# Twenty-four sigmoid layers of width 32 (weights drawn with gain 2), no normalisation, float32
# parameters, float16 forward and backward. The derivative of a sigmoid is at most 1/4, so each
# layer shrinks the cotangent by a binade or more on its way back: the first layers' cotangents
# lie far below the head's.
# `ls.segment(h, name)` after every second layer marks a boundary; it does nothing unless the
# optimizer has segments, so the same function serves every run below. The task: four classes
# drawn from a fixed random teacher network.

# %%
DEPTH, WIDTH, CLASSES, BATCH = 24, 32, 4, 128
SEGMENTS = tuple(f"layer{k:02d}" for k in range(1, DEPTH, 2))
rng = np.random.default_rng(0)
params = {
    "layers": [
        {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) * 2 / np.sqrt(WIDTH), jnp.float32), "b": jnp.zeros(WIDTH)}
        for _ in range(DEPTH)
    ],
    "head": {
        "w": jnp.asarray(rng.standard_normal((WIDTH, CLASSES)) / np.sqrt(WIDTH), jnp.float32),
        "b": jnp.zeros(CLASSES),
    },
}
teacher = rng.standard_normal((WIDTH, CLASSES)).astype(np.float32)


def batch(seed):
    x = np.random.default_rng(seed).standard_normal((BATCH, WIDTH)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.argmax(np.tanh(x) @ teacher, axis=1).astype(np.int32))


def loss_fn(params, batch, dtype=jnp.float16):
    x, labels = batch
    h = x.astype(dtype)
    for k, layer in enumerate(params["layers"]):
        h = jax.nn.sigmoid(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
        if f"layer{k:02d}" in SEGMENTS:
            h = ls.segment(h, f"layer{k:02d}")  # a boundary: everything before it is segment layerNN
    logits = (h @ params["head"]["w"].astype(dtype) + params["head"]["b"].astype(dtype)).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


# %% [markdown]
# ## Before: one scale
#
# `ls.range_report` runs the backward pass once and reports every value. Given the
# boundaries' exponents (`segments=`, all 0 here: one scale), it also labels each row with its
# segment and sums up each segment. At the largest scale that does not overflow, the first
# segments' cotangents are still entirely zero in float16:

# %%
one_scale = dict.fromkeys(SEGMENTS, 0)
probe = ls.range_report(loss_fn, params, batch(0), scale=1.0, segments=one_scale)
before = ls.range_report(loss_fn, params, batch(0), scale=probe.max_safe_scale, segments=one_scale)
print(f"largest safe scale: 2**{int(np.log2(before.max_safe_scale))}")
for row in before.segments:
    print(f"{row.name:8s} largest cotangent {row.backward_max:9.3g}   flushed to zero {row.backward_zero:6.1%}")

# %% [markdown]
# ## Training: float32, one scale, a scale per segment
#
# The same initialization and batches, Adam, 400 steps:
#
# * `float32`: the reference;
# * `ls.predictive`: one scale, aimed at the measured peak of the whole backward pass
#   (`ls.value_grad_and_peak`), the best a global scale can do;
# * `per-segment`: `ls.predictive(..., segments=SEGMENTS)`, measured the same way: the global
#   scale as before, and each boundary's factor $2^e$ set from its own segment's peak.

# %%
STEPS = 400


def train(run):
    adam = optax.adam(3e-3)
    if run == "float32":
        tx, step_loss = adam, lambda p, b: loss_fn(p, b, jnp.float32)

        @jax.jit
        def step(p, state, b):
            loss, grads = jax.value_and_grad(step_loss)(p, b)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state, loss

    else:
        tx = ls.predictive(adam, initial_scale=1.0, segments=SEGMENTS if run == "per-segment" else None)

        @jax.jit
        def step(p, state, b):
            loss, grads, peak = ls.value_grad_and_peak(loss_fn, every=16)(state, p, b)
            updates, state = tx.update(grads, state, p, backward_peak=peak)
            return optax.apply_updates(p, updates), state, loss

    p, state, losses = params, tx.init(params), []
    for i in range(STEPS):
        p, state, loss = step(p, state, batch(1000 + i))
        losses.append(float(loss))
    return p, state, np.asarray(losses)


runs = {name: train(name) for name in ("float32", "ls.predictive", "per-segment")}
for name, (p, _, _) in runs.items():
    evaluation = np.mean([float(loss_fn(p, batch(k), jnp.float32)) for k in range(4)])
    print(f"{name:14s} final evaluation loss {evaluation:.4f}")

# %% [markdown]
# The loss barely moves in 400 steps in any precision: a deep sigmoid network is hard to train
# whatever the dtype (its gradients vanish in float32 too). What float16 changes is the first
# layers' gradients, and Adam turns even tiny gradients into full-size steps, so it shows in
# how far each layer's weights moved from their initial values. With one scale part of the first
# layer's gradient is flushed to zero, and that layer moves differently than in float32; with a
# scale per segment every layer moves as in float32.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, (p, _, losses) in runs.items():
    moved = [float(jnp.linalg.norm(a["w"] - b["w"])) for a, b in zip(p["layers"], params["layers"], strict=True)]
    left.semilogy(range(DEPTH), np.maximum(moved, 1e-12), "o-", label=name)
    right.plot(np.convolve(losses, np.ones(20) / 20, mode="valid"), label=name)
left.set(xlabel="layer", ylabel="|W - W0| (1e-12: not moved)", title="which layers learned")
right.set(xlabel="step", ylabel="training loss (20-step mean)", title="training loss")
left.legend()
right.legend()
plt.tight_layout()
plt.show()

reference = [
    float(jnp.linalg.norm(a["w"] - b["w"])) for a, b in zip(runs["float32"][0]["layers"], params["layers"], strict=True)
]
for name in ("ls.predictive", "per-segment"):
    moved = [
        float(jnp.linalg.norm(a["w"] - b["w"])) for a, b in zip(runs[name][0]["layers"], params["layers"], strict=True)
    ]
    print(
        f"{name:14s} first three layers moved x{moved[0] / reference[0]:.2f}, x{moved[1] / reference[1]:.2f}, "
        f"x{moved[2] / reference[2]:.2f} of float32's"
    )

# %% [markdown]
# ## After: the boundaries' factors
#
# The optimizer state holds each boundary's exponent (`ls.metrics` reports them as
# `loss_scale/segment/<name>/exponent`, with each segment's last measured peak and flush
# fractions). Factors compound: the first segment's cotangents carry every boundary's factor.
# The same report, with those exponents in force, shows every segment's cotangents below
# 65504 and none flushed:

# %%
state = runs["per-segment"][1]
exponents = ls.find_state(state).segments.exponents()
after = ls.range_report(loss_fn, runs["per-segment"][0], batch(0), scale=float(ls.get_scale(state)), segments=exponents)
print(f"global scale 2**{int(np.log2(float(ls.get_scale(state))))}")
for row in after.segments:
    print(
        f"{row.name:8s} exponent {row.exponent:3d}   scale 2**{int(np.log2(row.scale)):3d}   "
        f"largest cotangent {row.backward_max:9.3g}   flushed to zero {row.backward_zero:6.1%}"
    )

names = [row.name for row in before.segments]
position = np.arange(len(names))
fig, ax = plt.subplots(figsize=(11, 3))
ax.bar(position - 0.2, [row.backward_zero for row in before.segments], 0.4, label="one scale")
ax.bar(position + 0.2, [row.backward_zero for row in after.segments], 0.4, label="a scale per segment")
ax.set(xticks=position, ylabel="cotangents flushed to zero", title="each segment, before and after")
ax.set_xticklabels(names, rotation=45)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Where to put the boundaries
#
# * Between parts of the model whose cotangents differ by many binades: between layers of a
#   deep network, between the chunks of a long recurrence (a boundary inside a `lax.scan`
#   body is crossed once per step, and compounds), between a large output head and a small
#   embedding.
# * On the main path, where every cotangent flowing back passes through it: a boundary inside
#   one branch of a residual block would split the cotangents that meet at the block's input
#   (a float16 value used on both sides of a boundary is an error that says so).
# * Parameters may be used on both sides: a float32 parameter's uses are brought back to one
#   scale exactly, and every gradient comes out at the global scale, so the optimizer and its
#   state are the ones you had.

# %% [markdown]
# # Training flax and Equinox models in float16 with loss_scale
#
# Three complete training loops with plots of the loss, the loss scale and the skipped
# steps; the flax ones run in float32 and in float16 with dynamic loss scaling (the NNX one
# also in float16 without scaling), the Equinox one in float16:
#
# 1. **flax linen**: a small CNN on scikit-learn's handwritten digits (bundled with
#    scikit-learn, nothing is downloaded), with `flax.training.train_state.TrainState`;
# 2. **flax NNX**: a small next-token model on Python's standard-library sources (a softmax
#    over 2,048 word pieces, where float16 gradients get small), with `nnx.Optimizer` and
#    `loss_scale.flax.nnx_value_and_grad`;
# 3. **Equinox**: an `eqx.nn.MLP` on the digits, with `loss_scale.equinox`, and what a
#    forced overflow does to it.
#
# The models and the data come from the scripts in `examples/` (`cnn_digits.py`,
# `nnx_lm.py`, `equinox_mlp.py`), which train them for longer from the command line.
#
# The precision comes from one string, `ls.Policy.from_string(...)`, and
# `policy.loss_scaling(optimizer)` picks the loss scaling it needs: `ls.dynamic` for float16,
# `ls.no_op` for bfloat16 and float32 (same state layout, so the loop does not change).
# Parameters stay in float32 (the "master weights"): an Adam update smaller than half the
# spacing of float16 numbers around a weight would round away.
#
# Runs on CPU in about a minute.

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
import _common  # examples/_common.py: the plot of the examples
import cnn_digits  # examples/cnn_digits.py: the CNN
import equinox as eqx
import equinox_mlp  # examples/equinox_mlp.py: the MLP and its training step
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import nnx_lm  # examples/nnx_lm.py: the next-token model and the stdlib word pieces
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import loss_scale as ls
import loss_scale.flax as lsf

for text in ("params=float32,compute=float32,output=float32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"):
    policy = ls.Policy.from_string(text)
    tx = policy.loss_scaling(optax.adam(1e-3))
    print(f"{str(policy):46} -> loss scale {float(ls.get_scale(tx.init(jnp.zeros(1)))):g}")

# %% [markdown]
# ## 1. flax linen: a CNN on the digits, with TrainState
#
# The layers compute in `policy.compute_dtype` and keep `param_dtype=float32`. The train step
# is the usual linen one, with two changes: gradients come from
# `ls.value_and_grad(loss_fn)(state.opt_state, ...)` (the gradients of `loss * scale`), and
# the optimizer is wrapped by `policy.loss_scaling`. `state.apply_gradients` then unscales,
# checks, and skips or applies: on a skipped step the params and the optimizer state stay as
# they were (only `state.step` still counts it).

# %%
x_train, x_test, y_train, y_test = _common.digits(seed=0)


def train_linen(policy_text, steps=200, batch_size=64, **dynamic_kwargs):
    policy = ls.Policy.from_string(policy_text)
    model = cnn_digits.CNN(dtype=policy.compute_dtype)
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
    history = {"losses": [], "scales": [], "skipped": []}
    for _ in range(steps):
        batch = rng.choice(len(x_train), batch_size, replace=False)
        history["scales"].append(float(ls.get_scale(state)))
        state, loss = train_step(state, x_train[batch], y_train[batch])
        history["losses"].append(float(loss))
        history["skipped"].append(bool(ls.find_state(state).skipped))
    history["final_scale"] = float(ls.get_scale(state))  # after the last step: where the plot's scale curve ends
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
        f"{name:22} test accuracy {100 * h['test accuracy']:.1f}%   final loss {np.mean(h['losses'][-30:]):.4f}   "
        f"skipped {sum(h['skipped'])}   final scale {h['final_scale']:g}"
    )
state = linen_runs["float16 + ls.dynamic"]["state"]
print("TrainState.step:", int(state.step), "| applied Adam steps:", int(ls.find_state(state).inner_state[0].count))
print({k: float(v) for k, v in ls.metrics(state).items() if "grad" not in k})

# %%
_common.plot_runs(linen_runs, title="linen CNN, digits", smooth=5, panels=("loss", "scale"))
plt.show()

# %% [markdown]
# The scale starts at $2^{15}$ and doubles every 40 clean steps until a gradient overflows
# float16; such a step is skipped (a red cross), the scale halves, and training goes on. The
# float16 loss follows the float32 one. On this small classification task float16 would
# train well even without a scale (the gradients of a 10-class cross-entropy over 64
# images stay inside float16's range); the next-token model below, with its softmax over
# 2,048 classes, is where the gradients get small.
#
# ## 2. flax NNX: a next-token model, with nnx.Optimizer
#
# `nnx.Optimizer(model, tx, wrt=nnx.Param)` takes the loss-scaled optimizer as it is.
# `loss_scale.flax.nnx_value_and_grad(loss_fn)(optimizer, model, batch)` returns the loss and
# the gradients of `loss * scale` with respect to the optimizer's `wrt` variables, and
# `optimizer.update(model, grads)` unscales, checks, and skips or applies.
# `lsf.get_scale(optimizer)` and `lsf.metrics(optimizer)` read the scaler's state as plain
# arrays (`nnx.Optimizer` wraps its state in `nnx.Variable`s).
#
# The model, `nnx_lm.NextToken`, embeds the previous three word pieces and predicts the next
# one through a hidden layer. To show the scale moving within 150 steps, it grows every 20
# clean steps instead of the default 2,000.

# %%
VOCAB, CONTEXT, BATCH = 2048, 3, 512
tokens, _ = nnx_lm.tokenize(nnx_lm.load_text(max_bytes=600_000), VOCAB)


def train_nnx(policy_text, steps=150, scaled=True, **dynamic_kwargs):
    policy = ls.Policy.from_string(policy_text)
    model = nnx_lm.NextToken(VOCAB, CONTEXT, dtype=policy.compute_dtype, rngs=nnx.Rngs(0))
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
    history = {"losses": [], "scales": [], "skipped": []}
    for _ in range(steps):
        context, targets = nnx_lm.next_token_batch(tokens, rng, BATCH, CONTEXT)
        history["scales"].append(float(lsf.get_scale(optimizer)))
        history["losses"].append(float(train_step(model, optimizer, context, targets)))
        history["skipped"].append(bool(lsf.find_state(optimizer).skipped))
    history["final_scale"] = float(lsf.get_scale(optimizer))  # after the last step, as the plot ends
    history["optimizer"] = optimizer
    return history


nnx_runs = {
    "float32": train_nnx("p=f32,c=f32,o=f32"),
    "float16, no scaling": train_nnx("p=f32,c=f16,o=f32", scaled=False),
    "float16 + ls.dynamic": train_nnx("p=f32,c=f16,o=f32", growth_interval=20),
}
for name, h in nnx_runs.items():
    print(
        f"{name:22} final loss {np.mean(h['losses'][-20:]):.3f}   skipped {sum(h['skipped'])}   "
        f"final scale {h['final_scale']:g}"
    )
optimizer = nnx_runs["float16 + ls.dynamic"]["optimizer"]
applied = int(lsf.find_state(optimizer).inner_state[0].count)
print("nnx.Optimizer.step:", int(optimizer.step[...]), "| applied AdamW steps:", applied)
print({k: float(v) for k, v in lsf.metrics(optimizer).items() if "grad" not in k})

# %%
_common.plot_runs(nnx_runs, title="NNX next-token model", smooth=4, panels=("loss", "scale"))
plt.show()

# %% [markdown]
# The scale grows from $2^{15}$ every 20 clean steps until the largest gradients overflow
# float16; each of those steps is skipped (params and AdamW moments untouched, so a skipped
# step costs only its time) and the scale halves. The float16 runs follow float32 here:
# over 150 steps, the underflow of float16 without scaling (see `01_why_loss_scaling.ipynb`
# for how much of the gradient it loses) does not yet show in the loss.
#
# ## 3. Equinox: an MLP, with loss_scale.equinox
#
# An Equinox model is a pytree whose fields are not all arrays, so gradients are taken
# with `eqx.filter_value_and_grad`; `loss_scale.equinox` has the loss-scaled pair. The
# optimizer state is made from the model's floating arrays, and one step is
#
# ```python
# loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x, y)  # grads of loss * scale
# model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)      # unscale, check, skip or apply
# ```
#
# `equinox_mlp.make_train_step(tx, policy)` is that step under `eqx.filter_jit`. The model
# keeps float32 arrays; its loss function casts it and the images to float16 with
# `policy.cast_to_compute`, which casts only floating arrays (the MLP's activation function
# and sizes pass through), so the forward and backward passes run in float16.

# %%
digits = equinox_mlp.load_data(seed=0)
x, y = digits["train"]
policy = ls.Policy.from_string("p=f32,c=f16,o=f32")
tx = policy.loss_scaling(optax.adam(3e-3), growth_interval=100)
model = equinox_mlp.make_model(jax.random.key(0))
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
train_step, evaluate = equinox_mlp.make_train_step(tx, policy), equinox_mlp.make_evaluate(policy)

rng = np.random.default_rng(0)
eqx_run = {"losses": [], "scales": [], "skipped": []}
for _ in range(300):
    batch = rng.choice(len(y), 64, replace=False)
    eqx_run["scales"].append(float(ls.get_scale(opt_state)))
    model, opt_state, loss = train_step(model, opt_state, x[batch], y[batch])
    eqx_run["losses"].append(float(loss))
    eqx_run["skipped"].append(bool(ls.find_state(opt_state).skipped))
eqx_run["final_scale"] = float(ls.get_scale(opt_state))  # after the last step: where the plot's scale curve ends
test_loss, test_accuracy = evaluate(model, *digits["test"])
print(
    f"test accuracy {100 * float(test_accuracy):.1f}%   final loss {np.mean(eqx_run['losses'][-30:]):.4f}   "
    f"skipped {sum(eqx_run['skipped'])}   final scale {eqx_run['final_scale']:g}"
)
print("model arrays:", {a.dtype.name for a in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))})
print(
    "computed in:",
    {a.dtype.name for a in jax.tree.leaves(policy.cast_to_compute(eqx.filter(model, eqx.is_inexact_array)))},
)
_common.plot_runs({"float16 + ls.dynamic": eqx_run}, title="Equinox MLP, digits", smooth=6)
plt.show()

# %% [markdown]
# **A forced overflow.** One `inf` pixel in a batch makes the float16 forward pass, and so
# every gradient, non-finite. `apply_gradients` sees it, skips the step and halves the
# scale: the model's arrays and Adam's moments and step count are returned bit for bit as
# they were (the update is applied inside the branch that the finite check chooses, so
# nothing non-finite reaches the model).


# %%
def identical(a, b):
    """Same tree structure, and every array the same bit for bit."""
    return jax.tree.all(jax.tree.map(lambda u, v: np.asarray(u).tobytes() == np.asarray(v).tobytes(), a, b))


bad_x = x[:64].at[0, 10].set(jnp.inf)
new_model, new_opt_state, loss = train_step(model, opt_state, bad_x, y[:64])

scales = f"{float(ls.get_scale(opt_state)):g} -> {float(ls.get_scale(new_opt_state)):g}"
print("loss on that batch:", float(loss), "| skipped:", bool(ls.find_state(new_opt_state).skipped), "| scale", scales)
params = eqx.filter(model, eqx.is_inexact_array)
print("model unchanged:", identical(eqx.filter(new_model, eqx.is_inexact_array), params))
print(
    "Adam state unchanged:", identical(ls.find_state(new_opt_state).inner_state, ls.find_state(opt_state).inner_state)
)
print("the activation function is kept:", new_model.activation is model.activation)

# %% [markdown]
# `examples/cnn_digits.py` and `examples/nnx_lm.py` (a transformer language model trained with
# NNX) run the same comparisons with bfloat16 as well, for longer, with timings;
# `examples/equinox_mlp.py` trains the Equinox MLP from the command line.

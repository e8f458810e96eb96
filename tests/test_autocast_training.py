"""A flax linen CNN with BatchNorm, written in float32 and fed raw pixel
values (0 to 255, activations in the thousands), trained on
scikit-learn's digits with ls.autocast + ls.dynamic: it learns as the
same model does in float32 and in flax's own float16 mode
(dtype=jnp.float16). Before autocast computed a statistic's squares in
float32, the variance of its BatchNorm layers overflowed float16 on the
channels with the largest activations (those channels output their bias),
and the run ended 18 points of test accuracy behind, with a finite loss
and no skipped step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import loss_scale as ls


class CNN(nn.Module):
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        for features in (16, 32):
            x = nn.Conv(features, (3, 3), dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
            x = nn.relu(x)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def digits():
    data = load_digits()
    x = (data.images * (255.0 / 16.0)).astype(np.float32)[..., None]  # raw pixels, 0 to 255
    y = data.target.astype(np.int32)
    return jnp.asarray(x[:1400]), jnp.asarray(y[:1400]), jnp.asarray(x[1400:]), jnp.asarray(y[1400:])


def train(model, loss_wrap, steps=100):
    x, y, x_test, y_test = digits()
    variables = model.init(jax.random.key(0), x[:2], train=False)
    params, stats = variables["params"], variables["batch_stats"]
    tx = ls.dynamic(optax.adam(1e-2))
    opt_state = tx.init(params)

    def loss_fn(params, stats, xb, yb):
        logits, new = model.apply({"params": params, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), yb).mean()
        return loss, new["batch_stats"]

    @jax.jit
    def step(params, stats, opt_state, xb, yb):
        (loss, stats), grads = ls.value_and_grad(loss_wrap(loss_fn), has_aux=True)(opt_state, params, stats, xb, yb)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return params, stats, opt_state, loss

    key = jax.random.key(1)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        batch = jax.random.choice(sub, x.shape[0], (256,), replace=False)
        params, stats, opt_state, loss = step(params, stats, opt_state, x[batch], y[batch])
    logits = model.apply({"params": params, "batch_stats": stats}, x_test, train=False)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    return accuracy, float(loss), int(ls.find_state(opt_state).skipped_steps), stats


def test_a_batchnorm_cnn_on_raw_pixels_trains_under_autocast_as_in_float32():
    float32 = train(CNN(), lambda f: f)
    flax_f16 = train(CNN(dtype=jnp.float16), lambda f: f)
    autocast = train(CNN(), ls.autocast)
    assert float32[0] > 0.85, float32  # the task is learnable in 100 steps
    # Within a few points of float32 and of flax's own float16 mode.
    assert autocast[0] >= min(float32[0], flax_f16[0]) - 0.05, (autocast, float32, flax_f16)
    assert np.isfinite(autocast[1])
    # The running statistics moved as in float32 (the first layer's mean).
    first = "BatchNorm_0"
    np.testing.assert_allclose(autocast[3][first]["mean"], float32[3][first]["mean"], rtol=0.1, atol=1.0)

"""Real training loops: optax and a flax linen TrainState in float16 compute."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import loss_scale as ls
from tests._compare import assert_trees_bitwise


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16)(x))
        return nn.Dense(10, dtype=jnp.float16)(x)


def make_data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    teacher = rng.normal(size=(16, 10)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=-1)
    return jnp.asarray(x), jnp.asarray(y)


def test_flax_train_state_float16_training_with_a_forced_overflow():
    x, y = make_data()
    model = MLP()
    params = model.init(jax.random.key(0), x[:1])["params"]  # float32 master params
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=ls.dynamic(optax.adam(1e-2), growth_interval=20)
    )

    traces = []  # one entry per trace of train_step: compiling it again needs a new trace

    @jax.jit
    def train_step(state, x, y, poison):
        traces.append(None)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x.astype(jnp.float16))
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
            return loss * poison

        loss, grads = ls.value_and_grad(loss_fn)(state.opt_state, state.params)
        return state.apply_gradients(grads=grads), loss

    losses, poisoned_step = [], 30
    for i in range(150):
        before = state
        batch = slice((i * 64) % 512, (i * 64) % 512 + 64)
        state, loss = train_step(state, x[batch], y[batch], jnp.float32(jnp.inf if i == poisoned_step else 1.0))
        if i == poisoned_step:
            scaler = ls.find_state(state.opt_state)
            assert bool(scaler.skipped)
            assert_trees_bitwise(state.params, before.params)
            assert float(ls.get_scale(state)) == float(ls.get_scale(before)) / 2
        losses.append(float(loss))
        if i == 1:
            # TrainState.create starts with a Python int step: one more trace.
            traced_after_start = len(traces)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    assert int(ls.find_state(state.opt_state).skipped_steps) >= 1
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(state.params))
    assert len(traces) == traced_after_start


def test_optax_loop_converges_like_float32():
    # The same model trained in float32 without scaling and with dynamic
    # scaling in float16 compute reach a similar loss.
    x, y = make_data()
    results = {}
    for name, dtype, tx in [
        ("f32", jnp.float32, ls.no_op(optax.adam(1e-2))),
        ("f16", jnp.float16, ls.dynamic(optax.adam(1e-2))),
    ]:
        model = MLP()
        params = model.init(jax.random.key(0), x[:1])["params"]
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, model=model, dtype=dtype, tx=tx):
            def loss_fn(p):
                p = jax.tree.map(lambda a: a.astype(dtype), p)
                logits = model.clone(parent=None).apply({"params": p}, x.astype(dtype))
                return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        for _ in range(100):
            params, opt_state, loss = step(params, opt_state)
        results[name] = float(loss)
    assert results["f16"] < 0.3 and abs(results["f16"] - results["f32"]) < 0.1, results

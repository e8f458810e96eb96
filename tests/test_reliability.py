"""Reliability: stuck-at-the-minimum policy and a fault-injection soak test.

The soak test trains a small real model (float16 compute, float32 master
params) for thousands of steps while injecting inf/nan into the gradients:
isolated, in bursts, in long runs, into one leaf or into every leaf. Set
LOSS_SCALE_SOAK_STEPS for a longer run.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls

SOAK_STEPS = int(os.environ.get("LOSS_SCALE_SOAK_STEPS", "3000"))


def test_max_consecutive_skips_raises_naming_the_leaves_and_applies_nothing():
    params = {"enc": {"w": jnp.ones(3)}, "head": jnp.ones(2)}
    tx = ls.dynamic(optax.adam(0.1), initial_scale=8.0, max_consecutive_skips=4)
    state = tx.init(params)
    update = jax.jit(tx.update)
    bad = {"enc": {"w": jnp.ones(3)}, "head": jnp.array([1.0, jnp.inf])}
    for _ in range(3):
        updates, state = update(bad, state, params)
        assert bool(state.skipped) and float(jnp.abs(updates["head"]).max()) == 0.0
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"4 consecutive steps skipped.*\['head'\]") as info:
        jax.block_until_ready(update(bad, state, params))
    assert "SkippedStepsError" in str(info.value)
    # A clean step in between resets the run.
    _, state = update(jax.tree.map(jnp.ones_like, params), state, params)
    assert int(state.consecutive_skips) == 0


def test_max_consecutive_skips_under_vmap_raises_only_for_the_stuck_model():
    # Under vmap the cond guarding the host callback becomes a select, so the
    # callback runs on every step, once per model: it must check the count.
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, max_consecutive_skips=3)
    params = jnp.zeros((4, 2))
    state = jax.vmap(tx.init)(params)
    update = jax.jit(jax.vmap(tx.update))
    clean = jnp.ones((4, 2))
    for _ in range(5):
        _, state = update(clean, state, params)
    assert int(state.skipped_steps.sum()) == 0
    stuck_one = clean.at[2, 0].set(jnp.nan)  # model 2 overflows on every step
    for _ in range(2):
        _, state = update(stuck_one, state, params)
    np.testing.assert_array_equal(state.consecutive_skips, [0, 0, 2, 0])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"3 consecutive steps skipped.*gradient array itself"):
        jax.block_until_ready(update(stuck_one, state, params))


def test_default_keeps_skipping_at_the_minimum_and_reports_it():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0, min_scale=1.0)
    state = tx.init(jnp.zeros(2))
    for _ in range(10):
        _, state = jax.jit(tx.update)(jnp.array([jnp.nan, 1.0]), state)
    m = ls.metrics(state, prefix="")
    assert float(m["scale"]) == 1.0 and int(m["consecutive_skips"]) == 10
    assert int(m["steps_at_min"]) == 8 and int(m["backoffs"]) == 2


def test_bad_max_consecutive_skips():
    with pytest.raises(ValueError, match="max_consecutive_skips must be >= 1, got 0"):
        ls.dynamic(optax.sgd(0.1), max_consecutive_skips=0)
    with pytest.raises(TypeError, match="max_consecutive_skips"):
        ls.static(optax.sgd(0.1), 2.0, max_consecutive_skips=2.5)


def fault_schedule(steps, n_leaves, seed=0):
    """Per step: which leaves get a non-finite value (bool[steps, n_leaves])
    and which value (inf, -inf or nan)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((steps, n_leaves), bool)
    i = 20
    while i < steps - 50:
        kind = rng.choice(["isolated", "burst", "long_run", "quiet"], p=[0.4, 0.25, 0.05, 0.3])
        length = {"isolated": 1, "burst": rng.integers(2, 6), "long_run": rng.integers(20, 40), "quiet": 0}[kind]
        which = rng.choice(["one", "all"])
        leaves = np.ones(n_leaves, bool) if which == "all" else np.eye(n_leaves, dtype=bool)[rng.integers(n_leaves)]
        mask[i : i + length] = leaves
        i += length + rng.integers(5, 60)
    values = rng.choice(np.float32([np.inf, -np.inf, np.nan]), size=steps)
    return mask, values


def test_fault_injection_soak():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    true_w = rng.normal(size=(16, 4)).astype(np.float32)
    y = jnp.asarray(np.tanh(x @ true_w), jnp.float32)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
        "b1": jnp.zeros((1, 32)),
        "w2": jnp.asarray(rng.normal(size=(32, 4)) * 0.3, jnp.float32),
        "b2": jnp.zeros((1, 4)),
    }
    min_scale, max_scale = 2.0**4, 2.0**20
    tx = ls.dynamic(
        optax.adam(3e-3), initial_scale=2.0**12, growth_interval=50, min_scale=min_scale, max_scale=max_scale
    )

    def loss_fn(p, xb, yb):
        h = jax.tree.map(lambda a: a.astype(jnp.float16), p)
        hidden = jnp.tanh(xb.astype(jnp.float16) @ h["w1"] + h["b1"])
        out = (hidden @ h["w2"] + h["b2"]).astype(jnp.float32)
        return jnp.mean((out - yb) ** 2)

    n_leaves = len(jax.tree.leaves(params))
    mask, values = fault_schedule(SOAK_STEPS, n_leaves)

    def step(carry, inputs):
        params, state = carry
        i, leaf_mask, value = inputs
        idx = (i * 32) % 256
        xb, yb = jax.lax.dynamic_slice_in_dim(x, idx, 32), jax.lax.dynamic_slice_in_dim(y, idx, 32)
        loss, grads = ls.value_and_grad(loss_fn)(state, params, xb, yb)
        leaves, treedef = jax.tree.flatten(grads)
        leaves = [jnp.where(leaf_mask[k], g.at[(0,) * g.ndim].set(value), g) for k, g in enumerate(leaves)]
        grads = jax.tree.unflatten(treedef, leaves)
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        inner_same = jnp.all(
            jnp.stack(
                [
                    jnp.all(a == b)
                    for a, b in zip(
                        jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state), strict=True
                    )
                ]
            )
        )
        params_same = jnp.all(
            jnp.stack(
                [jnp.all(a == b) for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True)]
            )
        )
        record = {
            "loss": loss,
            "skipped": new_state.skipped,
            "injected": jnp.any(leaf_mask),
            "params_finite": ls.all_finite(new_params),
            "state_finite": ls.all_finite(new_state.inner_state),
            "inner_same": inner_same,
            "params_same": params_same,
            "scale": new_state.scale,
        }
        return (new_params, new_state), record

    run = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), (jnp.arange(SOAK_STEPS), mask, values)))
    (final_params, final_state), rec = run(params, tx.init(params))
    rec = jax.device_get(rec)

    assert rec["params_finite"].all() and rec["state_finite"].all()
    np.testing.assert_array_equal(rec["skipped"], rec["injected"])  # no scale here overflows on its own
    assert rec["inner_same"][rec["skipped"]].all() and rec["params_same"][rec["skipped"]].all()
    assert not rec["inner_same"][~rec["skipped"]].any()
    assert ((rec["scale"] >= min_scale) & (rec["scale"] <= max_scale)).all()
    assert rec["skipped"].sum() > SOAK_STEPS // 20 and rec["scale"].min() == min_scale  # long runs reach the floor
    assert int(final_state.skipped_steps) == rec["skipped"].sum()
    assert int(final_state.growths) > 0
    clean = ~rec["skipped"]
    first, last = rec["loss"][clean][:50].mean(), rec["loss"][clean][-50:].mean()
    assert last < 0.1 * first, (first, last)

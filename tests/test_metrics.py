"""Diagnostics in the state: counters, maxima, norms, overflow paths, clipping."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls


def run(tx, params, grad_list):
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for grads in grad_list:
        updates, state = update(grads, state, params)
        history.append((updates, state))
    return history


def test_counters_follow_growths_backoffs_and_the_floor():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0, growth_interval=2, min_scale=1.0, max_scale=8.0)
    clean, bad = jnp.ones(2), jnp.array([1.0, jnp.inf])
    # scales used: 4 4 | 8 8 -> cap | overflow 4 | 2 | 1 | 1 (floor) | 1 1 -> 2
    seq = [clean, clean, clean, clean, bad, bad, bad, bad, clean, clean]
    states = [s for _, s in run(tx, jnp.zeros(2), seq)]
    scales = [float(s.scale) for s in states]
    assert scales == [4, 8, 8, 8, 4, 2, 1, 1, 1, 2]
    last = ls.metrics(states[-1])
    assert int(last["loss_scale/growths"]) == 2  # 4->8 and 1->2; the capped growth at 8 is not one
    assert int(last["loss_scale/backoffs"]) == 3  # 8->4->2->1; the overflow at the floor is not one
    assert int(last["loss_scale/steps_at_min"]) == 3  # steps taken at scale 1
    assert int(last["loss_scale/skipped_steps"]) == 4 and int(last["loss_scale/consecutive_skips"]) == 0
    assert int(ls.metrics(states[7])["loss_scale/consecutive_skips"]) == 4


def test_metrics_dict_is_flat_scalars_and_works_under_jit():
    tx = ls.dynamic(optax.adam(1e-3), track_grad_norm=True)
    state = tx.init({"w": jnp.zeros(3)})
    m = jax.jit(ls.metrics)(state)
    assert set(m) == {
        "loss_scale/" + k
        for k in [
            "scale",
            "skipped",
            "skipped_steps",
            "consecutive_skips",
            "good_steps",
            "growths",
            "backoffs",
            "steps_at_min",
            "skip_reason",
            "nonfinite_losses",
            "grad_max",
            "grad_norm",
            # the dynamic rule's own counters
            "overflows_left",
            "first_growth_pending",
        ]
    }
    assert all(v.shape == () for v in m.values())
    assert set(ls.metrics(state, prefix="")) == {k.removeprefix("loss_scale/") for k in m}


def test_grad_max_and_norm_are_of_the_unscaled_gradients():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2), jnp.float16)}
    grads = {"a": jnp.array([3.0, -4.0, 0.0]) * 64, "b": (jnp.array([[0.5, 0], [0, -12.0]]) * 64).astype(jnp.float16)}
    [(_, state)] = run(ls.static(optax.sgd(1.0), 64.0, track_grad_norm=True), params, [grads])
    assert float(state.grad_max) == 12.0
    np.testing.assert_allclose(float(state.grad_norm), math.sqrt(9 + 16 + 0.25 + 144), rtol=1e-6)
    [(_, state)] = run(ls.static(optax.sgd(1.0), 64.0), params, [grads])
    assert float(state.grad_max) == 12.0 and state.grad_norm is None
    assert "loss_scale/grad_norm" not in ls.metrics(state)


def test_overflow_paths_name_the_bad_leaves_and_survive_clean_steps():
    params = {"enc": {"w": jnp.zeros(4), "b": jnp.zeros(2)}, "head": [jnp.zeros(3), jnp.zeros(1)]}
    tx = ls.dynamic(optax.adam(1e-3), locate_overflows=True)
    good = jax.tree.map(jnp.ones_like, params)
    bad = {"enc": {"w": jnp.ones(4), "b": jnp.array([1.0, jnp.nan])}, "head": [jnp.full(3, jnp.inf), jnp.ones(1)]}
    states = [s for _, s in run(tx, params, [good, bad, good])]
    assert ls.overflow_paths(states[0], params) == []
    assert ls.overflow_paths(states[1], params) == ["['enc']['b']", "['head'][0]"]
    assert ls.overflow_paths(states[2], params) == ["['enc']['b']", "['head'][0]"]  # kept after a clean step
    with pytest.raises(ValueError, match="locate_overflows=True"):
        ls.overflow_paths(ls.dynamic(optax.adam(1e-3)).init(params), params)
    with pytest.raises(ValueError, match="grads_like has 1 leaves"):
        ls.overflow_paths(states[1], jnp.zeros(1))


def test_locate_overflows_checks_the_gradient_structure():
    tx = ls.dynamic(optax.sgd(1.0), locate_overflows=True)
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="the gradients have 2 leaves but init saw 1"):
        tx.update({"w": jnp.zeros(2), "v": jnp.zeros(1)}, state)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
@pytest.mark.parametrize(
    "make_inner, rtol", [(lambda: optax.sgd(0.1, momentum=0.9), 1e-5), (lambda: optax.adam(1e-2), 2e-5)]
)
def test_fused_clipping_equals_clip_by_global_norm_inside(max_norm, make_inner, rtol):
    # The norm is summed in another order and the clip multiplies by
    # max_norm / norm instead of dividing: float32 rounding apart (which
    # Adam's division by sqrt(nu) amplifies for tiny moments).
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}
    scale = 2.0**10
    fused = ls.dynamic(make_inner(), initial_scale=scale, max_grad_norm=max_norm)
    chained = ls.dynamic(optax.chain(optax.clip_by_global_norm(max_norm), make_inner()), initial_scale=scale)
    s1, s2 = fused.init(params), chained.init(params)
    for _ in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32) * scale, params)
        u1, s1 = jax.jit(fused.update)(grads, s1, params)
        u2, s2 = jax.jit(chained.update)(grads, s2, params)
        chex.assert_trees_all_close(u1, u2, rtol=rtol, atol=1e-7)
        chex.assert_trees_all_close(s1.inner_state, s2.inner_state[1], rtol=rtol, atol=1e-7)
    assert not math.isnan(float(s1.grad_norm))


def test_fused_clipping_never_sees_a_nan_norm():
    tx = ls.dynamic(optax.sgd(1.0), initial_scale=2.0, max_grad_norm=1.0)
    params = jnp.zeros(3)
    (u1, s1), (u2, s2) = run(tx, params, [jnp.array([jnp.nan, 1.0, 1.0]), jnp.array([6.0, 0.0, 8.0])])
    np.testing.assert_array_equal(u1, [0.0, 0.0, 0.0])
    assert bool(s1.skipped) and float(s1.grad_norm) == math.inf  # the norm of the overflowing step
    # Second step at scale 1: norm 10, clipped to 1.
    np.testing.assert_allclose(u2, [-0.6, 0.0, -0.8], rtol=1e-6)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_bad_max_grad_norm(value):
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        ls.dynamic(optax.sgd(1.0), max_grad_norm=value)


def test_option_types():
    with pytest.raises(TypeError, match="track_grad_norm"):
        ls.static(optax.sgd(1.0), 2.0, track_grad_norm=1)
    with pytest.raises(TypeError, match="max_grad_norm"):
        ls.dynamic(optax.sgd(1.0), max_grad_norm="big")


def test_underflow_fractions_of_the_scaled_gradients():
    params = {"a": jnp.zeros(4), "b": jnp.zeros(4, jnp.float16), "n": jnp.zeros(2, jnp.int32)}
    grads = {
        "a": jnp.array([0.0, 1e-6, 1e-3, 5.0]),  # 0, below 6.1e-5, normal, normal
        "b": jnp.array([0.0, 0.0, 3e-5, 1.0], jnp.float16),
        "n": jnp.zeros(2, jnp.int32),  # not a gradient: not counted
    }
    tx = ls.static(optax.identity(), 1.0, track_underflow=True)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(state.zero_fraction) == 3 / 8
    assert float(state.below_normal_fraction) == 5 / 8
    m = ls.metrics(state, prefix="")
    assert float(m["zero_fraction"]) == 3 / 8 and "below_normal_fraction" in m
    assert ls.dynamic(optax.sgd(1.0)).init(params).zero_fraction is None

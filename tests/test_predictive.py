"""ls.predictive: the rule step by step, against a simulated float16 model, and
in real float16 training."""

import math
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._rules.dynamic import DynamicRule
from loss_scale._rules.predictive import PredictiveRule
from tests._compare import assert_trees_bitwise
from tests._simulation import F16_MAX, drifting_gradients, simulate


def run_rule(rule, grad_maxes, finite=None):
    """Feeds ``rule`` one step per entry: the unscaled max |g| of the step and
    whether it was finite; returns the counters after every step as numpy."""
    grad_maxes = jnp.asarray(grad_maxes, jnp.float32)
    finite = jnp.isfinite(grad_maxes) if finite is None else jnp.asarray(finite, bool)

    def step(c, inputs):
        ok, g = inputs
        c = rule.adjust(c, ok, g)
        return c, c

    _, out = jax.lax.scan(step, rule.init(), (finite, grad_maxes))
    # scale, good_steps and the rule's counters, each an array over the steps
    return SimpleNamespace(scale=out.scale, good_steps=out.good_steps, **out.counters._asdict())


# --- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initial_headroom": 0, "min_headroom": 1}, "initial_headroom .* must be >= min_headroom"),
        ({"min_headroom": 65}, "min_headroom must be <= 64"),
        ({"min_headroom": 1.5}, "min_headroom must be an int"),
        ({"headroom_interval": 0}, "headroom_interval must be >= 1"),
        ({"peak_half_life": 0.5}, "peak_half_life must be finite and >= 1"),
        ({"peak_half_life": math.inf}, "peak_half_life must be finite"),
        ({"initial_scale": 0.5}, "initial_scale must lie in"),
        ({"min_scale": 0.0}, "min_scale must be finite and > 0"),
        ({"compute_dtype": "int8"}, "compute_dtype must be a floating dtype"),
        ({"compute_dtype": "no-such-dtype"}, "compute_dtype must be a dtype or a dtype name"),
    ],
)
def test_bad_settings_are_named_at_construction(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ls.predictive(optax.sgd(0.1), **kwargs)


def test_compute_dtype_sets_the_threshold():
    assert PredictiveRule().overflow_threshold == F16_MAX
    tx = ls.predictive(optax.sgd(0.1), compute_dtype=jnp.bfloat16, max_scale=math.inf, initial_headroom=1)
    state = tx.init(jnp.zeros(2))
    _, state = tx.update(jnp.array([2.0**15, 0.0]), state)
    # bfloat16's range is float32's: the target is 2**127 / 2 = 2**126.
    assert float(state.scale) == 2.0**126


# --- the rule, step by step ---------------------------------------------------


def test_first_measurement_jumps_then_the_search_climbs_a_binade_a_step():
    rule = PredictiveRule(initial_scale=1.0, initial_headroom=6, min_headroom=2, max_scale=math.inf)
    out = run_rule(rule, [0.5] * 8)
    # 65504 / 0.5 = 131008, floor(log2) = 16: target 2**(16 - H).
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([10, 11, 12, 13, 14, 14, 14, 14]))
    np.testing.assert_array_equal(out.headroom, [6, 5, 4, 3, 2, 2, 2, 2])
    np.testing.assert_array_equal(out.searching, True)  # still searching: no overflow yet
    np.testing.assert_array_equal(out.grad_peak, np.float32(0.5))


def test_an_overflow_while_searching_pins_the_headroom_within_a_binade():
    rule = PredictiveRule(initial_scale=1.0, initial_headroom=6, min_headroom=1)
    # Clean at 2**10, 2**11, 2**12; overflow at 2**13.
    out = run_rule(rule, [0.5, 0.5, 0.5, jnp.inf, 0.5, 0.5])
    # The scale had floor(log2(65504 / (0.5 * 2**12))) = 4 binades when it
    # overflowed: the overflow is within one binade above 2**12, so the
    # headroom becomes 4 + 2 (below the edge, and one binade of margin) and
    # stays; the search is over.
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([10, 11, 12, 10, 10, 10]))
    np.testing.assert_array_equal(out.headroom[3:], 6)
    np.testing.assert_array_equal(out.searching, [True, True, True, False, False, False])
    np.testing.assert_array_equal(out.good_steps, [1, 0, 0, 0, 1, 2])
    np.testing.assert_array_equal(out.overflow_run, [0, 0, 0, 1, 0, 0])


def test_the_first_measurement_keeps_a_verified_scale():
    # At 2**15 the largest scaled gradient, 2**7, had 8 binades of headroom.
    out = run_rule(PredictiveRule(), [2.0**-8] * 4)
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([15, 16, 17, 18]))
    np.testing.assert_array_equal(out.headroom, [8, 7, 6, 5])
    # With less headroom than min_headroom, it moves down to keep it.
    out = run_rule(PredictiveRule(min_headroom=3), [1.0])
    assert out.scale[0] == 2.0 ** (15 - 3) and out.headroom[0] == 3


def test_overflows_in_a_row_back_off_faster_and_leave_the_headroom():
    rule = PredictiveRule(initial_scale=2.0**10, min_scale=2.0**-30)
    out = run_rule(rule, [1.0] + [jnp.inf] * 5)
    # 65504 / 2**10 has 5 binades: the first overflow (during the search)
    # learns 5 + 2, the rest back off by 4, 16, 256, 2**16.
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([10, 8, 6, 2, -6, -22]))
    np.testing.assert_array_equal(out.headroom, [5, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(out.good_steps, [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out.overflow_run, [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(out.searching, [True, False, False, False, False, False])


def test_an_overflow_before_any_measurement_drops_to_min_scale_then_jumps_back():
    rule = PredictiveRule(initial_scale=2.0**15, min_scale=2.0)
    out = run_rule(rule, [jnp.inf, jnp.inf, 1.0, 1.0])
    # Nothing known: to min_scale; then 65504 / 1 has 15 binades, capped at initial_headroom = 12.
    np.testing.assert_array_equal(out.scale, [2.0, 2.0, 2.0**3, 2.0**4])
    np.testing.assert_array_equal(out.headroom, [12, 12, 12, 11])
    np.testing.assert_array_equal(out.searching, True)  # the search goes on


def test_the_scale_follows_rising_gradients_down_before_they_overflow():
    rule = PredictiveRule(initial_headroom=3, min_headroom=3, peak_half_life=100.0)
    grads = 1e-3 * 1.3 ** np.arange(30)
    out = run_rule(rule, grads)
    assert out.scale[0] == 2.0 ** (math.floor(math.log2(F16_MAX / grads[0])) - 3)
    # Each step's scaled peak stays 3 to 4 binades below float16's maximum.
    scaled = out.scale * grads
    assert np.all(scaled <= F16_MAX / 8) and np.all(scaled > F16_MAX / 16)
    assert np.all(np.diff(out.scale) <= 0)


def test_the_peak_decays_with_its_half_life_and_the_scale_grows_back():
    rule = PredictiveRule(initial_headroom=2, min_headroom=2, peak_half_life=10.0)
    out = run_rule(rule, [1.0] + [1e-3] * 40)
    np.testing.assert_allclose(out.grad_peak[10], 0.5, rtol=1e-5)
    np.testing.assert_allclose(out.grad_peak[20], 0.25, rtol=1e-5)
    assert out.scale[0] == 2.0**13
    # The scale doubles as the peak halves: at most one binade a step, never down.
    assert np.all(np.diff(out.scale) >= 0) and out.scale[-1] == 2.0**17


def test_headroom_relaxes_every_interval_after_the_search():
    rule = PredictiveRule(
        initial_scale=1.0, initial_headroom=4, min_headroom=0, headroom_interval=5, max_scale=math.inf
    )
    # Overflow right after the first step ends the search at once.
    out = run_rule(rule, [1.0, jnp.inf] + [1.0] * 12)
    assert not out.searching[1] and out.headroom[1] == 6
    np.testing.assert_array_equal(out.headroom[2:], [6, 6, 6, 6, 5, 5, 5, 5, 5, 4, 4, 4])
    np.testing.assert_array_equal(out.good_steps[2:], [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2])


def test_zero_gradients_keep_the_scale():
    out = run_rule(PredictiveRule(initial_scale=8.0), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.scale, 8.0)


def test_tiny_peak_is_capped_by_max_scale_and_never_reaches_inf():
    for max_scale in (2.0**24, math.inf):
        out = run_rule(PredictiveRule(max_scale=max_scale), [1e-30] * 300)
        assert np.all(np.isfinite(out.scale))
        assert np.all(out.scale <= min(max_scale, 2.0**127))


def test_scales_are_powers_of_two():
    rng = np.random.default_rng(0)
    grads = np.exp(rng.normal(size=500) * 3)
    scales, _ = simulate(PredictiveRule(min_scale=2.0**-20), grads, amplification=30.0)
    mantissa, _ = np.frexp(scales)
    np.testing.assert_array_equal(mantissa, 0.5)


def torch_rule():
    """torch.amp.GradScaler's rule and defaults (no floor, no ceiling)."""
    return DynamicRule(initial_scale=2.0**16, min_scale=2.0**-30, max_scale=math.inf)


@pytest.mark.parametrize("amplification", [40.0, 3000.0])
def test_smooth_drift_costs_the_torch_rule_four_times_more_skips(amplification):
    """Over 40000 steps of slowly drifting gradients the torch rule skips on
    every rise and every 2000 steps when it probes; the predictive rule skips
    when its search finds the amplification (and when 2**15 is too high to
    start with) and on its one probe, and keeps a scale as high."""
    grads = drifting_gradients(40000, noise=0.05)
    torch_scales, torch_skips = simulate(torch_rule(), grads, amplification)
    scales, skips = simulate(PredictiveRule(), grads, amplification)
    assert 1 <= skips.sum() <= 3, np.nonzero(skips)
    assert torch_skips.sum() >= 4 * skips.sum(), (torch_skips.sum(), skips.sum())
    # How far below float16's maximum the largest value of each step was.
    headroom = F16_MAX / (scales * grads * amplification)
    torch_headroom = F16_MAX / (torch_scales * grads * amplification)
    assert np.median(headroom[100:]) <= 2 * np.median(torch_headroom[100:])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("amplification", [40.0, 3000.0])
def test_noisy_gradients_cost_the_torch_rule_twice_the_skips(amplification, seed):
    grads = drifting_gradients(20000, noise=0.25, seed=seed)
    torch_scales, torch_skips = simulate(torch_rule(), grads, amplification)
    scales, skips = simulate(PredictiveRule(), grads, amplification)
    assert torch_skips.sum() >= 2 * skips.sum(), (torch_skips.sum(), skips.sum())
    headroom = F16_MAX / (scales * grads * amplification)
    torch_headroom = F16_MAX / (torch_scales * grads * amplification)
    assert np.median(headroom[100:]) <= 2 * np.median(torch_headroom[100:])


# --- in the transformation ----------------------------------------------------


def test_state_metrics_and_checkpoint_fields():
    tx = ls.predictive(optax.adam(1e-3))
    state = tx.init({"w": jnp.zeros(3)})
    assert state.headroom.dtype == jnp.int32 and state.grad_peak.dtype == jnp.float32
    metrics = jax.jit(ls.metrics)(state)
    assert int(metrics["loss_scale/headroom"]) == 12 and float(metrics["loss_scale/grad_peak"]) == 0.0
    assert float(metrics["loss_scale/scale"]) == 2.0**15
    assert "loss_scale/headroom" not in ls.metrics(ls.dynamic(optax.adam(1e-3)).init({"w": jnp.zeros(3)}))


def test_skip_leaves_the_inner_state_and_learns(jit):
    params = {"w": jnp.ones(3)}
    tx = ls.predictive(optax.adam(0.1), initial_scale=1.0, initial_headroom=2)
    state = tx.init(params)
    update = jit(tx.update)
    _, state = update({"w": jnp.array([0.25, -0.5, 1.0])}, state, params)
    # Jumped from 1 to 2**(floor(log2(65504 / 1)) - 2).
    assert float(state.scale) == 2.0**13
    inner_before = state.inner_state
    updates, state = update({"w": jnp.array([jnp.inf, 1.0, 1.0])}, state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(3)})
    chex.assert_trees_all_equal(state.inner_state, inner_before)
    # 2 binades of headroom when it overflowed during the search: 2 + 2.
    assert bool(state.skipped) and int(state.headroom) == 4 and float(state.scale) == 2.0**11


def test_float16_training_learns_an_amplified_intermediate():
    """A float16 MLP whose output passes through ``(z / k) * k`` with k = 2**12
    a runtime value (so XLA cannot fold it away): in the backward pass the
    gradient is k times larger between the two multiplications than at the
    parameters, and overflows float16 at a scale where the parameter
    gradients are far from it. The search finds that amplification: a skipped
    step or two, a headroom of several binades, and training proceeds."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    y = jnp.asarray(x @ rng.normal(size=(16, 1)), jnp.float32)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32), "w2": jnp.zeros((32, 1))}

    def loss_fn(p, k):
        h = jnp.tanh(x.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
        z = h @ p["w2"].astype(jnp.float16)
        pred = ((z / k) * k).astype(jnp.float32)
        return jnp.mean((pred - y) ** 2)

    tx = ls.predictive(optax.adam(1e-2))
    state = tx.init(params)

    @jax.jit
    def step(params, state, k):
        loss, grads = ls.value_and_grad(loss_fn)(state, params, k)
        params, state = ls.apply_gradients(tx, grads, state, params)
        return params, state, loss

    k = jnp.float16(2.0**12)
    losses, skipped, scales = [], [], []
    for _ in range(300):
        params, state, loss = step(params, state, k)
        losses.append(float(loss))
        skipped.append(bool(state.skipped))
        scales.append(float(state.scale))
    assert 1 <= sum(skipped) <= 2, np.nonzero(skipped)
    assert int(state.headroom) >= 6  # min_headroom is 1
    assert not bool(state.searching)  # the search ended on an overflow
    assert losses[-1] < losses[0] / 10
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))
    # Without the amplification the same model keeps the scale higher.
    tx_plain = ls.predictive(optax.adam(1e-2))
    state = tx_plain.init(params)
    for _ in range(30):
        loss, grads = ls.value_and_grad(loss_fn)(state, params, jnp.float16(1.0))
        _, state = tx_plain.update(grads, state, params)
    assert int(state.headroom) < 6


def test_vmap_gives_each_model_its_own_scale_and_donation_works():
    params = {"w": jnp.ones((4,)), "b": jnp.zeros((2,))}
    tx = ls.predictive(optax.adam(1e-2))

    def step(params, state, magnitude):
        grads = jax.tree.map(lambda x: jnp.full_like(x, magnitude) * state.scale, params)
        return ls.apply_gradients(tx, grads, state, params)

    states = jax.vmap(lambda _: tx.init(params))(jnp.arange(3))
    stacked = jax.tree.map(lambda x: jnp.stack([x] * 3), params)
    batched = jax.jit(jax.vmap(step), donate_argnums=(0, 1))
    for _ in range(3):
        stacked, states = batched(stacked, states, jnp.array([1e-3, 1.0, jnp.inf]))
    # 1e-3 at 2**15 had 10 binades: 2**15, then the search climbs; 1.0 had 0:
    # down to min_headroom's 2**14; inf before any measurement: min_scale.
    np.testing.assert_array_equal(states.scale, [2.0**17, 2.0**14, 1.0])
    np.testing.assert_array_equal(states.headroom, [8, 1, 12])
    np.testing.assert_array_equal(states.skipped_steps, [0, 0, 3])
    np.testing.assert_array_equal(stacked["w"][2], np.ones(4))


def test_orbax_round_trip_resumes_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.linspace(-1.0, 1.0, 8)}
    tx = ls.predictive(optax.adam(1e-2), initial_scale=2.0**20)

    @jax.jit
    def step(params, state, i):
        # Gradients that overflow every 7th step and otherwise drift.
        grads = jax.tree.map(lambda p: p * (1.0 + 0.1 * i) * state.scale, params)
        grads = jax.tree.map(lambda g: jnp.where(i % 7 == 3, jnp.inf, g), grads)
        return ls.apply_gradients(tx, grads, state, params)

    def run(params, state, steps):
        for i in steps:
            params, state = step(params, state, jnp.float32(i))
        return params, state

    straight = run(params, tx.init(params), range(20))
    halfway = run(params, tx.init(params), range(10))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", halfway)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", halfway)
    resumed = run(*restored, range(10, 20))
    assert int(straight[1].skipped_steps) == 3 and not bool(straight[1].searching)
    assert_trees_bitwise(resumed, straight)

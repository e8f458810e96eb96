"""The scale rules: validation, every branch, and equality with the peers."""

import functools
import json
import math
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._rules.dynamic import DynamicRule
from loss_scale._rules.static import fixed
from loss_scale._validate import FLOAT32_TINY
from tests import oracles

FIXTURE = pathlib.Path(__file__).parent / "data" / "torch_gradscaler.json"


def trajectory(rule, overflows, init_scale=None):
    """(scale, good_steps, overflows_left) after each step of ``rule``."""
    return [np.asarray(x) for x in traced_trajectory(rule, overflows, init_scale)]


def traced_trajectory(rule, overflows, init_scale=None):
    start = rule.init()
    if init_scale is not None:
        start = start._replace(scale=jnp.float32(init_scale))

    def step(state, overflow):
        state = rule.adjust(state, jnp.logical_not(overflow), jnp.float32(0))
        allowance = getattr(state.counters, "overflows_left", jnp.int32(0))
        return state, (state.scale, state.good_steps, allowance)

    _, out = jax.lax.scan(step, start, jnp.asarray(overflows, bool))
    return out


# --- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"growth_factor": 1.0}, r"growth_factor must be > 1, got 1\.0"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": math.inf}, "growth_factor"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\), got 1\.0"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval must be >= 1, got 0"),
        ({"hysteresis": 0}, "hysteresis must be >= 1, got 0"),
        ({"initial_scale": math.inf}, "initial_scale must be finite and > 0, got inf"),
        ({"initial_scale": math.nan}, "initial_scale"),
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": -1.0}, "initial_scale"),
        ({"min_scale": 0.0}, r"min_scale must be finite and > 0, got 0\.0"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"min_scale": math.nan}, "min_scale"),
        ({"min_scale": 1e-45, "initial_scale": 1.0}, "smallest normal"),
        ({"max_scale": math.nan}, "max_scale"),
        ({"initial_scale": 1e39, "max_scale": math.inf}, "at most float32's largest value"),
        ({"max_scale": 0.0}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0}, r"min_scale \(4\.0\) must be <= max_scale \(2\.0\)"),
        ({"initial_scale": 2.0**30}, r"initial_scale must lie in \[min_scale, max_scale\]"),
        ({"initial_scale": 0.5}, r"initial_scale must lie in \[min_scale, max_scale\] = \[1\.0"),
    ],
)
def test_dynamic_rejects_bad_settings_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ls.dynamic(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"growth_interval": 2.5}, {"hysteresis": "2"}, {"growth_interval": True}, {"consecutive_hysteresis": 1}],
)
def test_dynamic_rejects_wrong_types(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        ls.dynamic(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_static_rejects_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        ls.static(optax.sgd(0.1), scale)


def test_settings_below_one_and_infinite_max_are_allowed():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=0.25, min_scale=2.0**-20, max_scale=math.inf)
    assert float(ls.get_scale(tx.init(jnp.zeros(1)))) == 0.25


def test_state_dtypes():
    state = ls.dynamic(optax.sgd(0.1)).init({"w": jnp.zeros(2, jnp.float16)})
    assert state.scale.dtype == jnp.float32 and state.scale.shape == ()
    for counter in (state.good_steps, state.counters.overflows_left, state.skipped_steps, state.consecutive_skips):
        assert counter.dtype == jnp.int32 and counter.shape == ()
    assert state.skipped.dtype == jnp.bool_


# --- dynamic rule, branch by branch -------------------------------------------


def test_growth_lands_on_the_growth_interval_th_clean_step():
    rule = DynamicRule(initial_scale=8.0, growth_interval=3)
    scales, good, _ = trajectory(rule, [False] * 7)
    np.testing.assert_array_equal(scales, [8, 8, 16, 16, 16, 32, 32])
    np.testing.assert_array_equal(good, [1, 2, 0, 1, 2, 0, 1])


def test_backoff_resets_good_steps_and_is_floored():
    rule = DynamicRule(initial_scale=8.0, growth_interval=3, min_scale=2.0)
    scales, good, _ = trajectory(rule, [False, False, True, False, True, True, True])
    np.testing.assert_array_equal(scales, [8, 8, 4, 4, 2, 2, 2])
    np.testing.assert_array_equal(good, [1, 2, 0, 1, 0, 0, 0])


def test_growth_is_capped_at_max_scale():
    rule = DynamicRule(initial_scale=6.0, growth_interval=1, max_scale=20.0)
    scales, good, _ = trajectory(rule, [False] * 3)
    np.testing.assert_array_equal(scales, [12, 20, 20])
    np.testing.assert_array_equal(good, [0, 0, 0])


def test_growth_never_reaches_inf():
    big = float(np.finfo(np.float32).max) / 2
    rule = DynamicRule(initial_scale=big, growth_factor=4.0, growth_interval=2, max_scale=math.inf)
    scales, good, _ = trajectory(rule, [False] * 4)
    np.testing.assert_array_equal(scales, np.float32([big] * 4))
    np.testing.assert_array_equal(good, [1, 0, 1, 0])  # the counter still resets, as torch does


def test_hysteresis_backs_off_on_the_hth_overflow_then_on_every_one_until_growth():
    rule = DynamicRule(initial_scale=64.0, growth_interval=2, hysteresis=3)
    overflows = [True, True, True, True, False, True, False, False, True]
    scales, good, budget = trajectory(rule, overflows)
    np.testing.assert_array_equal(scales, [64, 64, 32, 16, 16, 8, 8, 16, 16])
    np.testing.assert_array_equal(budget, [2, 1, 0, 0, 0, 0, 0, 3, 2])
    np.testing.assert_array_equal(good, [0, 0, 0, 0, 1, 0, 1, 0, 0])


def test_consecutive_hysteresis_refills_on_every_clean_step():
    rule = DynamicRule(initial_scale=64.0, growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    overflows = [True, False, True, False, True, True, True]
    scales, _, budget = trajectory(rule, overflows)
    np.testing.assert_array_equal(scales, [64, 64, 64, 64, 64, 32, 16])
    np.testing.assert_array_equal(budget, [1, 2, 1, 2, 1, 0, 0])


def test_growth_delay_postpones_the_first_growth_after_start_and_overflow():
    rule = DynamicRule(initial_scale=8.0, growth_interval=2, growth_delay=1)
    overflows = [False, False, False, False, False, True, False, False, False]
    scales, good, _ = trajectory(rule, overflows)
    np.testing.assert_array_equal(scales, [8, 8, 16, 16, 32, 16, 16, 16, 32])
    # good_steps counts the clean steps since the last growth or overflow.
    np.testing.assert_array_equal(good, [1, 2, 0, 1, 0, 0, 1, 2, 0])


def test_static_rule_keeps_its_scale_and_counts_clean_steps():
    scales, good, _ = trajectory(fixed(3.0), [False, False, True, False])
    np.testing.assert_array_equal(scales, [3, 3, 3, 3])
    np.testing.assert_array_equal(good, [1, 2, 0, 1])


# --- equality with torch.amp.GradScaler ----------------------------------------


def _float32_exact(x: float) -> bool:
    return float(np.float32(x)) == x


@functools.cache
def _torch_like_run(growth_factor, backoff_factor, growth_interval, length):
    """A jitted loop of the full transformation over ``length`` steps, with the
    scale floor at float32's smallest normal and no ceiling."""
    tx = ls.dynamic(
        optax.sgd(1.0),
        initial_scale=1.0,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=FLOAT32_TINY,
        max_scale=math.inf,
    )

    @jax.jit
    def run(init_scale, injected):
        params = jnp.zeros(3)
        state = tx.init(params)._replace(scale=init_scale)

        def step(carry, value):
            params, state = carry
            # grads of sum(params) * scale, with an inf/nan in one element
            grads = jnp.ones(3).at[0].set(value) * state.scale
            updates, state = tx.update(grads, state, params)
            new_params = optax.apply_updates(params, updates)
            skipped = jnp.all(new_params == params)
            return (new_params, state), (state.scale, skipped, state.skipped)

        return jax.lax.scan(step, (params, state), injected)[1]

    return run


def test_full_transformation_equals_recorded_torch_gradscaler():
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["torch_version"].startswith("2.")
    trajectories = fixture["trajectories"]
    assert len(trajectories) == 300
    length = max(len(t["overflows"]) for t in trajectories)
    rng = np.random.default_rng(0)
    total_steps = exact = 0
    for t in trajectories:
        n = len(t["overflows"])
        injected = np.ones(length, np.float32)
        bad = rng.choice(np.float32([np.inf, -np.inf, np.nan]), size=n)
        injected[:n] = np.where(t["overflows"], bad, 1.0)
        run = _torch_like_run(t["growth_factor"], t["backoff_factor"], t["growth_interval"], length)
        scales, params_unchanged, skipped = (np.asarray(x)[:n] for x in run(np.float32(t["init_scale"]), injected))
        if _float32_exact(t["growth_factor"]) and _float32_exact(t["backoff_factor"]):
            np.testing.assert_array_equal(scales, np.float32(t["scales"]), err_msg=str(t))
            exact += 1
        else:
            # torch multiplies the float32 scale by a float64 factor and rounds
            # once; loss_scale multiplies in float32 by the rounded factor, so
            # each step may add one float32 rounding (at most 2**-23 relative).
            drift = np.abs(np.float64(scales) / np.float64(t["scales"]) - 1)
            np.testing.assert_array_less(drift, 2.0**-23 * np.arange(1, n + 1) * 1.001, err_msg=str(t))
        np.testing.assert_array_equal(skipped, t["skipped"])
        np.testing.assert_array_equal(params_unchanged, t["skipped"])
        total_steps += n
    assert total_steps > 50_000 and exact > 150


@functools.cache
def _rule_run(growth_factor, backoff_factor, growth_interval, hysteresis, consecutive, min_scale, max_scale):
    rule = DynamicRule(
        initial_scale=1.0,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
    )
    run = jax.jit(lambda init_scale, overflows: traced_trajectory(rule, overflows, init_scale)[0])
    return lambda init_scale, overflows: np.asarray(run(init_scale, np.asarray(overflows, bool)))


CONFIGS = st.tuples(st.sampled_from([1.5, 2.0, 3.0]), st.sampled_from([0.25, 0.5]), st.sampled_from([1, 2, 5]))
OVERFLOWS = st.lists(st.booleans(), min_size=64, max_size=64)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
    config=CONFIGS,
    init_exponent=st.integers(-20, 60),
    overflows=st.one_of(OVERFLOWS, st.lists(st.sampled_from([False] * 9 + [True]), min_size=64, max_size=64)),
)
def test_rule_equals_torch_transcription(config, init_exponent, overflows):
    growth, backoff, interval = config
    init_scale = 2.0**init_exponent
    run = _rule_run(growth, backoff, interval, 1, False, FLOAT32_TINY, math.inf)
    expected = oracles.torch_gradscaler_float32(overflows, init_scale, growth, backoff, interval)
    np.testing.assert_array_equal(run(np.float32(init_scale), overflows), np.float32([s for s, _ in expected]))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(config=CONFIGS, hysteresis=st.sampled_from([2, 3]), overflows=OVERFLOWS)
def test_hysteresis_equals_megatron_transcription(config, hysteresis, overflows):
    growth, backoff, interval = config
    run = _rule_run(growth, backoff, interval, hysteresis, False, 1.0, math.inf)
    expected = oracles.megatron_general(overflows, 2.0**10, growth, backoff, interval, hysteresis, 1.0)
    np.testing.assert_array_equal(run(np.float32(2.0**10), overflows), np.float32([s for s, _ in expected]))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(interval=st.sampled_from([1, 2, 5]), hysteresis=st.sampled_from([2, 3]), overflows=OVERFLOWS)
def test_consecutive_hysteresis_equals_deepspeed_transcription(interval, hysteresis, overflows):
    run = _rule_run(2.0, 0.5, interval, hysteresis, True, 1.0, math.inf)
    expected = oracles.deepspeed_consecutive(overflows, 2.0**10, 2.0, interval, hysteresis, 1.0)
    np.testing.assert_array_equal(run(np.float32(2.0**10), overflows), np.float32([s for s, _ in expected]))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(config=CONFIGS, overflows=OVERFLOWS, bounds=st.sampled_from([(1.0, 2.0**12), (2.0**-5, 2.0**3)]))
def test_scale_stays_within_bounds(config, overflows, bounds):
    growth, backoff, interval = config
    lo, hi = bounds
    run = _rule_run(growth, backoff, interval, 1, False, lo, hi)
    scales = run(np.float32(lo), overflows)
    assert np.all((scales >= lo) & (scales <= hi) & np.isfinite(scales))


# --- the state keeps its layout from step to step ------------------------------

LAYOUT_CASES = {
    "dynamic": lambda inner: ls.dynamic(inner),
    "dynamic+stats": lambda inner: ls.dynamic(inner, track_underflow=True, track_grad_norm=True, locate_overflows=True),
    "static": lambda inner: ls.static(inner, 8.0),
    "no_op": lambda inner: ls.no_op(inner),
    "predictive": lambda inner: ls.predictive(inner),
    **{f"presets.{name}": getattr(ls.presets, name) for name in ls.presets.__all__},
}


COUNTER_DTYPES = {
    "overflows_left": jnp.int32,
    "first_growth_pending": jnp.bool_,
    "headroom": jnp.int32,
    "grad_peak": jnp.float32,
    "searching": jnp.bool_,
    "overflow_run": jnp.int32,
    "extra_headroom": jnp.int32,
    "measured": jnp.bool_,
    "overflows": jnp.int32,
}


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_every_rule_keeps_its_state_layout_so_scan_and_donation_work(name):
    """``init``'s state has the shapes and dtypes of every later state (a
    float32 counter at step 0 would break ``lax.scan`` carries and donation),
    and a scan over clean and overflowing steps runs."""
    params = {"w": jnp.ones((3, 2)), "h": jnp.ones(4, jnp.bfloat16)}
    tx = LAYOUT_CASES[name](optax.sgd(0.1))
    state = tx.init(params)
    layout = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), state)
    # Counts are int32 and flags bool from step 0 (a select would otherwise
    # carry a float32 start through every later step).
    counters = state.counters._asdict()
    assert counters and {k: jnp.result_type(v) for k, v in counters.items()} == {k: COUNTER_DTYPES[k] for k in counters}
    assert {k: jnp.result_type(getattr(state, k)) for k in ("scale", "good_steps", "skipped_steps", "skipped")} == {
        "scale": jnp.float32,
        "good_steps": jnp.int32,
        "skipped_steps": jnp.int32,
        "skipped": jnp.bool_,
    }
    grads = jax.tree.map(jnp.ones_like, params)
    for poison in (1.0, jnp.inf):
        poisoned = jax.tree.map(lambda g, c=poison: g * c, grads)
        _, after = jax.jit(tx.update)(poisoned, state, params)
        assert jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), after) == layout, poison

    def step(carry, poison):
        p, s = carry
        updates, s = tx.update(jax.tree.map(lambda g: g * poison, grads), s, p)
        return (optax.apply_updates(p, updates), s), ls.get_scale(s)

    _, scales = jax.lax.scan(step, (params, state), jnp.array([1.0, jnp.inf, 1.0]))
    assert scales.shape == (3,)


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_counters_keep_their_dtypes_under_x64(hysteresis):
    # With jax_enable_x64 a bare Python int becomes int64: every counter must
    # still be built in its declared dtype, at init and after clean and
    # overflowing steps, or the state's layout changes under x64.
    with jax.enable_x64(True):
        tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0, growth_interval=2, hysteresis=hysteresis)
        params = jnp.zeros(2, jnp.float32)
        state = tx.init(params)
        layouts = [jax.tree.map(lambda x: x.dtype, state)]
        for g in [1.0, jnp.inf, 1.0, 1.0]:
            _, state = jax.jit(tx.update)(jnp.full(2, g, jnp.float32), state, params)
            layouts.append(jax.tree.map(lambda x: x.dtype, state))
        assert all(layout == layouts[0] for layout in layouts[1:]), layouts
        assert state.counters.overflows_left.dtype == jnp.int32
        assert state.good_steps.dtype == jnp.int32 and state.scale.dtype == jnp.float32

"""ls.value_grad_and_peak and the ``backward_peak=`` extra argument:
the measured peak against brute force, the gradients against
ls.value_and_grad's, transformations and shard_map, how ls.predictive
uses it, and that every other rule ignores it."""

import functools
import math
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import loss_scale as ls
from loss_scale._check import largest_magnitude
from loss_scale._rules.predictive import PredictiveRule
from tests._compare import assert_trees_close_to_largest
from tests._simulation import F16_MAX, SIMULATIONS, drifting_gradients, simulate

F16 = jnp.float16
DIMS = (((1,), (0,)), ((), ()))

# Float16 comparisons across programs. On CPUs with AVX512-FP16 float16
# arithmetic gives different bits eagerly and under jit, and across
# differently fused programs (DESIGN.md's trap), so a measurement (one
# program) is compared with the eager brute force or with ls.value_and_grad
# (others) within float16 rounding, never bit for bit. The relative error of
# staged_loss's peak (q's cotangent, kb = 256 times p's, exactly) is that of
# p - y at the peak element, plus one rounding of the cotangent's cast: p ends
# a chain of about 20 float16 roundings at worst (the dots' sums included,
# 2**-11 each), and |p - y| there is larger than |p| (no cancellation):
# k = 32 roundings. Losses (a square) and gradients (float16 sums over the
# batch) get twice that. Each is far below the factor 2 of a wrong binade.
# Values are compared leaf by leaf within VALUE_RTOL of the leaf's largest
# magnitude (elements much smaller than it carry the rounding of the large
# ones' float16 sums).
PEAK_RTOL = 32 * 2.0**-11
VALUE_RTOL = 64 * 2.0**-11


def assert_peak(peak, expected):
    """``peak`` (a measurement) is ``expected`` (the brute force, another
    program) within PEAK_RTOL; an infinite peak exactly."""
    peak = float(peak)
    if math.isinf(expected):
        assert peak == math.inf
    else:
        assert expected > 0 and abs(peak - expected) <= PEAK_RTOL * expected, (peak, expected)


# --- a float16 model written one primitive at a time --------------------------


def staged_loss(params, x, y, c, k, override=None, record=None):
    """A float16 model with a residual connection (``a`` is used twice) and
    an amplified intermediate (``(z / k) * k``: the cotangent of ``q`` is k
    times that of ``p``), one ``lax`` primitive per float16 value. Every
    float16 value gets a name: ``record`` collects them, ``override``
    replaces one (the rest of the model computed from the replacement)."""
    override = override or {}

    def v(name, value):
        value = override.get(name, value)
        if record is not None:
            record[name] = value
        return value

    xh = v("xh", lax.convert_element_type(x, F16))
    w1h = v("w1h", lax.convert_element_type(params["w1"], F16))
    a = v("a", lax.dot_general(xh, w1h, DIMS))
    t = v("t", lax.tanh(a))
    ch = v("ch", lax.convert_element_type(c, F16))
    chb = v("chb", lax.broadcast_in_dim(ch, a.shape, ()))
    u = v("u", lax.mul(t, chb))
    r = v("r", lax.add(u, a))
    w2h = v("w2h", lax.convert_element_type(params["w2"], F16))
    z = v("z", lax.dot_general(r, w2h, DIMS))
    kh = v("kh", lax.convert_element_type(k, F16))
    kb = v("kb", lax.broadcast_in_dim(kh, z.shape, ()))
    q = v("q", lax.div(z, kb))
    p = v("p", lax.mul(q, kb))
    return jnp.mean((lax.convert_element_type(p, jnp.float32) - y) ** 2)


def staged_data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.normal(size=(4, 8)) / 2, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(n, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(n, 1)), jnp.float32)
    return params, x, y, jnp.float32(3.0), jnp.float32(256.0)


def brute_force_peak(params, x, y, c, k, scale):
    """The largest |cotangent| of any float16 value of ``staged_loss`` at
    ``scale``, one ``jax.grad`` per value (the model rerun from it), inf if
    any is not finite."""
    values = {}
    staged_loss(params, x, y, c, k, record=values)
    peak = 0.0
    for name, value in values.items():
        ct = jax.grad(lambda v, name=name: staged_loss(params, x, y, c, k, {name: v}) * scale)(value)
        assert ct.dtype == F16
        ct = np.asarray(ct, np.float32)
        peak = max(peak, float(np.abs(ct).max()) if np.isfinite(ct).all() else math.inf)
    return peak, values


def state_at(tx, params, scale=None, good_steps=0):
    state = tx.init(params)
    changes = {"good_steps": jnp.int32(good_steps)}
    if scale is not None:
        changes["scale"] = jnp.float32(scale)
    return state._replace(**changes)


def test_the_model_names_every_float16_value_of_its_jaxpr():
    # The brute force sees every float16 value that the measurement probes.
    args = staged_data()
    values = {}
    staged_loss(*args, record=values)
    jaxpr = jax.make_jaxpr(staged_loss)(*args).jaxpr
    f16_outputs = [v for eqn in jaxpr.eqns for v in eqn.outvars if v.aval.dtype == F16]
    assert len(f16_outputs) == len(values) == 14


@pytest.mark.parametrize("scale", [1.0, 8.0, 2.0**-3, 2.0**10])
def test_the_peak_is_the_largest_cotangent_of_any_float16_value(jit, scale):
    args = staged_data()
    expected, _ = brute_force_peak(*args, scale)
    tx = ls.dynamic(optax.sgd(0.1), min_scale=2.0**-3, initial_scale=1.0)
    _, _, peak = jit(ls.value_grad_and_peak(staged_loss))(state_at(tx, args[0], scale), *args)
    assert peak.dtype == jnp.float32 and peak.shape == ()
    if math.isfinite(expected):
        # The amplified q's cotangent, 256 times p's, is the largest.
        assert_peak(peak, expected)
    else:  # 2**10: q's cotangent overflows float16
        assert scale == 2.0**10 and float(peak) == math.inf


def test_the_peak_counts_only_the_compute_dtype_and_the_gradients_of_that_dtype():
    args = staged_data()
    tx = ls.static(optax.sgd(0.1), 1.0)
    state = tx.init(args[0])
    # Nothing in the backward pass is bfloat16.
    _, _, peak = ls.value_grad_and_peak(staged_loss, compute_dtype=jnp.bfloat16)(state, *args)
    assert float(peak) == 0.0
    # A float16 parameter's own gradient counts: here it is the largest.
    w = jnp.full((3,), 2.0, F16)
    _, grads, peak = ls.value_grad_and_peak(lambda w: jnp.sum(w * w).astype(jnp.float32))(state, w)
    assert float(peak) == float(jnp.max(grads)) == 4.0  # 2 * w: exact in float16, in every program


def test_non_finite_cotangents_give_inf_even_where_max_drops_nan():
    # XLA:CPU's max over 4096+ float32 elements drops NaN (DESIGN.md's trap).
    x = jnp.ones(8192, F16).at[100].set(jnp.nan)
    assert float(largest_magnitude(x)) == math.inf
    assert float(largest_magnitude(jnp.zeros((0, 3), F16))) == 0.0
    assert float(largest_magnitude(jnp.array([-3.0, 2.0], F16))) == 3.0


@pytest.mark.parametrize("every", [1, 4, 16])
def test_measures_on_steps_whose_good_steps_is_a_multiple_of_every(every):
    args = staged_data()
    expected, _ = brute_force_peak(*args, 1.0)
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0)
    fn = jax.jit(ls.value_grad_and_peak(staged_loss, every=every))
    for good_steps in [0, 1, 3, 4, 5, 15, 16, 17, 32, 100]:
        _, _, peak = fn(state_at(tx, args[0], good_steps=good_steps), *args)
        if good_steps % every == 0:
            assert_peak(peak, expected)
        else:
            assert float(peak) == 0.0, good_steps  # not measured: exactly 0


@pytest.mark.parametrize("good_steps", [0, 1])  # measuring, not measuring
def test_value_and_grads_are_value_and_grads(jit, good_steps):
    # Jitted or not, the evaluation is compiled (inside a lax.cond), a
    # program other than ls.value_and_grad's: equal within float16 rounding.
    args = staged_data()
    tx = ls.predictive(optax.sgd(0.1), initial_scale=4.0)
    state = state_at(tx, args[0], good_steps=good_steps)
    loss, grads, _ = jit(ls.value_grad_and_peak(staged_loss, every=2))(state, *args)
    want_loss, want_grads = jax.jit(ls.value_and_grad(staged_loss))(state, *args)
    assert_trees_close_to_largest((loss, grads), (want_loss, want_grads), rtol=VALUE_RTOL)


# --- the same arguments as value_and_grad ---------------------------------------


def mlp_loss(params, x, scale_out, *, bias=0.0):
    h = jnp.tanh(x.astype(F16) @ params["w"].astype(F16))
    out = (h * scale_out.astype(F16)).astype(jnp.float32)
    return jnp.mean((out + bias) ** 2), {"h_max": jnp.max(jnp.abs(h))}


@pytest.mark.parametrize("good_steps", [0, 3])
@pytest.mark.parametrize("argnums", [0, (0, 2), -1, (2,)])
def test_argnums_has_aux_and_keywords_as_value_and_grad(jit, argnums, good_steps):
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)}
    x, s = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), jnp.float32(2.0)
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=16.0)
    state = state_at(tx, params, good_steps=good_steps)
    got = jit(ls.value_grad_and_peak(mlp_loss, argnums=argnums, has_aux=True))(state, params, x, s, bias=0.5)
    want = jit(ls.value_and_grad(mlp_loss, argnums=argnums, has_aux=True))(state, params, x, s, bias=0.5)
    chex.assert_trees_all_equal_structs(got[:2], want)
    assert_trees_close_to_largest(got[:2], want, rtol=VALUE_RTOL)  # two programs (eager: one compiled, one op by op)
    assert (float(got[2]) > 0) == (good_steps == 0)


@pytest.mark.parametrize(
    "make, call, error",
    [
        (lambda f: f(lambda p: p * jnp.ones(2)), lambda g, st: g(st, jnp.ones(())), TypeError),
        (lambda f: f(lambda p: p, has_aux=True), lambda g, st: g(st, jnp.ones(())), TypeError),
        (lambda f: f(lambda p, q: p * q, argnums=2), lambda g, st: g(st, 1.0, 2.0), TypeError),
        (lambda f: f(lambda p, q: p * q, argnums=-3), lambda g, st: g(st, 1.0, 2.0), ValueError),
        (lambda f: f(lambda p: p.astype(jnp.float32)), lambda g, st: g(st, jnp.ones((), jnp.int32)), TypeError),
        (lambda f: f(lambda p: jnp.int32(1)), lambda g, st: g(st, jnp.ones(())), TypeError),
    ],
)
def test_misuse_raises_what_value_and_grad_raises(make, call, error):
    state = ls.dynamic(optax.sgd(0.1)).init(jnp.zeros(()))
    with pytest.raises(error) as want:
        call(make(ls.value_and_grad), state)
    with pytest.raises(error) as got:
        call(make(ls.value_grad_and_peak), state)
    assert str(got.value) == str(want.value)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="every must be >= 1"):
        ls.value_grad_and_peak(staged_loss, every=0)
    with pytest.raises(TypeError, match="every must be an int"):
        ls.value_grad_and_peak(staged_loss, every=2.5)
    with pytest.raises((TypeError, ValueError), match="compute_dtype"):
        ls.value_grad_and_peak(staged_loss, compute_dtype="int8")
    with pytest.raises(TypeError, match="fun must be callable"):
        ls.value_grad_and_peak(3)


def test_vmap_over_states_and_params_measures_each_its_own_steps():
    args = staged_data()
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0)
    scales = jnp.array([1.0, 2.0, 4.0, 8.0])
    states = jax.vmap(lambda s, g: state_at(tx, args[0], s, g))(scales, jnp.array([0, 1, 2, 4]))
    params = jax.tree.map(lambda p: jnp.stack([p, 2 * p, -p, p]), args[0])
    fn = jax.jit(jax.vmap(ls.value_grad_and_peak(staged_loss, every=2), in_axes=(0, 0, None, None, None, None)))
    losses, grads, peaks = fn(states, params, *args[1:])
    for i in range(4):
        at = functools.partial(lambda i, tree: jax.tree.map(lambda leaf: leaf[i], tree), i)
        expected = brute_force_peak(at(params), *args[1:], float(scales[i]))[0] if i != 1 else 0.0
        if i == 1:
            assert float(peaks[i]) == 0.0  # not measured: exactly 0
        else:
            assert_peak(peaks[i], expected)
        want_loss, want_grads = jax.jit(ls.value_and_grad(staged_loss))(at(states), at(params), *args[1:])
        assert_trees_close_to_largest((losses[i], at(grads)), (want_loss, want_grads), rtol=VALUE_RTOL)


def test_jitted_and_checkpointed_functions_are_looked_into_control_flow_is_not():
    args = staged_data()
    expected, _ = brute_force_peak(*args, 1.0)
    state = ls.static(optax.sgd(0.1), 1.0).init(args[0])

    def inside_jit(*a):
        return jax.jit(jax.checkpoint(staged_loss))(*a)

    _, _, peak = jax.jit(ls.value_grad_and_peak(inside_jit))(state, *args)
    assert_peak(peak, expected)

    def inside_scan(*a):  # a loop of one step: seen at its output only
        return lax.scan(lambda carry, _: (staged_loss(*a), None), jnp.float32(0), length=1)[0]

    _, grads, peak = jax.jit(ls.value_grad_and_peak(inside_scan))(state, *args)
    assert_trees_close_to_largest(grads, jax.jit(ls.value_and_grad(staged_loss))(state, *args)[1], rtol=VALUE_RTOL)
    assert float(peak) < expected / 100  # the amplified value inside was missed


# --- the rule ---------------------------------------------------------------------


def run_rule(rule, grad_maxes, peaks=None, finite=None):
    """Feeds ``rule`` one step per entry (as tests/test_predictive.py's), with
    ``peaks`` as ``backward_peak``."""
    grad_maxes = jnp.asarray(grad_maxes, jnp.float32)
    finite = jnp.isfinite(grad_maxes) if finite is None else jnp.asarray(finite, bool)
    peaks = None if peaks is None else jnp.asarray(peaks, jnp.float32)

    def step(c, inputs):
        ok, g, b = inputs
        c = rule.adjust(c, ok, g, b)
        return c, c

    _, out = jax.lax.scan(step, rule.init(), (finite, grad_maxes, peaks))
    return SimpleNamespace(scale=out.scale, good_steps=out.good_steps, **out.counters._asdict())


def amplified_run(rule, grads, amplification, every, seen=1.0):
    """A simulated float16 backward pass (as tests/_simulation.py's),
    whose measurement sees ``seen`` of the true amplification."""

    def step(c, g):
        largest = c.scale * g * amplification
        finite = largest <= F16_MAX
        peak = jnp.where(c.good_steps % every == 0, jnp.where(finite, largest * seen, jnp.inf), 0.0)
        new = rule.adjust(c, finite, jnp.where(finite, g, jnp.inf), peak)
        return new, (c.scale, ~finite, new.counters.headroom, new.counters.extra_headroom)

    _, out = jax.lax.scan(step, rule.init(), jnp.asarray(grads, jnp.float32))
    return [np.asarray(o) for o in out]


def step_through(rule, grad_maxes, amplifications):
    """Steps ``rule`` one update at a time; a step's ``backward_peak`` is its
    amplification times the largest scaled gradient at the scale it ran at
    (0 where the amplification is ``None``). Returns the counters as numpy."""
    state, states = rule.init(), []
    for g, amplification in zip(grad_maxes, amplifications, strict=True):
        g = jnp.float32(g)
        peak = 0.0 if amplification is None else state.scale * g * amplification
        state = rule.adjust(state, jnp.isfinite(g), g, jnp.float32(peak))
        states.append(state)
    out = jax.tree.map(lambda *xs: np.stack(xs), *states)
    return SimpleNamespace(scale=out.scale, good_steps=out.good_steps, **out.counters._asdict())


def test_a_measured_peak_sets_the_headroom_and_moves_the_scale_at_once():
    rule = PredictiveRule(initial_scale=1.0, min_headroom=1)
    out = step_through(rule, [2.0**-4] * 4, [2.0**5, 2.0**10, 2.0**10, 2.0**3])
    # 65504 / 2**-4 has floor(log2) = 19 binades: the target is 2**(19 - H),
    # with H = min_headroom + the amplification's binades.
    np.testing.assert_array_equal(out.headroom, [6, 11, 11, 4])
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([13, 8, 8, 15]))  # 2**8 -> 2**15 in one step
    np.testing.assert_array_equal(out.searching, False)
    np.testing.assert_array_equal(out.measured, True)
    np.testing.assert_array_equal(out.good_steps, [1, 2, 3, 4])  # a measurement does not restart it


def test_the_amplification_is_rounded_up():
    rule = PredictiveRule(initial_scale=1.0, min_headroom=1)
    # 3x is 1.58 binades: 2 of them (a peak 3x the gradient at 2**-4 * 2**16
    # would be 3 * 2**12, within 2**14 = 65504 / 4 of the threshold).
    out = run_rule(rule, [2.0**-4], [3 * 2.0**-4])
    assert int(out.headroom[0]) == 1 + 2 and float(out.scale[0]) == 2.0 ** (19 - 3)
    # No amplification (or a peak smaller than the gradient): min_headroom.
    out = run_rule(rule, [2.0**-4, 2.0**-4], [2.0**-4, 2.0**-6])
    np.testing.assert_array_equal(out.headroom, [1, 1])


@pytest.mark.parametrize(
    "peak, grad",
    [(0.0, 2.0**-4), (jnp.inf, 2.0**-4), (jnp.nan, 2.0**-4), (-1.0, 2.0**-4), (1.0, 0.0), (2.0**-140, 2.0**100)],
)
def test_steps_without_a_usable_measurement_are_as_without_one(peak, grad):
    rule = PredictiveRule(initial_scale=2.0**10)
    with_peak = run_rule(rule, [grad, grad, jnp.inf, grad], [peak] * 4)
    without = run_rule(rule, [grad, grad, jnp.inf, grad])
    chex.assert_trees_all_equal(vars(with_peak), vars(without))


def test_zero_peaks_leave_the_rule_bit_identical():
    rng = np.random.default_rng(3)
    grads = np.exp(rng.normal(size=400) * 2) * 1e-3
    grads[rng.integers(0, 400, 30)] = np.inf
    for rule in (PredictiveRule(), PredictiveRule(initial_scale=1.0, headroom_interval=7)):
        chex.assert_trees_all_equal(vars(run_rule(rule, grads, np.zeros(400))), vars(run_rule(rule, grads)))


def test_an_overflow_adds_extra_headroom_that_measurements_keep_and_relaxation_removes():
    rule = PredictiveRule(initial_scale=1.0, headroom_interval=6)
    g, inf = 2.0**-4, math.inf
    # Measured (8x: H = 1 + 3), an overflow, measured again, then clean steps
    # without a measurement.
    out = step_through(rule, [g, inf, g] + [g] * 8, [8.0, None, 8.0] + [None] * 8)
    np.testing.assert_array_equal(out.headroom, [4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])
    np.testing.assert_array_equal(out.scale, 2.0 ** np.array([15, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14]))
    np.testing.assert_array_equal(out.extra_headroom, [0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    # After headroom_interval clean steps the extra margin drops, H is not
    # probed, and good_steps restarts so that the next step measures.
    np.testing.assert_array_equal(out.good_steps, [1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    np.testing.assert_array_equal(out.measured, [True] * 7 + [False] * 4)
    # That next measurement drops H by the extra binade.
    out = step_through(rule, [g, inf, g] + [g] * 6, [8.0, None, 8.0] + [None] * 4 + [8.0, None])
    np.testing.assert_array_equal(out.headroom[-2:], [4, 4])
    np.testing.assert_array_equal(out.scale[-2:], 2.0**15)


def test_a_peak_the_measurement_misses_costs_a_few_skips_not_one_per_measurement():
    # The measurement sees 1/8 of the true 3000x amplification (say, the
    # largest value is inside a scan): the overflows teach the 3 binades.
    grads = drifting_gradients(4000, noise=0.05)
    scales, skipped, headroom, extra = amplified_run(PredictiveRule(initial_scale=1.0), grads, 3000.0, 16, 1 / 8)
    assert 1 <= skipped.sum() <= 4, np.nonzero(skipped)
    assert extra[-1] == skipped.sum()
    # Measured right: no skip at all.
    _, skipped, _, extra = amplified_run(PredictiveRule(initial_scale=1.0), grads, 3000.0, 16)
    assert skipped.sum() == 0 and extra[-1] == 0


@pytest.mark.parametrize("every", [1, 16])
@pytest.mark.parametrize("steps, noise, amplification", SIMULATIONS)
def test_simulated_runs_skip_ten_times_less_than_the_torch_rule(steps, noise, amplification, every):
    from loss_scale._rules.dynamic import DynamicRule

    grads = drifting_gradients(steps, noise)
    torch_rule = DynamicRule(initial_scale=2.0**16, min_scale=2.0**-30, max_scale=math.inf)
    _, torch_skips = simulate(torch_rule, grads, amplification)
    scales, skips = simulate(PredictiveRule(initial_scale=1.0), grads, amplification, every)
    assert torch_skips.sum() >= 10 * skips.sum() and torch_skips.sum() >= 5, (torch_skips.sum(), skips.sum())
    # At no more than two binades more headroom than the torch rule's.
    headroom = np.log2(F16_MAX / (scales * grads * amplification))[100:]
    torch_scales, _ = simulate(torch_rule, grads, amplification)
    torch_headroom = np.log2(F16_MAX / (torch_scales * grads * amplification))[100:]
    assert np.median(headroom) <= np.median(torch_headroom) + 2


# --- every other rule ignores it ------------------------------------------------------

IGNORING = {
    "dynamic": lambda inner: ls.dynamic(inner, initial_scale=2.0**6, growth_interval=3),
    "dynamic hysteresis": lambda inner: ls.dynamic(inner, initial_scale=2.0**6, growth_interval=3, hysteresis=2),
    "static": lambda inner: ls.static(inner, 8.0),
    "no_op": lambda inner: ls.no_op(inner),
    "no_op checked": lambda inner: ls.no_op(inner, skip_nonfinite=True),
    **{f"presets.{name}": getattr(ls.presets, name) for name in ls.presets.__all__},
}


@pytest.mark.parametrize("name", IGNORING)
def test_other_rules_ignore_the_backward_peak(name):
    tx = IGNORING[name](optax.adam(1e-2))
    params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    rng = np.random.default_rng(0)

    @jax.jit
    def step(params, state, i, peak):
        grads = {"w": jnp.where(i % 5 == 3, jnp.inf, params["w"] * state.scale)}
        if peak is None:
            return ls.apply_gradients(tx, grads, state, params)
        return ls.apply_gradients(tx, grads, state, params, backward_peak=peak)

    plain = measured = (params, tx.init(params))
    for i in range(12):
        plain = step(*plain, jnp.int32(i), None)
        measured = step(*measured, jnp.int32(i), jnp.float32(rng.choice([0.0, 1e4, np.inf, 3.0])))
    # Bit for bit: float32 only, and the ignored peak leaves the same program.
    chex.assert_trees_all_equal(measured, plain)


# --- the transformation ----------------------------------------------------------------


def test_the_backward_peak_is_the_transformations_not_the_inner_optimizers():
    def update(updates, state, params=None, *, value=None):  # no **extra_args: a backward_peak would raise
        del params, value
        return updates, state

    strict = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    tx = ls.predictive(strict, initial_scale=1.0)
    state = tx.init(jnp.zeros(2))
    g = jnp.array([2.0**-4, 0.0])
    updates, state = tx.update(g, state, None, value=jnp.float32(1.0), backward_peak=jnp.float32(2.0**-1))
    np.testing.assert_array_equal(updates, g)
    # 8x the gradient: H = 1 + 3, the scale 2**(19 - 4).
    assert int(state.headroom) == 4 and float(state.scale) == 2.0**15 and bool(state.measured)
    _, fused = ls.apply_gradients(tx, g, tx.init(jnp.zeros(2)), jnp.zeros(2), backward_peak=jnp.float32(2.0**-1))
    chex.assert_trees_all_equal(fused, state)


def test_a_backward_peak_that_is_not_a_floating_scalar_is_refused():
    tx = ls.predictive(optax.sgd(0.1))
    state = tx.init(jnp.zeros(2))
    for bad in (jnp.ones(2), jnp.int32(3)):
        with pytest.raises(TypeError, match="backward_peak must be a floating scalar"):
            tx.update(jnp.ones(2), state, backward_peak=bad)
    _, state = tx.update(jnp.ones(2), state, backward_peak=4.0)  # a Python float is fine
    assert bool(state.measured)


# --- float16 training -------------------------------------------------------------------


def test_float16_training_with_an_amplified_intermediate_never_skips():
    """tests/test_predictive.py's float16 MLP whose backward pass amplifies an
    intermediate 4096x (k a runtime value, so XLA cannot fold ``(z / k) *
    k``): with measured peaks ``ls.predictive`` starts at 1, jumps to the
    measured target after the first step and never skips, where the torch
    rule skips its way down from 2**16 and ``ls.predictive`` without
    measurements learns the amplification from an overflow."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    y = jnp.asarray(x @ rng.normal(size=(16, 1)), jnp.float32)
    params0 = {"w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32), "w2": jnp.zeros((32, 1))}

    def loss_fn(p, k):
        h = jnp.tanh(x.astype(F16) @ p["w1"].astype(F16))
        z = h @ p["w2"].astype(F16)
        pred = ((z / k) * k).astype(jnp.float32)
        return jnp.mean((pred - y) ** 2)

    def train(tx, measure, steps=300):
        @jax.jit
        def step(params, state, k):
            if measure:
                loss, grads, peak = ls.value_grad_and_peak(loss_fn)(state, params, k)
                params, state = ls.apply_gradients(tx, grads, state, params, backward_peak=peak)
            else:
                loss, grads = ls.value_and_grad(loss_fn)(state, params, k)
                params, state = ls.apply_gradients(tx, grads, state, params)
            return params, state, loss

        params, state = params0, tx.init(params0)
        losses, skipped, scales = [], [], []
        for _ in range(steps):
            params, state, loss = step(params, state, jnp.float16(2.0**12))
            losses.append(float(loss))
            skipped.append(bool(state.skipped))
            scales.append(float(state.scale))
        return np.array(losses), np.array(skipped), np.array(scales), state

    losses, skipped, scales, state = train(ls.predictive(optax.adam(1e-2), initial_scale=1.0), True)
    assert skipped.sum() == 0
    assert scales[0] > 1.0 and bool(state.measured) and int(state.headroom) >= 8
    torch_losses, torch_skipped, _, _ = train(ls.presets.torch(optax.adam(1e-2)), False)
    assert torch_skipped[0] and torch_skipped.sum() >= 5
    _, learned_skipped, _, _ = train(ls.predictive(optax.adam(1e-2)), False)
    assert learned_skipped.sum() >= 1
    assert losses[-1] < losses[0] / 100 and losses[-1] <= torch_losses[-1]


# --- shard_map and axis_name ---------------------------------------------------------------

N = 4


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count>=4 (tests/conftest.py sets it)")
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def data_parallel(mesh, outputs: int, check_vma: bool):
    """``jax.jit`` of ``shard_map`` over ``staged_data``'s arguments
    ``(state, params, x, y, c, k)``: the batch ``x, y`` split along "data",
    the rest replicated; ``outputs`` per-device results."""
    return lambda step: jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data"), P(), P()),
            out_specs=(P("data"),) * outputs,
            check_vma=check_vma,
        )
    )


def split_batch(mesh, x, y):
    sharding = NamedSharding(mesh, P("data"))
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


@pytest.mark.parametrize("check_vma", [True, False])
def test_replicas_agree_on_the_peak_and_the_scale(mesh, check_vma):
    params, x, y, c, k = staged_data(n=4 * N)
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0, axis_name="data")
    state = tx.init(params)

    @data_parallel(mesh, outputs=3, check_vma=check_vma)
    def step(state, params, x, y, c, k):
        _, grads, peak = ls.value_grad_and_peak(staged_loss, axis_name="data")(state, params, x, y, c, k)
        _, grads_plain = ls.value_and_grad(staged_loss, axis_name="data")(state, params, x, y, c, k)
        _, new_state = tx.update(grads, state, params, backward_peak=peak)
        # Two differently fused computations in one program: within float16
        # rounding (VALUE_RTOL of each leaf's largest magnitude).
        same = jnp.all(
            jnp.array(
                [
                    jnp.all(jnp.abs(a - b) <= VALUE_RTOL * jnp.max(jnp.abs(b)))
                    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_plain), strict=True)
                ]
            )
        )
        return peak[None], new_state.scale[None], same[None]

    peaks, scales, same = step(state, params, *split_batch(mesh, x, y), c, k)
    # One pmax'd peak and one scale computed from it: the same bits everywhere.
    assert len(set(np.asarray(peaks).tolist())) == 1 and len(set(np.asarray(scales).tolist())) == 1
    assert np.asarray(same).all()
    if check_vma:
        # The loss is averaged before differentiating: each device's
        # cotangents are those of the one-device run over the global batch.
        assert_peak(np.asarray(peaks)[0], brute_force_peak(params, x, y, c, k, 1.0)[0])
    else:
        # Each device differentiates its local mean (N times larger cotangents)
        # and the gradients are averaged after: the peak says so.
        assert_peak(np.asarray(peaks)[0], N * brute_force_peak(params, x, y, c, k, 1.0)[0])


def test_the_transformation_takes_the_largest_peak_over_its_axis(mesh):
    params, x, y, c, k = staged_data(n=4 * N)
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0, axis_name="data")
    state = tx.init(params)

    @data_parallel(mesh, outputs=2, check_vma=False)
    def step(state, params, x, y, c, k):
        _, grads = ls.value_and_grad(staged_loss, axis_name="data")(state, params, x, y, c, k)
        # A different peak on every replica.
        peak = jnp.float32(2.0) ** (10 + lax.axis_index("data")).astype(jnp.float32)
        _, new_state = tx.update(grads, state, params, backward_peak=peak)
        return new_state.scale[None], new_state.headroom[None]

    scales, headrooms = step(state, params, *split_batch(mesh, x, y), c, k)
    assert len(set(np.asarray(scales).tolist())) == 1 and len(set(np.asarray(headrooms).tolist())) == 1

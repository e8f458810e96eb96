"""``ls.low_precision``: bfloat16/float16 parameters and optimizer state with
Kahan-compensated, stochastic or nearest rounding.

Hand-computed cases and properties on real optax optimizers: small updates
add up, stochastic rounding is unbiased, ``apply_updates`` reproduces the
rounded parameters exactly, float32 leaves are untouched, moments stored in
bfloat16 still decay, the key is deterministic, and bad input is refused.
Composition (loss scaling, jit/vmap/scan, devices, checkpoints, frameworks)
is in tests/test_low_precision_composition.py.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._low_precision._rounding import random_bits, round_stochastic
from tests._compare import assert_trees_bitwise

ROUNDINGS = ("kahan", "stochastic", "nearest")
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


def run_steps(tx, params, grads, steps):
    """``steps`` updates with the same gradients, applied with optax.apply_updates, in one scan."""

    @jax.jit
    def run(params, state):
        def step(carry, _):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(step, (params, state), length=steps)[0]

    return run(params, tx.init(params))


# ---------------------------------------------------------------------------
# Small updates add up
# ---------------------------------------------------------------------------


def test_a_thousand_updates_of_1e_4_to_1_in_bfloat16():
    # 1e-4 is below half bfloat16's resolution at 1.0 (2**-8 = 0.0039): rounded
    # to nearest, every update is lost; compensated or stochastic, they add up.
    params = {"w": jnp.ones(4096, jnp.bfloat16)}
    grads = {"w": jnp.full(4096, -1e-4, jnp.float32)}  # sgd(1.0): updates of +1e-4
    final = {}
    for rounding in ROUNDINGS:
        p, state = run_steps(ls.low_precision(optax.sgd(1.0), rounding), params, grads, 1000)
        assert p["w"].dtype == BF16
        final[rounding] = np.asarray(p["w"], np.float32)
    bare, _ = run_steps(optax.sgd(1.0), params, grads, 1000)
    np.testing.assert_array_equal(np.asarray(bare["w"], np.float32), 1.0)
    np.testing.assert_array_equal(final["nearest"], 1.0)
    # Kahan: every element lands on bfloat16's nearest value to 1.1.
    np.testing.assert_array_equal(final["kahan"], float(jnp.bfloat16(1.1)))
    # Stochastic: each element is a random walk around 1.1, their mean at 1.1. Each
    # step rounds up with probability f = 1e-4 / 2**-7, adding variance gap**2 f (1 - f).
    gap, f = 2.0**-7, 1e-4 / 2.0**-7
    sigma = np.sqrt(1000 * gap**2 * f * (1 - f))  # 0.028
    assert abs(final["stochastic"].mean() - 1.1) < 6 * sigma / np.sqrt(4096)
    assert abs(final["stochastic"].std() - sigma) < 0.1 * sigma


def test_kahan_keeps_what_rounding_lost_in_the_compensation():
    # One step by hand: 1.0 + 1e-3 rounds back to 1.0, the compensation holds 1e-3.
    tx = ls.low_precision(optax.sgd(1.0), "kahan")
    params = jnp.ones(2, jnp.bfloat16)
    state = tx.init(params)
    updates, state = tx.update(jnp.full(2, -1e-3), state, params)
    assert updates.dtype == F32
    np.testing.assert_array_equal(np.asarray(updates), 0.0)
    np.testing.assert_array_equal(np.asarray(state.compensation, np.float32), np.float32(jnp.bfloat16(1e-3)))
    # Four more: the compensation reaches half the gap (0.0039) and the parameter moves by one gap.
    for _ in range(4):
        updates, state = tx.update(jnp.full(2, -1e-3), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(params, np.float32), 1.0 + 2.0**-7)
    total = np.asarray(params, np.float32) + np.asarray(state.compensation, np.float32)
    # 1.005 up to the compensation's roundings: half its unit in the last place (2**-17 below 2**-8) a step.
    np.testing.assert_allclose(total, 1.005, atol=5 * 2.0**-17)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_kahan_invariant_per_step(dtype):
    # p_new + c_new == p + c + delta in float32, up to the rounding of c_new
    # (half a unit in its last place), over random magnitudes.
    rng = np.random.default_rng(0)
    n = 50_000
    p = jnp.asarray(rng.uniform(0.5, 2.0, n) * 2.0 ** rng.integers(-8, 8, n), dtype)
    c = jnp.asarray(np.asarray(p, np.float32) * rng.uniform(-(2.0**-9), 2.0**-9, n), dtype)
    delta = np.asarray(p, np.float32) * (2.0 ** rng.uniform(-20, 0, n) * rng.choice([-1, 1], n))
    tx = ls.low_precision(optax.sgd(1.0), "kahan")
    state = tx.init(p)._replace(compensation=c)
    updates, state = jax.jit(tx.update)(jnp.asarray(-delta, F32), state, p)
    new_p = np.asarray(optax.apply_updates(p, updates), np.float64)
    new_c = np.asarray(state.compensation, np.float64)
    want = np.asarray(p, np.float64) + np.asarray(c, np.float64) + delta.astype(np.float32)
    # Half an ulp of c_new in its dtype (a subnormal's is fixed), plus the
    # float32 rounding of delta + c, half an ulp of its magnitude.
    half_ulp = np.maximum(np.abs(new_c) * float(jnp.finfo(dtype).eps), float(jnp.finfo(dtype).smallest_subnormal)) / 2
    float32_rounding = (np.abs(delta) + np.abs(np.asarray(c, np.float64))) * 2.0**-24
    assert np.all(np.abs(new_p + new_c - want) <= half_ulp + float32_rounding)


# ---------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("fraction", [0.03125, 0.25, 0.5, 0.8125])
def test_stochastic_rounding_is_unbiased(dtype, fraction):
    # x = a + fraction * gap, between two neighbours a and a + gap, both signs
    # and several binades: the mean of many roundings is x, the frequency of
    # rounding up is the fraction (six standard deviations of margin).
    n = 2**16
    rng = np.random.default_rng(1)
    base = jnp.asarray(rng.uniform(1, 2, n) * 2.0 ** rng.integers(-6, 6, n) * rng.choice([-1, 1], n), dtype)
    base32 = np.asarray(base, np.float32)
    away = jnp.asarray(np.sign(base32) * np.inf, dtype)
    gap = np.abs(np.asarray(jnp.nextafter(base, away), np.float32) - base32)
    x = base32 + np.sign(base32) * fraction * gap  # away from zero: the gap above |base|
    tx = ls.low_precision(optax.sgd(1.0), "stochastic", seed=3)
    updates, _ = jax.jit(tx.update)(jnp.asarray(base32 - x), tx.init(base), base)
    rounded = np.asarray(optax.apply_updates(base, updates), np.float32)
    up = rounded != base32
    assert np.all(rounded[up] == base32[up] + np.sign(base32[up]) * gap[up])  # only the two neighbours
    sigma = np.sqrt(fraction * (1 - fraction) / n)
    assert abs(up.mean() - fraction) < 6 * sigma, (up.mean(), fraction)
    error = (rounded - x) / gap
    assert abs(error.mean()) < 6 * sigma


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_stochastic_rounding_matches_a_float64_reference_bit_for_bit(dtype):
    # Given the random word, the rounding is decided: with d = 23 - mantissa
    # dropped bits and offset = the word's top d bits, |x| goes to the upper
    # neighbour exactly when offset + fraction * 2**d >= 2**d, fraction being
    # |x|'s distance above the lower neighbour over the gap. The reference
    # finds the neighbours in float64 from the exponent (float16's grid fixed
    # at 2**-24 below its normals, where x is drawn on a 2**-37 grid so that
    # the fraction has at most d bits), both signs, 2**-30 to 2**14.
    n, mantissa = 1 << 15, {BF16: 7, F16: 10}[dtype]
    dropped = 23 - mantissa
    rng = np.random.default_rng(11)
    x = rng.uniform(1, 2, n) * 2.0 ** rng.integers(-30, 15, n) * rng.choice([-1, 1], n)
    x = np.where(np.abs(x) < 2.0**-14, np.round(x * 2.0**37) * 2.0**-37, x).astype(np.float32)
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    got = np.asarray(round_stochastic(jnp.asarray(x), dtype, jnp.asarray(words)), np.float64)

    magnitude = np.abs(x.astype(np.float64))
    gap = 2.0 ** (np.floor(np.log2(magnitude)) - mantissa)
    if dtype == F16:
        gap = np.maximum(gap, 2.0**-24)
    lower = np.floor(magnitude / gap) * gap
    fraction = (magnitude - lower) / gap
    offset = (words >> (32 - dropped)).astype(np.float64)
    up = offset + fraction * 2.0**dropped >= 2.0**dropped
    want = np.sign(x) * (lower + up * gap)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]
    assert 0.3 < up.mean() < 0.7  # both neighbours are taken


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_stochastic_rounding_keeps_nans_infinities_and_signed_zeros_whatever_the_bits(dtype):
    # Every word, the largest included (which would carry a NaN's full
    # payload into its sign bit, or an infinity's exponent into the next).
    specials = [np.inf, -np.inf, 0.0, -0.0, *(np.uint32([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001]).view(np.float32))]
    x = jnp.asarray(np.repeat(np.float32(specials), 4))
    words = jnp.asarray(np.tile(np.uint32([0, 1, 0x7FFFFFFF, 0xFFFFFFFF]), len(specials)))
    out = np.asarray(round_stochastic(x, dtype, words), np.float32).reshape(len(specials), 4)
    assert np.all(out[0] == np.inf) and np.all(out[1] == -np.inf)
    assert np.all(out[2] == 0) and not np.any(np.signbit(out[2]))
    assert np.all(out[3] == 0) and np.all(np.signbit(out[3]))
    assert np.all(np.isnan(out[4:]))
    biggest = float(jnp.finfo(dtype).max)
    last_gap = biggest - float(jnp.nextafter(jnp.asarray(biggest, dtype), jnp.asarray(0, dtype)))
    near_max = jnp.full(4096, biggest + last_gap / 4, F32)  # a quarter of a gap above the largest value
    rounded = np.asarray(round_stochastic(near_max, dtype, random_bits(jnp.array([3, 4], jnp.uint32), (4096,))))
    assert set(np.unique(rounded.astype(np.float32))) == {biggest, np.inf}
    assert abs(np.isinf(rounded).mean() - 0.25) < 0.05


def test_stochastic_rounding_of_exact_special_and_overflowing_values():
    bits = random_bits(jnp.array([7, 9], jnp.uint32), (6,))
    x = jnp.array([1.0, 0.0, -0.0, jnp.inf, jnp.nan, 70000.0], F32)
    out = np.asarray(round_stochastic(x, F16, bits), np.float32)
    assert out[0] == 1.0 and out[1] == 0.0 and np.signbit(out[2]) and out[3] == np.inf and np.isnan(out[4])
    assert out[5] == np.inf  # beyond float16's range: an infinity, as rounding to nearest gives
    tiny = jnp.full(4096, 2.0**-26, F32)  # a quarter of float16's smallest subnormal
    rounded = np.asarray(round_stochastic(tiny, F16, random_bits(jnp.array([1, 2], jnp.uint32), (4096,))), np.float32)
    assert set(np.unique(rounded)) == {0.0, 2.0**-24} and abs((rounded > 0).mean() - 0.25) < 0.05


def test_random_bits_are_uniform_and_differ_by_seed():
    bits = np.asarray(random_bits(jnp.array([0, 0], jnp.uint32), (1 << 16,)))
    assert len(np.unique(bits)) > 0.99 * bits.size
    for shift in (0, 8, 16, 24):
        byte = (bits >> shift) & 0xFF
        counts = np.bincount(byte, minlength=256)
        expected = bits.size / 256
        assert ((counts - expected) ** 2 / expected).sum() < 400  # chi-square, 255 dof: mean 255, sd 23
    other = np.asarray(random_bits(jnp.array([0, 1], jnp.uint32), (1 << 16,)))
    assert (bits == other).mean() < 0.001
    # The same bits whatever the array's shape: they number its elements in order.
    reshaped = np.asarray(random_bits(jnp.array([0, 0], jnp.uint32), (256, 256)))
    np.testing.assert_array_equal(reshaped.reshape(-1), bits)


def test_random_bits_are_uncorrelated_between_elements_and_streams():
    # What rounding reads (the top 16 bits, and the top bit alone: the
    # decision at a fraction of one half) is uncorrelated between
    # neighbours, between rows of a matrix, and between the streams of two
    # leaves (seeds from jax.random, as the transformation draws them):
    # correlations within six standard deviations of zero.
    n = 1 << 18
    seeds = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(0), 3)))
    streams = [np.asarray(random_bits(jnp.asarray(seed), (n,))) for seed in seeds]
    limit = 6 / np.sqrt(n)
    for bits in streams:
        top16, top1 = (bits >> 16).astype(np.float64), (bits >> 31).astype(np.float64)
        for lag in (1, 2, 512, 4096):
            for top in (top16, top1):
                assert abs(np.corrcoef(top[:-lag], top[lag:])[0, 1]) < limit, lag
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        for shift in (16, 31):
            x, y = (streams[a] >> shift).astype(np.float64), (streams[b] >> shift).astype(np.float64)
            assert abs(np.corrcoef(x, y)[0, 1]) < limit, (a, b, shift)


# ---------------------------------------------------------------------------
# Exactness through optax.apply_updates
# ---------------------------------------------------------------------------


def random_case(dtype, n, seed):
    """Parameters over the dtype's normal range, and updates from 2**-40 to
    2**40 times them (new values many binades above the old), a third of
    them cancelling the parameter almost exactly (new values many binades
    below the old)."""
    rng = np.random.default_rng(seed)
    low, high = (-14, 15) if dtype == F16 else (-60, 60)
    p = rng.uniform(1, 2, n) * 2.0 ** rng.integers(low, high, n) * rng.choice([-1, 1], n)
    p = jnp.asarray(p, F32).astype(dtype)
    p32 = np.asarray(p, np.float32)
    delta = p32 * 2.0 ** rng.uniform(-40, 40, n) * rng.choice([-1, 1], n)
    cancel = rng.random(n) < 1 / 3
    near = -p32 * (1 + 2.0 ** rng.uniform(-40, 0, n) * rng.choice([-1, 1], n))
    delta = np.where(cancel, near, delta).astype(np.float32)
    with np.errstate(over="ignore"):
        delta = np.where(np.isfinite(delta), delta, 0).astype(np.float32)
        finite = np.isfinite(np.asarray(jnp.asarray(p32 + delta).astype(dtype), np.float32))
    return p[finite], jnp.asarray(delta[finite])


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_apply_updates_gives_the_rounded_parameter_exactly(rounding, dtype):
    p, delta = random_case(dtype, 200_000, seed=2)
    tx = ls.low_precision(optax.sgd(1.0), rounding)
    updates, _ = jax.jit(tx.update)(-delta, tx.init(p), p)
    assert updates.dtype == F32
    p32 = np.asarray(p, np.float32)
    total = p32 + np.asarray(updates)  # what apply_updates adds, in float32
    applied = np.asarray(optax.apply_updates(p, updates), np.float32)
    # The float32 sum is the new parameter, or (where the update is many
    # binades above the parameter, and no float32 update lands on it) one
    # float32 unit from it; within a few binades of p or below it, exactly.
    off = total != applied
    assert np.all(np.abs(total - applied)[off] <= np.spacing(np.abs(applied[off])))
    assert np.all(np.abs(applied[off]) > 2.0**15 * np.abs(p32[off]))
    x = p32 + np.asarray(delta)
    nearest = np.asarray(jnp.asarray(x).astype(dtype), np.float32)
    if rounding == "stochastic":
        toward_x = jnp.asarray(np.where(x > nearest, np.inf, -np.inf), dtype)
        other = np.asarray(jnp.nextafter(jnp.asarray(nearest, dtype), toward_x), np.float32)
        assert np.all((applied == nearest) | ((applied == other) & (x != nearest)))
    else:  # kahan from a zero compensation, and nearest: x rounded to nearest
        np.testing.assert_array_equal(applied, nearest)


def test_nearest_equals_optax_alone():
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64,)), BF16)}
    grads = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(64,)) * 1e-3, F32)}
    ours, _ = run_steps(ls.low_precision(optax.sgd(0.5), "nearest"), params, grads, 50)
    theirs, _ = run_steps(optax.sgd(0.5), params, grads, 50)
    assert_trees_bitwise(ours, theirs)


# ---------------------------------------------------------------------------
# float32 leaves, state dtypes, moments
# ---------------------------------------------------------------------------


def mixed_params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 4)), BF16),
        "h": jnp.asarray(rng.normal(size=(4,)), F16),
        "ln": jnp.ones(4, F32),  # the same shape as h: its moments must not be taken for h's
        "b": jnp.asarray(rng.normal(size=(8, 4)), F32),
    }


def grads_for(step, params):
    rng = np.random.default_rng(100 + step)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.1, p.dtype), params)


def train(tx, params, steps=20):
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for i in range(steps):
        params, state = step(params, state, grads_for(i, params))
    return params, state


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_float32_leaves_and_their_state_are_the_inner_optimizers(rounding, state_dtype):
    params = mixed_params()
    inner = optax.adamw(1e-2, weight_decay=0.1)
    ours, state = train(ls.low_precision(inner, rounding, state_dtype=state_dtype), params)
    theirs, inner_state = train(inner, params)
    for name in ("ln", "b"):
        assert_trees_bitwise(ours[name], theirs[name], what=name)
        for field in ("mu", "nu"):
            mine, bare = (optax.tree_utils.tree_get(s, field)[name] for s in (state, inner_state))
            assert_trees_bitwise(mine, bare, what=f"{field}[{name}]")
    assert_trees_bitwise(optax.tree_utils.tree_get(state, "count"), optax.tree_utils.tree_get(inner_state, "count"))
    expected = {"w": BF16, "h": F16} if rounding == "kahan" else {}
    assert {k: v.dtype for k, v in state.compensation.items() if v is not None} == expected
    assert state.compensation["ln"] is None and state.compensation["b"] is None
    # The half leaves moved (and differ from the bare optimizer's half-precision arithmetic).
    assert not np.array_equal(np.asarray(ours["w"], np.float32), np.asarray(params["w"], np.float32))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_state_dtypes_are_kept_step_after_step(rounding):
    params = mixed_params()
    # None: the dtypes inner.init gives (adam: the params'; mu_dtype=float32: float32).
    for inner, mu in [
        (optax.adam(1e-2), {"w": BF16, "h": F16}),
        (optax.adam(1e-2, mu_dtype=F32), {"w": F32, "h": F32}),
    ]:
        tx = ls.low_precision(inner, rounding)
        before = jax.tree.map(lambda x: x.dtype, tx.init(params))
        _, state = train(tx, params, steps=3)
        assert jax.tree.map(lambda x: x.dtype, state) == before
        assert {k: optax.tree_utils.tree_get(state, "mu")[k].dtype for k in mu} == mu
    # Given: the half params' moments in it, the others as they were.
    tx = ls.low_precision(optax.adam(1e-2), rounding, state_dtype=jnp.bfloat16)
    _, state = train(tx, params, steps=3)
    for field in ("mu", "nu"):
        dtypes = {k: v.dtype for k, v in optax.tree_utils.tree_get(state, field).items()}
        assert dtypes == {"w": BF16, "h": BF16, "ln": F32, "b": F32}
    assert isinstance(state.inner_state[0], optax.ScaleByAdamState)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_second_moments_stored_in_bfloat16_decay(rounding):
    # nu warmed up with gradients of 1, then zero gradients: 0.999 * nu rounds
    # back to nu in bfloat16 to nearest; stochastically it decays as in float32.
    tx = ls.low_precision(optax.adam(1e-3, b2=0.999), rounding, state_dtype=jnp.bfloat16)
    params = jnp.zeros(2048, BF16)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(10):
        _, state = update(jnp.ones(2048, F32), state, params)
    warm = np.asarray(state.inner_state[0].nu, np.float64)

    @jax.jit
    def decay(state):
        def step(state, _):
            return update(jnp.zeros(2048, F32), state, params)[1], None

        return jax.lax.scan(step, state, length=1000)[0]

    nu = np.asarray(decay(state).inner_state[0].nu, np.float64)
    assert nu.dtype == np.float64 and state.inner_state[0].nu.dtype == BF16
    if rounding == "nearest":
        np.testing.assert_array_equal(nu, warm)
    else:
        np.testing.assert_allclose(nu.mean(), warm.mean() * 0.999**1000, rtol=0.01)


def test_moments_are_found_where_the_params_structure_is():
    params = mixed_params()
    tx = ls.low_precision(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(1e-2), optax.trace(0.9)),
        state_dtype=jnp.float32,
    )
    state = tx.init(params)
    # trace's momentum of the half params is upcast; adafactor's factored statistics are not params-shaped.
    trace = optax.tree_utils.tree_get(state, "trace")
    assert {k: v.dtype for k, v in trace.items()} == {"w": F32, "h": F32, "ln": F32, "b": F32}
    before = jax.tree.map(lambda x: x.dtype, state)
    _, after = train(tx, params, steps=2)
    assert jax.tree.map(lambda x: x.dtype, after) == before


@pytest.mark.parametrize("state_dtype", [BF16, F16])
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_moments_of_one_parameter_round_independently(rounding, state_dtype):
    # Three moments of one parameter, all equal to the gradient (two traces
    # and adam's mu with decays of 0), halfway between two neighbours in the
    # state's dtype: each rounds up half of the time, and any two agree half
    # of the time (each reads a random stream of its own), six standard
    # deviations of margin.
    n = 2**14
    tx = ls.low_precision(
        optax.chain(optax.trace(0.0), optax.trace(0.0), optax.scale_by_adam(b1=0.0)), rounding, state_dtype=state_dtype
    )
    params = jnp.ones(n, BF16)
    rng = np.random.default_rng(5)
    base = np.asarray(jnp.asarray(rng.uniform(1, 2, n) * rng.choice([-1, 1], n), state_dtype), np.float64)
    gap = 2.0 ** -{BF16: 7, F16: 10}[state_dtype]
    grads = jnp.asarray(base + np.sign(base) * gap / 2, F32)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    moments = [state.inner_state[0].trace, state.inner_state[1].trace, state.inner_state[2].mu]
    ups = [np.asarray(m, np.float64) != base for m in moments]
    sigma = 0.5 / np.sqrt(n)
    for up in ups:
        assert abs(up.mean() - 0.5) < 6 * sigma
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert abs((ups[a] == ups[b]).mean() - 0.5) < 6 * sigma, (a, b)


# ---------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------


def test_the_key_is_deterministic_advances_and_differs_per_leaf():
    params = {"a": jnp.ones(4096, BF16), "b": jnp.ones(4096, BF16)}
    grads = {"a": jnp.full(4096, -1e-3, F32), "b": jnp.full(4096, -1e-3, F32)}
    tx = ls.low_precision(optax.sgd(1.0), "stochastic", seed=5)
    state = tx.init(params)
    np.testing.assert_array_equal(np.asarray(state.key), np.asarray(jax.random.key_data(jax.random.PRNGKey(5))))
    assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
    first, state1 = jax.jit(tx.update)(grads, state, params)
    again, state1b = tx.update(grads, state, params)  # eagerly: the same bits
    assert_trees_bitwise((first, state1), (again, state1b))
    assert not np.array_equal(np.asarray(state1.key), np.asarray(state.key))
    # Two leaves with the same values round differently; so do two steps, and two seeds.
    assert not np.array_equal(np.asarray(first["a"]), np.asarray(first["b"]))
    second, _ = tx.update(grads, state1, params)
    assert not np.array_equal(np.asarray(first["a"]), np.asarray(second["a"]))
    other = ls.low_precision(optax.sgd(1.0), "stochastic", seed=6)
    assert not np.array_equal(np.asarray(other.update(grads, other.init(params), params)[0]["a"]), first["a"])
    # The same seed in a new transformation (a NumPy integer too): the same run.
    same = ls.low_precision(optax.sgd(1.0), "stochastic", seed=np.int64(5))
    assert_trees_bitwise(same.update(grads, same.init(params), params), (first, state1))


# ---------------------------------------------------------------------------
# Where it is found, what it warns about, what it refuses
# ---------------------------------------------------------------------------


def test_the_states_are_found_through_the_wrapper():
    params = mixed_params()
    tx = ls.dynamic(ls.low_precision(optax.adam(1e-3), state_dtype=jnp.bfloat16), initial_scale=8.0)
    state = tx.init(params)
    assert float(ls.get_scale(state)) == 8.0 and ls.find_state(state) is state
    assert isinstance(state.inner_state, ls.LowPrecisionState)
    assert optax.tree_utils.tree_get(state, "mu")["w"].dtype == BF16
    assert optax.tree_utils.tree_get(state, "compensation")["w"].dtype == BF16
    assert ls.metrics(state)["loss_scale/scale"] == 8.0


def test_float16_state_warning_skips_the_compensation_buffer():
    params = {"w": jnp.ones((4, 4), F16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls.dynamic(ls.low_precision(optax.adam(1e-3), state_dtype=jnp.bfloat16)).init(params)
        ls.dynamic(ls.low_precision(optax.sgd(1e-3))).init(params)  # a compensation buffer, no moment
    with pytest.warns(ls.Float16StateWarning) as caught:
        ls.dynamic(ls.low_precision(optax.adam(1e-3))).init(params)  # float16 moments: warned, the buffer not
    message = str(caught[0].message)
    assert "mu['w']" in message and "nu['w']" in message and "compensation" not in message
    assert "state_dtype=jnp.bfloat16" in message


def test_params_without_a_half_precision_leaf_are_warned_about():
    # The cast to bfloat16 forgotten: nothing would be rounded or saved.
    with pytest.warns(
        ls.FullPrecisionParamsWarning, match=r"no bfloat16 or float16 parameter \(the params are float32"
    ):
        ls.low_precision(optax.adam(1e-3)).init({"w": jnp.ones((4, 4)), "step": jnp.zeros((), jnp.int32)})
    with pytest.warns(ls.FullPrecisionParamsWarning, match="astype"):  # under ls.dynamic too
        ls.dynamic(ls.low_precision(optax.adam(1e-3))).init({"w": jnp.ones(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ls.low_precision(optax.adam(1e-3)).init({"w": jnp.ones(3, BF16), "gain": jnp.ones(3)})  # one is enough
        ls.low_precision(optax.adam(1e-3)).init({"count": jnp.zeros(3, jnp.int32)})  # nothing to update in float


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: ls.low_precision(optax.adam(1e-3), "round"), ValueError, "rounding must be one of .*'round'"),
        (lambda: ls.low_precision(optax.adam(1e-3), None), ValueError, "rounding must be one of"),
        (lambda: ls.low_precision(optax.adam(1e-3), state_dtype=jnp.int32), ValueError, "state_dtype .*int32"),
        (lambda: ls.low_precision(optax.adam(1e-3), state_dtype="floatx"), ValueError, "state_dtype .*floatx"),
        (lambda: ls.low_precision(optax.adam(1e-3), state_dtype=jnp.float8_e4m3fn), ValueError, "state_dtype"),
        (
            lambda: ls.low_precision(optax.adam),
            TypeError,
            r"inner must be an optax.GradientTransformation.*optax.adam\(1e-3\)",
        ),
        (lambda: ls.low_precision(3), TypeError, "inner must be an optax.GradientTransformation, got 3"),
        (lambda: ls.low_precision(ls.dynamic(optax.adam(1e-3))), ValueError, r"ls.dynamic\(ls.low_precision"),
        (lambda: ls.low_precision(optax.sgd(1.0), seed=1.5), TypeError, "seed must be an int, got 1.5"),
        (lambda: ls.low_precision(optax.sgd(1.0), seed=True), TypeError, "seed must be an int"),
        (lambda: ls.low_precision(optax.sgd(1.0), seed=2**70), ValueError, "seed must fit in 64 bits"),
        (lambda: ls.low_precision(optax.sgd(1.0), seed="0"), TypeError, "seed must be an int, got '0'"),
    ],
)
def test_bad_input_is_refused_at_construction(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_use_is_refused_with_what_to_do():
    params = {"w": jnp.ones(3, BF16)}
    tx = ls.low_precision(optax.sgd(1.0))
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(params, state)
    with pytest.raises(TypeError, match="LowPrecisionState made by this transformation's init"):
        tx.update(params, optax.sgd(1.0).init(params), params)
    stochastic_state = ls.low_precision(optax.sgd(1.0), "stochastic").init(params)
    with pytest.raises(ValueError, match=r"compensation for \['w'\] is None .*another rounding"):
        tx.update(params, stochastic_state, params)
    with pytest.raises(ValueError, match="does not have the params' structure"):
        tx.update({"v": params["w"]}, state, {"v": params["w"]})
    widened = {"w": params["w"].astype(F32)}  # what eqx.apply_updates makes of bfloat16 + a float32 update
    with pytest.raises(ValueError, match=r"\['w'\] is float32 but its compensation is bfloat16.*eqx.apply_updates"):
        tx.update(widened, state, widened)
    with pytest.raises(TypeError, match=r"parameter \['q'\] is float8_e4m3fn"):
        tx.init({"q": jnp.ones(2, jnp.float8_e4m3fn)})
    nested = ls.low_precision(optax.chain(optax.clip(1.0), ls.dynamic(optax.sgd(1.0))))
    with pytest.raises(ValueError, match="LossScaleState.*Wrap low_precision in it"):
        nested.init(params)

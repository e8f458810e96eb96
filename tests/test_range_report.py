"""``ls.range_report`` against brute force: ``max_safe_scale`` against a scan
over powers of two with ``jax.grad``, each reported cotangent against the
one ``jax.vjp`` gives for that stage of the model, and the first
overflowing value against the stage whose cotangent overflows first."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls

F16_MAX = float(jnp.finfo(jnp.float16).max)

# Float16 comparisons across programs: range_report's backward pass is one
# jitted program, the brute-force oracles here run eagerly (others). On CPUs
# with AVX512-FP16 their float16 bits may differ (DESIGN.md's trap), so
# values that are not exact powers of two are compared within float16
# rounding: F16_RTOL is 64 roundings of 2**-11 (a float16 sum over the
# batch of 64 in the worst case, plus tanh's few), far below the factor 2 of
# a wrong binade. Powers of two (a mean's cotangent scale / 2048 times
# powers of two) are exact in every program and compared exactly.
F16_RTOL = 64 * 2.0**-11


def assert_away_from_the_overflow_boundary(report):
    """No backward value decides ``max_safe_scale`` within rounding: each
    value's largest magnitude at ``max_safe_scale`` is either a power of two
    (exact in every program) or more than F16_RTOL away from float16's
    overflow there and at twice that scale. Any program within float16
    rounding of the report's (the brute force's) then finds the same safe
    scale, so equality is exact."""
    for r in report.rows:
        if r.dtype != "float16" or not math.isfinite(r.headroom):
            continue
        peak = F16_MAX / r.headroom  # at max_safe_scale
        if math.log2(peak).is_integer():
            continue
        for h in (r.headroom, r.headroom / 2):  # at max_safe_scale and twice it
            assert not 1 / (1 + F16_RTOL) <= h <= 1 / (1 - F16_RTOL), (r, h)


def stages(amplify):
    """A float16 model in three named stages; stage 2 multiplies by
    ``amplify``, so the cotangent of stage 1's output is ``amplify`` times
    that of stage 2's."""

    def stage1(w, x):
        with jax.named_scope("stage1"):
            return jnp.tanh(x @ w)

    def stage2(h):
        with jax.named_scope("stage2"):
            return h * jnp.float16(amplify)

    def stage3(z):
        with jax.named_scope("stage3"):
            return jnp.mean(z)

    return stage1, stage2, stage3


def inputs(seed=0):
    kw, kx = jax.random.split(jax.random.key(seed))
    w = (jax.random.normal(kw, (16, 32)) * 0.3).astype(jnp.float16)
    x = (jax.random.normal(kx, (64, 16)) * 0.01).astype(jnp.float16)
    return w, x


def brute_force_max_safe(loss_fn, w, x):
    """The largest 2**k whose gradient of ``loss * 2**k`` is finite."""
    safe = None
    for k in range(-10, 40):
        grad = jax.grad(lambda w, k=k: loss_fn(w, x).astype(jnp.float32) * 2.0**k)(w)
        if bool(jnp.all(jnp.isfinite(grad))):
            safe = 2.0**k
        else:
            break
    return safe


@pytest.mark.parametrize("amplify", [1.0, 64.0, 4096.0])
def test_max_safe_scale_equals_a_scan_over_powers_of_two(amplify):
    s1, s2, s3 = stages(amplify)
    loss_fn = lambda w, x: s3(s2(s1(w, x)))  # noqa: E731
    w, x = inputs()
    report = ls.range_report(loss_fn, w, x, scale=2.0**15)
    assert_away_from_the_overflow_boundary(report)
    assert report.max_safe_scale == brute_force_max_safe(loss_fn, w, x)


def test_zero_and_below_normal_fractions_count_each_element_by_its_dtype():
    # The cotangent of the float16 cast is m itself: 3 zeros and 2 float16
    # subnormals (normal in float32, where the argument's gradient is).
    m = jnp.asarray(np.array([0, 0, 2**-20, 1, 2**-16, 3, 0, 1], np.float16))
    report = ls.range_report(lambda w: jnp.sum((w.astype(jnp.float16) * m).astype(jnp.float32)), jnp.ones(8), scale=1.0)
    by_kind = {(row.primitive, row.dtype): row for row in report.rows[:2]}
    argument, cast = by_kind["argument", "float32"], by_kind["convert_element_type", "float16"]
    assert report.scale == 1.0 and cast.backward_max == argument.backward_max == 3.0
    assert (cast.backward_zero, cast.backward_below_normal) == (3 / 8, 5 / 8)
    assert (argument.backward_zero, argument.backward_below_normal) == (3 / 8, 3 / 8)


def test_each_cotangent_equals_jax_vjp_of_its_stage():
    s1, s2, s3 = stages(256.0)
    w, x = inputs(1)
    scale = 2.0**6
    report = ls.range_report(lambda w, x: s3(s2(s1(w, x))), w, x, scale=scale)
    h = s1(w, x)
    z = s2(h)
    _, vjp3 = jax.vjp(lambda z: s3(z).astype(jnp.float32) * scale, z)
    (ct_z,) = vjp3(jnp.float32(1.0))
    _, vjp2 = jax.vjp(s2, h)
    (ct_h,) = vjp2(ct_z)
    by_stage = {}
    for row in report.rows:
        for name in ("stage1", "stage2"):
            if name in row.where and row.shape == h.shape and row.dtype == "float16":
                by_stage[name] = row  # the stage's last value: its output
    for name, ct in (("stage1", ct_h), ("stage2", ct_z)):
        row, ct = by_stage[name], np.asarray(ct, np.float32)
        # scale / 2048 (the mean's) times 256: powers of two, exact in both programs.
        assert row.backward_max == np.abs(ct).max() == scale / 2048 * (256 if name == "stage1" else 1)
        assert row.backward_zero == pytest.approx(np.mean(ct == 0))
        tiny = float(jnp.finfo(jnp.float16).tiny)
        assert row.backward_below_normal == pytest.approx(np.mean(np.abs(ct) < tiny))
        assert not row.overflows
    # tanh of a 16-term float16 dot: equal within float16 rounding only.
    np.testing.assert_allclose(by_stage["stage1"].forward_max, float(jnp.max(jnp.abs(h))), rtol=F16_RTOL)


def test_the_first_overflowing_value_is_the_stage_that_overflows_first():
    s1, s2, s3 = stages(4096.0)
    w, x = inputs(2)
    loss_fn = lambda w, x: s3(s2(s1(w, x)))  # noqa: E731

    def first_nonfinite_exponent(stage):
        for k in range(0, 40):
            scale = 2.0**k
            h = s1(w, x)
            z = s2(h)
            (ct_z,) = jax.vjp(lambda z, scale=scale: s3(z).astype(jnp.float32) * scale, z)[1](jnp.float32(1.0))
            (ct_h,) = jax.vjp(s2, h)[1](ct_z)
            ct = {"stage1": ct_h, "stage2": ct_z}[stage]
            if not bool(jnp.all(jnp.isfinite(ct))):
                return k
        return None

    first = {stage: first_nonfinite_exponent(stage) for stage in ("stage1", "stage2")}
    assert first["stage1"] < first["stage2"]
    report = ls.range_report(loss_fn, w, x, scale=2.0 ** first["stage1"])
    # Exact: stage1's cotangent is 2**k / 2048 * 4096, a power of two, in every program.
    assert report.overflowing, str(report)
    assert "stage1" in report.overflowing[0].where and report.overflowing[0].primitive == "tanh"
    assert report.max_safe_scale == 2.0 ** (first["stage1"] - 1)
    assert not [r for r in report.rows if "stage2" in r.where and r.overflows]
    text = str(report)
    assert "OVERFLOW" in text and text.index("stage1") < text.index("stage2")


def test_jit_is_looked_into_and_custom_jvp_and_scan_are_whole_rows():
    @jax.jit
    def block(w, x):
        with jax.named_scope("inner"):
            return jnp.tanh(x @ w)

    def loss_fn(w, x):
        h = jax.nn.relu(block(w, x))  # relu is a custom_jvp function
        h, _ = jax.lax.scan(lambda c, _: (c * 0.5, None), h, None, length=3)
        return jnp.mean(h)

    w, x = inputs()
    report = ls.range_report(loss_fn, w, x, scale=1.0)
    primitives = [r.primitive for r in report.rows]
    assert "jit" in report.notes and "custom_jvp_call" in report.notes and "scan" in report.notes
    assert any("jit(block)/inner" in r.where and r.primitive == "tanh" for r in report.rows)
    assert primitives.count("scan") == 1 and primitives.count("custom_jvp_call") == 1
    assert report.rows[0].primitive == "argument" and report.rows[0].where == "args[0]"
    grad = jax.grad(lambda w: loss_fn(w, x).astype(jnp.float32))(w)
    # x.T @ (a float16 cotangent): a sum over the batch of 64, another
    # program than the report's: within float16 rounding.
    np.testing.assert_allclose(report.rows[0].backward_max, float(jnp.max(jnp.abs(grad))), rtol=F16_RTOL)


def test_flax_linen_rows_carry_module_names():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, dtype=jnp.float16, name="hidden")(x)
            return nn.Dense(1, dtype=jnp.float16, name="head")(nn.tanh(x))

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((2, 4)))
    loss_fn = lambda p, x: jnp.mean(model.apply(p, x))  # noqa: E731
    report = ls.range_report(loss_fn, params, jnp.ones((2, 4)), compute_dtype="float16")
    assert any("hidden" in r.where and r.primitive == "dot_general" for r in report.rows)
    assert any(r.where == "args[0]['params']['head']['kernel']" for r in report.rows)
    assert {r.dtype for r in report.rows if r.primitive == "dot_general"} == {"float16"}


def test_equinox_modules_with_non_array_leaves_work():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 1, 8, 2, key=jax.random.key(0))
    report = ls.range_report(lambda m, x: jnp.mean(jax.vmap(m)(x)), mlp, jnp.ones((3, 4)), compute_dtype="float16")
    assert any(r.where == "args[0].layers[0].weight" and r.dtype == "float16" for r in report.rows)
    assert report.max_safe_scale is not None


def test_has_aux_and_bad_input():
    w, x = inputs()
    report = ls.range_report(lambda w, x: (jnp.mean(x @ w), "aux"), w, x, has_aux=True)
    assert report.rows
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        ls.range_report(lambda w, x: jnp.mean(x @ w), w, x, scale=0.0)
    with pytest.raises(TypeError, match="floating scalar loss"):
        ls.range_report(lambda w, x: x @ w, w, x)
    with pytest.raises(TypeError, match=r"\(loss, aux\) pair"):
        ls.range_report(lambda w, x: jnp.mean(x @ w), w, x, has_aux=True)
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype"):
        ls.range_report(lambda w, x: jnp.mean(x @ w), w, x, compute_dtype="int32")


def test_a_nan_backward_at_every_scale_has_no_safe_scale():
    w, x = inputs()
    # sqrt of a negative: NaN forward, and a NaN derivative whatever the scale.
    report = ls.range_report(lambda w, x: jnp.mean(jnp.sqrt(x @ w - 10.0)), w, x, scale=1.0)
    assert report.max_safe_scale is None
    assert any(r.forward_max == np.inf or np.isnan(r.forward_max) for r in report.rows)

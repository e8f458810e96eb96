"""Only the values whose cotangent ``jax.grad`` forms are measured
(DESIGN.md's trap on probing intermediates): ``ls.value_grad_and_peak``
and ``ls.range_report`` against ``jax.grad`` on losses with data-only
values, ``stop_gradient``, auxiliary outputs, a ``while_loop`` and a
``pure_callback`` on data, a ``scan`` with a data-only carry, and under
outer ``vmap``/``jvp``/``grad``.

Float16 comparisons: the expected peaks here are exact powers of two (a
mean's cotangent ``scale / n`` with ``n`` a power of two, times powers of
two), which every program computes exactly, so equality is asserted;
gradients are compared within float16 rounding (see ``F16_CLOSE``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import loss_scale as ls
from tests._compare import assert_trees_close_to_largest

F16 = jnp.float16


def readme_loss(w, x):
    """The README's pattern: the data is cast to float16 too. ``x``'s cast
    has no cotangent in ``jax.grad`` (``x`` is not differentiated)."""
    pred = x.astype(F16) @ w.astype(F16)
    return jnp.mean(pred.astype(jnp.float32))


W, X = jnp.full((4, 1), 1000.0), jnp.full((8, 4), 1e-3)


def state_at(good_steps=0, scale=1.0):
    tx = ls.predictive(optax.sgd(0.0), initial_scale=1.0)
    state = tx.init(W)
    return state._replace(good_steps=jnp.int32(good_steps), scale=jnp.float32(scale))


# Gradients are compared within 16 float16 roundings (2**-11 each) of each
# leaf's largest magnitude (at least float16's smallest normal): the two sides
# are different programs, whose float16 bits may differ (AVX512-FP16 CPUs
# differ eagerly and under jit, and across fusions), by a few roundings of the
# forward chain and of the gradients' float16 sums. A wrong binade (a factor 2)
# is far outside.
F16_CLOSE = {"rtol": 16 * 2.0**-11, "floor": float(np.finfo(np.float16).tiny)}


def brute_force_max_safe(loss_fn, *args):
    """The largest 2**k at which ``jax.grad`` of ``loss * 2**k`` with
    respect to the first argument is finite."""
    safe = None
    for k in range(-10, 40):
        grad = jax.grad(lambda a, k=k: loss_fn(a, *args[1:]).astype(jnp.float32) * 2.0**k)(args[0])
        if not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grad)):
            break
        safe = 2.0**k
    return safe


# --- data-only values ---------------------------------------------------------------


def test_a_cast_of_the_data_is_not_measured(jit):
    # jax.grad forms the cotangents of pred (1/8 at scale 1) and of w's cast
    # (x.T @ 1/8 = 1e-3); x's cast would get w * 1/8 = 125, which jax.grad
    # never forms (before, the peak was 125 and range_report's 2**9).
    _, grads, peak = jit(ls.value_grad_and_peak(readme_loss))(state_at(), W, X)
    assert float(peak) == 0.125  # 1 / 8: exact in every program
    # At 2**18 the true peak is 2**15, finite, as jax.grad says.
    _, _, peak = jit(ls.value_grad_and_peak(readme_loss))(state_at(scale=2.0**18), W, X)
    assert float(peak) == 2.0**15
    assert bool(jnp.all(jnp.isfinite(jax.grad(lambda w: readme_loss(w, X) * 2.0**18)(W))))


def test_range_report_has_no_row_for_the_data_and_its_safe_scale_is_jax_grads():
    report = ls.range_report(readme_loss, W, X)
    # pred's cotangent is scale / 8: 2**18 / 8 = 2**15 is finite, 2**19 / 8
    # overflows; away from float16's rounding boundary, so exact.
    assert report.max_safe_scale == brute_force_max_safe(readme_loss, W, X) == 2.0**18
    assert not [r for r in report.rows if r.shape == (8, 4)], str(report)
    assert not report.overflowing
    assert sorted((r.primitive, r.shape) for r in report.rows if r.dtype == "float16") == [
        ("convert_element_type", (4, 1)),
        ("dot_general", (8, 1)),
    ]


def loop_and_callback_loss(w, x):
    """A while_loop and a pure_callback on the data only: jax.grad
    differentiates neither."""
    _, x = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))
    x = jax.pure_callback(
        lambda a: np.asarray(a) * 0.5, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
    )
    return readme_loss(w, x)


@pytest.mark.parametrize("good_steps", [0, 1])  # measuring, not measuring
def test_a_data_only_while_loop_and_pure_callback_work_as_under_jax_grad(jit, good_steps):
    state = state_at(good_steps)
    loss, grads, peak = jit(ls.value_grad_and_peak(loop_and_callback_loss, every=2))(state, W, X)
    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda w: loop_and_callback_loss(w, X)))(W)
    assert_trees_close_to_largest((loss, grads), (want_loss, want_grads), **F16_CLOSE)
    assert float(peak) == (0.125 if good_steps == 0 else 0.0)


def test_range_report_of_a_data_only_while_loop_and_pure_callback():
    report = ls.range_report(loop_and_callback_loss, W, X)
    assert report.max_safe_scale == brute_force_max_safe(loop_and_callback_loss, W, X) == 2.0**18
    assert not [r for r in report.rows if r.primitive == "while" or r.shape == (8, 4)], str(report)


# --- values that do not reach the loss -------------------------------------------------


def stopped_loss(w, x):
    """``h``'s cotangent is 1/8; jax.grad forms none for ``stop_gradient(h)``
    and ``stop_gradient(h) * 4096``, which would be 4096/8 and 1/8."""
    h = x.astype(F16) @ w.astype(F16)
    big = lax.stop_gradient(h) * F16(4096)
    return jnp.mean(h.astype(jnp.float32)) + jnp.mean(big.astype(jnp.float32))


def test_stop_gradient_values_are_not_measured(jit):
    _, _, peak = jit(ls.value_grad_and_peak(stopped_loss))(state_at(), W, X)
    assert float(peak) == 0.125
    report = ls.range_report(stopped_loss, W, X)
    assert not [r for r in report.rows if r.primitive in ("stop_gradient", "mul")], str(report)
    assert report.max_safe_scale == brute_force_max_safe(stopped_loss, W, X) == 2.0**18


@pytest.mark.parametrize("as_list", [False, True])
def test_aux_only_values_are_not_reported_and_a_list_pair_is_accepted(as_list):
    def loss_fn(w, x):
        h = x.astype(F16) @ w.astype(F16)
        aux = jnp.tanh(h) * F16(4096)  # depends on w, read only by the aux output
        out = (jnp.mean(h.astype(jnp.float32)), {"aux": aux})
        return list(out) if as_list else out

    report = ls.range_report(loss_fn, W, X, has_aux=True)
    assert not [r for r in report.rows if r.primitive in ("tanh", "mul")], str(report)
    assert report.max_safe_scale == 2.0**18
    _, grads, peak = ls.value_grad_and_peak(loss_fn, has_aux=True)(state_at(), W, X)
    assert float(peak) == 0.125


# --- scan with a parameter-dependent and a data-only carry -------------------------------


def scan_loss(w, x):
    """Carry ``a`` depends on ``w``; ``b`` (the data, doubled each step) does
    not, yet the loss reads ``b * 4096``; carry ``c`` depends on ``w`` but
    the loss does not read it."""

    def body(carry, _):
        a, b, c = carry
        return (a * F16(0.5), b * F16(2), c * F16(1024)), None

    a0 = x.astype(F16) @ w.astype(F16)
    (a, b, c), _ = lax.scan(body, (a0, x.astype(F16), a0), None, length=3)
    del c
    return jnp.mean(a.astype(jnp.float32)) + jnp.mean((b * F16(4096)).astype(jnp.float32))


def test_a_scans_data_only_and_unread_carries_are_not_measured(jit):
    # The cotangent of a is 1/8 and of a0 1/64; b's scan output and b * 4096
    # (cotangents 4096/32 and 1/32) are data; c is never read.
    _, grads, peak = jit(ls.value_grad_and_peak(scan_loss))(state_at(), W, X)
    assert float(peak) == 0.125
    assert_trees_close_to_largest(grads, jax.jit(jax.grad(scan_loss))(W, X), **F16_CLOSE)
    report = ls.range_report(scan_loss, W, X)
    scans = [r for r in report.rows if r.primitive == "scan"]
    assert [r.shape for r in scans] == [(8, 1)] and scans[0].backward_max == 2.0**15 / 8, str(report)
    assert report.max_safe_scale == brute_force_max_safe(scan_loss, W, X) == 2.0**18


# --- outer transformations ------------------------------------------------------------------


def test_under_an_outer_vmap_jvp_and_grad():
    state = state_at()
    fn = ls.value_grad_and_peak(loop_and_callback_loss)
    # vmap over the data: each example's peak is that of the one-example run.
    xs = jnp.stack([X, 2 * X])
    _, grads, peaks = jax.jit(jax.vmap(fn, in_axes=(None, None, 0)))(state, W, xs)
    np.testing.assert_array_equal(peaks, [0.125, 0.125])
    for i in range(2):
        assert_trees_close_to_largest(
            grads[i], jax.grad(lambda w, i=i: loop_and_callback_loss(w, xs[i]))(W), **F16_CLOSE
        )

    # jvp with respect to the data (x's cast is an outer JVP tracer here).
    def of_x(x):
        _, grads, peak = ls.value_grad_and_peak(readme_loss)(state, W, x)
        return grads, peak

    (grads, peak), (grads_dot, peak_dot) = jax.jvp(of_x, (X,), (jnp.ones_like(X),))
    want, want_dot = jax.jvp(lambda x: jax.grad(readme_loss)(W, x), (X,), (jnp.ones_like(X),))
    assert float(peak) == 0.125 and float(peak_dot) == 0.0
    assert_trees_close_to_largest((grads, grads_dot), (want, want_dot), **F16_CLOSE)

    # grad of the loss it returns, with respect to the parameters.
    def loss_and_peak(w):
        loss, _, peak = ls.value_grad_and_peak(readme_loss)(state, w, X)
        return loss, peak

    g, peak = jax.grad(loss_and_peak, has_aux=True)(W)
    assert float(peak) == 0.125
    assert_trees_close_to_largest(g, jax.grad(readme_loss)(W, X), **F16_CLOSE)


def test_range_report_under_a_transformation_is_refused():
    with pytest.raises(TypeError, match="range_report runs eagerly"):
        jax.jit(lambda w: ls.range_report(readme_loss, w, X).max_safe_scale)(W)
    with pytest.raises(TypeError, match="range_report runs eagerly"):
        jax.vmap(lambda x: ls.range_report(readme_loss, W, x).max_safe_scale)(jnp.stack([X, X]))


def test_the_path_analysis_uses_the_linearization_trace_of_this_jax():
    # The internals on_paths relies on (Tracer._trace, partial_eval.dce_jaxpr)
    # exist: without them every value would count (the old behaviour).
    from loss_scale._probe import on_paths

    leaves = [W, X]
    closed = jax.make_jaxpr(lambda w, x: stopped_loss(w, x))(*leaves)
    paths = on_paths(closed, leaves, [True, False])
    assert len(paths.candidates) > len(paths.sites) > 0
    assert {s.primitive for s in paths.sites} >= {"dot_general", "convert_element_type"}
    assert not {"stop_gradient", "mul"} & {s.primitive for s in paths.sites}

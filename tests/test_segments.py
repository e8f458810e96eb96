"""Per-segment loss scaling (``ls.segment`` and ``ls.predictive(...,
segments=...)``): gradients against float32 oracles where one global scale
flushes a segment to zero, the rule that sets the boundaries' exponents,
skipped steps, metrics, and the errors for boundaries it cannot apply."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from tests import _segment_models as models

FLOAT16_ROUNDING = 1e-2  # relative to the gradient's largest element


def train(tx, loss_fn, params, batch, steps, every=1):
    """``steps`` measuring steps of ``tx`` (learning rate 0: the same
    gradients each step), and the state and unscaled gradients after them."""
    state = tx.init(params)
    step = jax.jit(lambda state, params, batch: ls.value_grad_and_peak(loss_fn, every=every)(state, params, batch))
    for _ in range(steps):
        _, grads, peaks = step(state, params, batch)
        _, state = tx.update(grads, state, params, backward_peak=peaks)
    _, grads, peaks = step(state, params, batch)
    return state, ls.unscale(grads, state), peaks


def test_the_marker_is_the_identity_under_jax_grad():
    params, x = models.chain_params(), models.chain_batch()
    marked = jax.jit(jax.grad(lambda p: models.chain_loss(p, x, marked=True)))(params)
    plain = jax.jit(jax.grad(lambda p: models.chain_loss(p, x, marked=False)))(params)
    for name in params:
        np.testing.assert_array_equal(marked[name], plain[name])


def test_markers_change_nothing_for_an_optimizer_without_segments():
    params, x = models.chain_params(), models.chain_batch()
    runs = []
    for marked in (True, False):
        tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**10)
        state, p = tx.init(params), params

        @jax.jit
        def step(state, p, marked=marked, tx=tx):
            _, grads = ls.value_and_grad(lambda p: models.chain_loss(p, x, marked=marked))(state, p)
            return ls.apply_gradients(tx, grads, state, p)

        for _ in range(3):
            p, state = step(state, p)
        runs.append((p, state))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_segments_without_markers_train_exactly_as_predictive():
    params, x = models.chain_params(), models.chain_batch()

    def loss_fn(p, x):
        return models.chain_loss(p, x, marked=False)

    runs = []
    for segments in (None, ("a", "b")):
        tx = ls.predictive(optax.adam(1e-2), initial_scale=1.0, segments=segments)
        state, p = tx.init(params), params

        @jax.jit
        def step(state, p, tx=tx):
            _, grads, peak = ls.value_grad_and_peak(loss_fn, every=2)(state, p, x)
            updates, state = tx.update(grads, state, p, backward_peak=peak)
            return optax.apply_updates(p, updates), state

        scales = []
        for _ in range(5):
            p, state = step(state, p)
            scales.append(float(state.scale))
        runs.append((scales, p, state.counters.headroom))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(jax.tree.leaves(runs[0][1:]), jax.tree.leaves(runs[1][1:]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_per_segment_gradients_match_the_float32_oracle_where_one_scale_flushes():
    params, x = models.chain_params(), models.chain_batch()
    oracle = jax.grad(lambda p: models.chain_loss(p, x, jnp.float32, marked=False))(params)
    one = ls.predictive(optax.sgd(0.0), initial_scale=1.0)
    _, one_scale, _ = train(one, lambda p, x: models.chain_loss(p, x, marked=False), params, x, 4)
    state, per_segment, _ = train(
        ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=models.CHAIN_SEGMENTS),
        models.chain_loss,
        params,
        x,
        4,
    )
    # One scale: the first layer's cotangents are ~45 binades below the head's.
    assert models.relative_error(one_scale["layer0"], oracle["layer0"]) == 1.0  # flushed to zero
    for name in params:
        assert models.relative_error(per_segment[name], oracle[name]) < FLOAT16_ROUNDING, name
    assert int(state.counters.segment_exponents["layer0"]) > 0


def test_a_boundary_in_a_scan_body_compounds_step_by_step():
    params, tokens = models.rnn_params(), models.rnn_tokens()
    oracle = jax.grad(lambda p: models.rnn_loss(p, tokens, jnp.float32, marked=False))(params)
    first = models.FIRST_CHUNK_TOKENS
    _, one_scale, _ = train(
        ls.predictive(optax.sgd(0.0), initial_scale=1.0),
        lambda p, t: models.rnn_loss(p, t, marked=False),
        params,
        tokens,
        4,
    )
    state, per_segment, peaks = train(
        ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=("time",)), models.rnn_loss, params, tokens, 4
    )
    # One key per chunk further back than the last.
    assert sorted(peaks.keys) == [(k,) for k in range(models.CHUNKS)]
    # The first chunk's tokens: their embedding rows learn from the first chunk only.
    assert models.relative_error(one_scale["embed"][first], oracle["embed"][first]) == 1.0
    assert models.relative_error(per_segment["embed"][first], oracle["embed"][first]) < FLOAT16_ROUNDING
    for name in params:
        assert models.relative_error(per_segment[name], oracle[name]) < FLOAT16_ROUNDING, name
    assert int(state.counters.segment_exponents["time"]) > 0


def test_every_segment_sits_below_the_threshold_with_nothing_flushed():
    params, x = models.chain_params(), models.chain_batch()
    tx = ls.predictive(optax.sgd(0.0), initial_scale=1.0, min_headroom=1, segments=models.CHAIN_SEGMENTS)
    state, _, peaks = train(tx, models.chain_loss, params, x, 4)
    assert int(state.skipped_steps) == 0
    peak = np.asarray(peaks.peak)
    assert np.all(peak > 0) and np.all(peak <= 65504 / 2)  # min_headroom: one binade below float16's maximum
    table = state.counters.segments
    for name, zeros, below in zip(table.segments, table.zero_fraction, table.below_normal_fraction, strict=True):
        assert float(zeros) == 0.0 and float(below) < 0.01, name
    # The same run with one scale flushes most of the first layers' cotangents.
    one = ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=models.CHAIN_SEGMENTS)
    state = one.init(params)
    _, _, peaks = ls.value_grad_and_peak(models.chain_loss, every=1)(state, params, x)  # exponents 0: one scale
    flushed = np.asarray(peaks.below_normal) / np.asarray(peaks.count)
    assert flushed.max() > 0.5


def test_an_overflow_is_skipped_and_keeps_everything():
    params, x = models.chain_params(), models.chain_batch()
    tx = ls.predictive(optax.adam(1e-2), initial_scale=1.0, segments=models.CHAIN_SEGMENTS)
    state = tx.init(params)
    step = jax.jit(lambda s, p, x: ls.value_grad_and_peak(models.chain_loss, every=1)(s, p, x))
    for _ in range(3):
        _, grads, peaks = step(state, params, x)
        updates, state = tx.update(grads, state, params, backward_peak=peaks)
        params = optax.apply_updates(params, updates)
    before = (params, state.inner_state, state.counters.segment_exponents)
    _, grads, peaks = step(state, params, x.at[0, 0].set(jnp.inf))
    updates, after = tx.update(grads, state, params, backward_peak=peaks)
    assert bool(after.skipped)
    assert all(float(jnp.max(jnp.abs(u))) == 0 for u in jax.tree.leaves(updates))
    kept = (params, after.inner_state, after.counters.segment_exponents)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(after.scale) < float(state.scale)
    assert int(after.good_steps) == 0  # the next step measures


def test_metrics_report_each_segment():
    params, x = models.chain_params(), models.chain_batch()
    tx = ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=models.CHAIN_SEGMENTS)
    state, _, _ = train(tx, models.chain_loss, params, x, 2)
    metrics = ls.metrics(state)
    for name in models.CHAIN_SEGMENTS:
        assert int(metrics[f"loss_scale/segment/{name}/exponent"]) == int(state.counters.segment_exponents[name])
    for name in (*models.CHAIN_SEGMENTS, "loss"):
        for key in ("peak", "zero_fraction", "below_normal_fraction"):
            assert metrics[f"loss_scale/segment/{name}/{key}"].shape == ()
    assert float(metrics["loss_scale/segment/layer0/peak"]) < float(metrics["loss_scale/segment/layer4/peak"])


def test_value_and_grad_applies_the_factors_without_measuring():
    params, x = models.chain_params(), models.chain_batch()
    tx = ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=models.CHAIN_SEGMENTS)
    state, measured, _ = train(tx, models.chain_loss, params, x, 3)
    _, grads = jax.jit(ls.value_and_grad(models.chain_loss))(state, params, x)
    for name in params:
        np.testing.assert_array_equal(ls.unscale(grads, state)[name], measured[name])


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "segments, error, match",
    [
        ("embed", TypeError, "sequence of segment names"),
        ((), ValueError, "at least one"),
        (("a", "a"), ValueError, "more than once"),
        (("loss",), ValueError, "holds the loss"),
        (("a/b",), ValueError, "may not contain"),
        (("",), TypeError, "non-empty string"),
    ],
)
def test_bad_segment_names_are_refused_at_construction(segments, error, match):
    with pytest.raises(error, match=match):
        ls.predictive(optax.sgd(0.1), segments=segments)


def test_a_bad_marker_name_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="holds the loss"):
        ls.segment(jnp.ones(2), "loss")


def state_of(*segments):
    tx = ls.predictive(optax.sgd(0.1), segments=segments)
    return tx.init({"w": jnp.ones((2, 2))})


def test_an_undeclared_boundary_is_named():
    def loss_fn(p):
        return jnp.sum(ls.segment(p["w"] * 2, "decoder"))

    with pytest.raises(ValueError, match="'decoder' that is not one of the optimizer's segments"):
        ls.value_and_grad(loss_fn)(state_of("encoder"), {"w": jnp.ones((2, 2))})


def test_a_float16_parameter_used_in_two_segments_is_refused():
    def loss_fn(p):
        w = p["w"]  # float16 itself: its gradient cannot hold two scales
        h = ls.segment(jnp.tanh(w * 2), "a")
        return jnp.sum((h * w).astype(jnp.float32))

    params = {"w": jnp.ones((2, 2), jnp.float16)}
    state = ls.predictive(optax.sgd(0.1), segments=("a",)).init(params)
    with pytest.raises(
        ValueError, match="parameter of dtype float16 .* is used in segment a.*Keep parameters in float32"
    ):
        ls.value_and_grad(loss_fn)(state, params)


def test_a_float16_parameter_of_the_loss_segment_is_measured_in_the_loss_part():
    # The head's float16 gradient is the loss part's largest cotangent
    # (h is large, the head small), and its first row is exactly 0 (h's
    # first column is): both count in the loss part's statistics.
    def loss_fn(p, x):
        h = ls.segment(x.astype(jnp.float16) @ p["embed"].astype(jnp.float16), "embed")
        return jnp.sum((h @ p["head"]).astype(jnp.float32))

    embed = np.full((4, 3), 25.0, np.float32)
    embed[:, 0] = 0.0
    params = {"embed": jnp.asarray(embed), "head": jnp.full((3, 2), 2.0**-4, jnp.float16)}
    x = jnp.ones((5, 4))
    state = ls.predictive(optax.sgd(0.1), initial_scale=1.0, segments=("embed",)).init(params)
    _, grads, peaks = ls.value_grad_and_peak(loss_fn, every=1)(state, params, x)
    assert grads["head"].dtype == jnp.float16
    loss_part = peaks.keys.index((0,))
    assert float(peaks.peak[loss_part]) == float(jnp.max(jnp.abs(grads["head"]))) == 500.0
    assert float(peaks.zeros[loss_part]) == 2.0  # the head gradient's first row
    assert float(peaks.count[loss_part]) >= grads["head"].size


def test_a_float32_parameter_used_in_two_segments_gets_its_gradient_at_one_scale():
    def loss_fn(p, dtype=jnp.float16, marked=True):
        w = p["w"].astype(dtype)
        h = jnp.tanh(w * 2)
        if marked:
            h = ls.segment(h, "a")
        return jnp.sum((h * w).astype(jnp.float32))

    params = {"w": jnp.full((2, 2), 0.5)}
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0, segments=("a",))
    state = tx.init(params)
    state = models.with_exponents(state, a=5)
    _, grads = ls.value_and_grad(loss_fn)(state, params)
    oracle = jax.grad(lambda p: loss_fn(p, jnp.float32, marked=False))(params)
    assert models.relative_error(ls.unscale(grads, state)["w"], oracle["w"]) < FLOAT16_ROUNDING


def test_a_boundary_inside_a_while_loop_is_refused():
    def loss_fn(p):
        def body(carry):
            i, h = carry
            return i + 1, ls.segment(jnp.tanh(h), "a")

        _, h = jax.lax.while_loop(lambda carry: carry[0] < jnp.sum(p["w"]), body, (0.0, p["w"]))
        return jnp.sum(h)

    with pytest.raises(ValueError, match="inside while"):
        ls.value_and_grad(loss_fn)(state_of("a"), {"w": jnp.ones((2, 2))})


def test_a_boundary_inside_a_custom_vjp_function_is_refused():
    @jax.custom_vjp
    def f(x):
        return ls.segment(jnp.tanh(x), "a")

    f.defvjp(lambda x: (f(x), x), lambda x, ct: (ct * (1 - jnp.tanh(x) ** 2),))
    with pytest.raises(ValueError, match="inside custom_vjp"):
        ls.value_and_grad(lambda p: jnp.sum(f(p["w"])))(state_of("a"), {"w": jnp.ones((2, 2))})


def test_per_step_inputs_whose_segment_changes_with_the_step_are_refused():
    def loss_fn(p):
        xs = jnp.tanh(p["w"]).astype(jnp.float16)  # per-step inputs computed outside the scan

        def body(h, x):
            h = ls.segment(h, "time")
            return jnp.tanh(h + x), None

        h, _ = jax.lax.scan(body, jnp.zeros((2,), jnp.float16), xs)
        return jnp.sum(h.astype(jnp.float32))

    with pytest.raises(ValueError, match="per-step input .* change from step to step"):
        ls.value_and_grad(loss_fn)(state_of("time"), {"w": jnp.ones((3, 2))})


def test_the_peaks_of_segments_are_refused_by_an_optimizer_without_them():
    params, x = models.chain_params(), models.chain_batch()
    segmented = ls.predictive(optax.sgd(0.1), segments=models.CHAIN_SEGMENTS)
    _, grads, peaks = ls.value_grad_and_peak(models.chain_loss)(segmented.init(params), params, x)
    plain = ls.predictive(optax.sgd(0.1))
    with pytest.raises(TypeError, match="peaks of an optimizer with segments"):
        plain.update(grads, plain.init(params), params, backward_peak=peaks)


def test_a_restored_state_with_other_segments_gets_a_clear_error():
    params = {"w": jnp.ones(2)}
    state = ls.predictive(optax.sgd(0.1), segments=("a",)).init(params)
    other = ls.predictive(optax.sgd(0.1), segments=("b",))
    with pytest.raises(ValueError, match="does not have this transformation's layout"):
        other.update(params, state, params)


def test_range_report_labels_rows_and_shows_each_segment_with_its_boundaries():
    params, x = models.chain_params(), models.chain_batch()
    tx = ls.predictive(optax.sgd(0.0), initial_scale=1.0, segments=models.CHAIN_SEGMENTS)
    state, _, _ = train(tx, models.chain_loss, params, x, 3)
    exponents = ls.find_state(state).segments.exponents()
    report = ls.range_report(models.chain_loss, params, x, scale=float(state.scale), segments=exponents)
    assert {row.segment for row in report.rows} == {"loss", *models.CHAIN_SEGMENTS}
    assert all(row.segment == "loss" for row in report.rows if row.primitive == "argument")
    # At one scale the first layer flushes; with its boundaries in force nothing does.
    first = [row for row in report.rows if row.segment == "layer0" and row.dtype == "float16"]
    assert max(row.backward_below_normal for row in first) > 0.5
    by_name = {row.name: row for row in report.segments}
    assert set(by_name) == {"loss", *models.CHAIN_SEGMENTS}
    for name, row in by_name.items():
        assert row.backward_zero == 0.0 and row.backward_below_normal < 0.01 and not row.overflows, name
        assert row.exponent == (0 if name == "loss" else int(exponents[name]))
    assert by_name["layer0"].scale > by_name["layer4"].scale
    assert "with the boundaries in force" in str(report)


def test_range_report_refuses_segments_without_boundaries():
    params, x = models.chain_params(), models.chain_batch()
    with pytest.raises(ValueError, match="no boundary"):
        ls.range_report(lambda p, x: models.chain_loss(p, x, marked=False), params, x, segments={"layer0": 1})
    with pytest.raises(TypeError, match="map each boundary's name"):
        ls.range_report(models.chain_loss, params, x, segments=["layer0"])


# -- the rule on measured peaks --------------------------------------------------

CHAIN = ("c0", "c1", "c2")  # the loss, then c2, then c1, then c0 going back
CHAIN_KEYS = ((0, 0, 0), (0, 0, 1), (0, 1, 1), (1, 1, 1))


def rule_and_state():
    from loss_scale._rules.segmented import SegmentedRule

    rule = SegmentedRule(initial_scale=2.0**10, min_headroom=1, segments=CHAIN)
    return rule, rule.init()


def peaks_of(values):
    from loss_scale._rules.segmented import SegmentPeaks

    zeros = jnp.zeros(len(CHAIN_KEYS))
    return SegmentPeaks(CHAIN_KEYS, CHAIN, jnp.asarray(values, jnp.float32), zeros, zeros, jnp.ones(len(CHAIN_KEYS)))


def test_the_rule_lifts_each_part_to_its_target():
    rule, state = rule_and_state()
    # Each boundary's part lies 10 binades below the one above it.
    unscaled = np.array([2.0**-5, 2.0**-15, 2.0**-25, 2.0**-35])
    history = []
    for _ in range(8):
        exponent = np.asarray(state.counters.segments.exponent, np.int64)
        powers = np.asarray(CHAIN_KEYS) @ exponent
        state = rule.adjust(
            state, jnp.array(True), jnp.float32(1e-3), peaks_of(unscaled * float(state.scale) * 2.0**powers)
        )
        history.append(list(np.asarray(state.counters.segments.exponent)))
    # c2 (nearest the loss) makes up its 10 binades less its parts' margin
    # (INITIAL_MARGIN, 2); c1 and c0 then make up 10 each. Starved parts
    # climb fast: one measurement gets there, and it holds.
    assert history[0] == history[-1] == [10, 10, 8]


def test_an_overflow_located_below_the_loss_lowers_the_boundary_above_it_and_not_the_global_scale():
    rule, state = rule_and_state()
    state = state._replace(
        counters=state.counters._replace(segments=state.counters.segments.replace(exponent=jnp.array([5, 5, 5])))
    )
    before = float(state.scale)
    # The loss's part and c2's are finite; c1's (and c0's below it) overflowed.
    after = rule.adjust(state, jnp.array(False), jnp.float32(jnp.inf), peaks_of([100.0, 100.0, jnp.inf, jnp.inf]))
    table = after.counters.segments
    assert list(np.asarray(table.exponent)) == [5, 5 - 4, 5]  # c1, the boundary nearest the loss that decides an inf
    assert list(np.asarray(table.margin)) == [2, 3, 2]
    assert float(after.scale) == before and int(after.counters.extra_headroom) == 0


def test_an_overflow_on_a_step_that_did_not_measure_teaches_every_boundary():
    rule, state = rule_and_state()
    after = rule.adjust(state, jnp.array(False), jnp.float32(jnp.inf), peaks_of([0.0, 0.0, 0.0, 0.0]))
    assert float(after.scale) < float(state.scale)  # the global scale backs off for the step
    assert int(after.counters.extra_headroom) == int(state.counters.extra_headroom)  # but learns nothing for good
    assert list(np.asarray(after.counters.segments.margin)) == [3, 3, 3]


def residual_params() -> dict:
    shapes = {"embed": (4, 8), "w1": (8, 8), "w2": (8, 8), "head": (8, 2)}
    return {name: jnp.full(shape, 0.1) for name, shape in shapes.items()}


def residual_loss(p, x, boundary="branch"):
    """A float16 residual block ``h + f(h)`` with its boundary inside the
    branch ``f`` (refused: ``h``'s two paths to the loss differ) or on the
    residual stream after the addition."""
    h = jnp.tanh(x.astype(jnp.float16) @ p["embed"].astype(jnp.float16))
    branch = jnp.tanh(h @ p["w1"].astype(jnp.float16))
    if boundary == "branch":
        branch = ls.segment(branch, "block")
    h = h + branch @ p["w2"].astype(jnp.float16)
    if boundary == "stream":
        h = ls.segment(h, "block")
    return jnp.mean((h @ p["head"].astype(jnp.float16)).astype(jnp.float32) ** 2)


def test_a_boundary_inside_a_residual_branch_says_to_put_it_on_the_residual_stream():
    params, x = residual_params(), jnp.ones((3, 4))
    state = ls.predictive(optax.sgd(0.1), segments=("block",)).init(params)
    with pytest.raises(ls.SegmentError) as error:
        ls.value_and_grad(residual_loss)(state, params, x)
    message = str(error.value)
    # The crossing value is the block's input, an activation: no advice about parameters.
    assert message.startswith("an activation (a value the loss function computes, not a parameter) of dtype float16")
    assert "(the loss's segment; block)" in message and "test_segments.py:" in message
    assert "on the residual stream, after the residual addition" in message
    assert "Keep parameters" not in message
    # Where the message says, the boundary works.
    loss, _ = ls.value_and_grad(lambda p, x: residual_loss(p, x, "stream"))(state, params, x)
    assert np.isfinite(float(loss))


def test_a_misspelt_boundary_is_reported_at_the_users_line_with_the_closest_name():
    params = {"w": jnp.ones((2, 2))}
    state = ls.predictive(optax.sgd(0.1), segments=("decoder", "encoder")).init(params)

    def loss_fn(p):
        return jnp.sum(ls.segment(jnp.tanh(p["w"]), "encodr"))  # the line the error points at

    line = loss_fn.__code__.co_firstlineno + 1
    for gradient in (ls.value_and_grad(loss_fn), jax.jit(ls.value_and_grad(loss_fn))):
        with pytest.raises(ls.SegmentError) as error:
            gradient(state, params)
        message = str(error.value)
        assert message.startswith(f"{__file__}:{line} (loss_fn): the loss function marks a boundary 'encodr'")
        assert "Did you mean 'encoder'? Otherwise add 'encodr' to the segments" in message, message
        assert "marker.py" not in message
        # The traceback ends at the ls.segment call, not inside the library.
        last = error.value.__traceback__
        while last.tb_next is not None:
            last = last.tb_next
        assert (last.tb_frame.f_code.co_filename, last.tb_lineno) == (__file__, line)


def test_segment_error_is_public_and_a_value_error():
    assert ls.SegmentError is ls._segments.SegmentError and issubclass(ls.SegmentError, ValueError)
    assert "SegmentError" in ls.__all__

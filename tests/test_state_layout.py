"""The state's layout: what the next step needs apart from what is recorded,
named skip reasons, counters that saturate, typed settings that agree with
the declared options."""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._options import OPTIONS, Options, settings_from
from loss_scale._saturating import increment
from loss_scale._settings import Settings

INT32_MAX = int(np.iinfo(np.int32).max)


def test_the_state_keeps_what_the_next_step_needs_apart_from_the_record():
    tx = ls.dynamic(optax.adam(1e-3), track_grad_norm=True)
    state = tx.init({"w": jnp.ones(3)})
    # Two fields: the loss-scale state's own values packed in one int32
    # array (one buffer, one kernel on a GPU), and the inner state.
    assert ls.LossScaleState._fields == ("packed", "inner_state")
    assert state.fields()._fields == ("scale", "good_steps", "counters", "record")
    leaves = jax.tree_util.tree_flatten_with_path(state._replace(inner_state=None))[0]
    assert [(jax.tree_util.keystr(path), leaf.dtype, leaf.shape) for path, leaf in leaves] == [
        (".packed.data", jnp.int32, (1 + 1 + 2 + 9 + 1,))  # scale, good steps, counters, record, grad_norm
    ]
    assert isinstance(state.record, ls.StepRecord)
    # The stable attributes read through to the record.
    _, state = tx.update({"w": jnp.array([1.0, jnp.inf, 2.0])}, state)
    assert bool(state.skipped) and bool(state.record.skipped)
    assert int(state.skipped_steps) == int(state.record.skipped_steps) == 1
    assert int(state.consecutive_skips) == int(state.record.consecutive_skips) == 1
    # Any field of the record or the counters reads as an attribute.
    assert float(state.grad_norm) == float(state.record.grad_norm) == np.inf
    assert int(state.overflows_left) == int(state.counters.overflows_left) == 0
    # optax's tree utilities find the inner state's fields by name.
    assert optax.tree_utils.tree_get(state, "count") is state.inner_state[0].count


def test_the_packed_values_are_written_by_name_and_keep_their_layout():
    tx = ls.dynamic(optax.adam(1e-3), track_grad_norm=True)
    state = tx.init({"w": jnp.ones(3)})
    moved = state._replace(scale=jnp.float32(2.0**-20), record=state.record._replace(skipped_steps=jnp.int32(7)))
    assert moved.packed.layout == state.packed.layout
    assert float(moved.scale) == 2.0**-20 and int(moved.skipped_steps) == 7
    assert int(moved.good_steps) == 0 and moved.inner_state is state.inner_state
    # Every value comes back bit for bit: floats, flags, int32's extremes.
    extremes = state.record._replace(grad_max=jnp.float32(-np.inf), grad_norm=jnp.float32(np.nan), growths=INT32_MAX)
    back = state._replace(record=extremes).record
    assert float(back.grad_max) == -np.inf and np.isnan(float(back.grad_norm)) and int(back.growths) == INT32_MAX
    with pytest.raises(ValueError, match="no field 'skipped_steps'"):
        state._replace(skipped_steps=1)
    with pytest.raises(ValueError, match="do not have the state's structure"):
        state._replace(counters=())
    # A batch of states (jax.vmap(tx.init)) reads and writes per state.
    states = jax.vmap(tx.init)({"w": jnp.ones((4, 3))})
    assert states.packed.data.shape == (4, 14) and states.scale.shape == (4,)
    states = states._replace(scale=jnp.arange(4, dtype=jnp.float32), good_steps=jnp.arange(4, dtype=jnp.int32))
    np.testing.assert_array_equal(states.scale, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(states.good_steps, [0, 1, 2, 3])
    np.testing.assert_array_equal(states.skipped_steps, [0, 0, 0, 0])


@pytest.mark.parametrize(
    "make,scale", [(lambda: ls.no_op(optax.sgd(0.1)), 1.0), (lambda: ls.static(optax.sgd(0.1), scale=8.0), 8.0)]
)
def test_a_fixed_scale_is_a_constant_of_the_layout(make, scale):
    """The scale of a static or no_op state is read as a constant, so a step
    that multiplies its loss by it reads no state at all; writing another is
    refused, and a state of a moving scale is not taken for one."""
    tx = make()
    state = tx.init(jnp.zeros(2))
    assert state.packed.layout.fixed_scale == scale and float(state.scale) == scale
    loss = lambda params: jnp.sum(params**2)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda s, p: ls.value_and_grad(loss)(s, p))(state, jnp.ones(2))
    assert jaxpr.jaxpr.invars[0].aval.shape == (13,)  # no grad_norm
    assert not any(jaxpr.jaxpr.invars[0] in eqn.invars for eqn in jaxpr.jaxpr.eqns)  # the state is not read
    with pytest.raises(ValueError, match=f"fixed at {scale}"):
        state._replace(scale=2.0)
    # A state that keeps its scale as a word may go on under a fixed scale
    # (it reads what the fixed rule writes there); a constant scale cannot
    # be taken over by a rule that moves it.
    dynamic = ls.dynamic(optax.sgd(0.1), initial_scale=4.0).init(jnp.zeros(2))
    updates, moved = tx.update(jnp.full(2, 4.0), dynamic)
    assert moved.packed.layout == dynamic.packed.layout
    np.testing.assert_allclose(updates, [-0.1, -0.1])  # unscaled by the state's own scale, 4
    with pytest.raises(ValueError, match=f"fixes its scale at {scale} and this one moves its scale"):
        ls.dynamic(optax.sgd(0.1)).update(jnp.ones(2), state)


def test_every_recorded_value_is_a_metric_and_nothing_else_is():
    tx = ls.predictive(optax.sgd(0.1), track_grad_norm=True, track_underflow=True, locate_overflows=True)
    state = tx.init({"w": jnp.ones(3)})
    keys = {key.removeprefix("loss_scale/") for key in ls.metrics(state)}
    record = set(ls.StepRecord._fields) - {"nonfinite_leaves"}  # one flag per leaf: overflow_paths
    assert keys == {"scale", "good_steps"} | record | set(state.counters._fields)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_skip_reasons_are_named(jit):
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0)
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(jnp.zeros(2))
    reasons = []
    for grads, loss in [
        (jnp.array([8.0, 8.0]), 1.0),
        (jnp.array([8.0, jnp.inf]), 1.0),
        (jnp.array([8.0, 8.0]), jnp.nan),
        (jnp.array([jnp.nan, 8.0]), jnp.inf),
    ]:
        _, state = update(grads, state, value=jnp.float32(loss))
        reasons.append(ls.SkipReason(int(state.skip_reason)))
    assert reasons == [
        ls.SkipReason.APPLIED,
        ls.SkipReason.GRADIENT_OVERFLOW,
        ls.SkipReason.NONFINITE_LOSS,
        ls.SkipReason.NONFINITE_LOSS,  # a failed forward pass explains the gradients too
    ]
    assert [int(r) for r in ls.SkipReason] == [0, 1, 2]


def test_increment_saturates_at_the_dtype_maximum():
    for dtype in (jnp.int8, jnp.int16, jnp.int32):
        top = jnp.iinfo(dtype).max
        assert increment(jnp.asarray(top - 1, dtype)) == top
        assert increment(jnp.asarray(top, dtype)) == top
        assert increment(jnp.asarray(top, dtype), jnp.array(False)) == top
        assert increment(jnp.asarray(5, dtype), True) == 6
        assert increment(jnp.asarray(5, dtype)).dtype == dtype
    # Batched (vmap) and differentiable inputs pass through as arrays.
    counts = jnp.array([0, INT32_MAX - 1, INT32_MAX], jnp.int32)
    np.testing.assert_array_equal(jax.vmap(increment)(counts), [1, INT32_MAX, INT32_MAX])


@pytest.mark.parametrize("name", ["dynamic", "predictive", "cerebras"])
def test_counters_at_their_maximum_stay_there(name):
    tx = {
        "dynamic": lambda: ls.dynamic(optax.sgd(0.1), initial_scale=2.0**4),
        "predictive": lambda: ls.predictive(optax.sgd(0.1)),
        "cerebras": lambda: ls.presets.cerebras(optax.sgd(0.1)),
    }[name]()
    state = tx.init(jnp.zeros(2))
    full = jnp.int32(INT32_MAX)
    record = state.record._replace(
        skipped_steps=full,
        consecutive_skips=full,
        growths=full,
        backoffs=full,
        steps_at_min=full,
        nonfinite_losses=full,
    )
    state = state._replace(record=record)
    if name == "predictive":
        state = state._replace(counters=state.counters._replace(overflow_run=full, extra_headroom=full))
    step = jax.jit(tx.update)
    for grads, loss in [(jnp.array([1.0, jnp.inf]), jnp.nan), (jnp.array([1.0, jnp.inf]), 1.0)]:
        _, state = step(grads * state.scale, state, value=jnp.float32(loss))
        for field in ("skipped_steps", "consecutive_skips", "backoffs", "nonfinite_losses"):
            assert int(getattr(state.record, field)) == INT32_MAX, field
        assert int(state.record.skipped_steps) > 0
    if name == "predictive":
        assert int(state.counters.overflow_run) == INT32_MAX


def test_settings_are_typed_fields_that_agree_with_the_declared_options():
    fields = {field.name: field for field in dataclasses.fields(Settings)}
    assert set(fields) == set(OPTIONS) | {"check_finite"}
    hints = typing.get_type_hints(Settings)
    declared = typing.get_type_hints(Options)
    for name, option in OPTIONS.items():
        assert fields[name].default == option.default, name
        assert hints[name] == declared[name], name
    settings = settings_from("dynamic", {"max_grad_norm": 2, "track_underflow": True})
    assert settings.max_grad_norm == 2.0 and settings.track_underflow and settings.with_norm
    assert settings.check_finite
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_grad_norm = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        settings.not_an_option  # noqa: B018  (no __getattr__ hides a typo)

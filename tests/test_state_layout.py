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
    assert ls.LossScaleState._fields == ("scale", "good_steps", "counters", "record", "inner_state")
    assert isinstance(state.record, ls.StepRecord)
    # The stable attributes read through to the record.
    assert state.skipped is state.record.skipped
    assert state.skipped_steps is state.record.skipped_steps
    assert state.consecutive_skips is state.record.consecutive_skips
    # Any field of the record or the counters reads as an attribute.
    assert state.grad_norm is state.record.grad_norm
    assert state.overflows_left is state.counters.overflows_left
    # optax's tree utilities find nested fields by name.
    assert optax.tree_utils.tree_get(state, "skipped_steps") is state.record.skipped_steps
    assert optax.tree_utils.tree_get(state, "count") is state.inner_state[0].count


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

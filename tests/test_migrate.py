"""States saved by loss_scale 0.2.0 carry on under this version's layout.

``tests/data/state_0_2_0.npz`` was written by 0.2.0's code
(``tests/data/record_state_0_2_0.py``, run at commit c954f17): two states,
their params, the next step's gradients, and what 0.2.0's update made of
them. A migrated state must hold every saved value and take the next step
as 0.2.0 did: the counts and the scale exactly, the float32 params within
float32 rounding (the fixture was computed on another run of XLA:CPU, whose
fused float32 arithmetic may round differently on another CPU).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls

FIXTURE = pathlib.Path(__file__).parent / "data" / "state_0_2_0.npz"

BUILDERS = {
    "dynamic": lambda: ls.dynamic(
        optax.adam(1e-2),
        initial_scale=2.0**10,
        growth_interval=3,
        hysteresis=2,
        track_grad_norm=True,
        locate_overflows=True,
        track_underflow=True,
    ),
    "predictive": lambda: ls.predictive(optax.sgd(0.1, momentum=0.9)),
}


def saved() -> dict:
    """The fixture as nested dicts keyed by field names, as a checkpointer
    restores a pytree without a target."""
    tree: dict = {}
    with np.load(FIXTURE) as arrays:
        for key in arrays.files:
            *parents, leaf = key.split("/")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = arrays[key]
    return tree


def params_of(run: dict) -> dict:
    return {name: jnp.asarray(value) for name, value in run["params"].items()}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_migrated_state_keeps_every_saved_value(name):
    run = saved()[name]
    old = run["state"]
    state = ls.migrate_state(old, BUILDERS[name](), params_of(run))
    assert isinstance(state, ls.LossScaleState)
    assert state.scale == old["scale"] and state.good_steps == old["good_steps"]
    assert state.scale.dtype == jnp.float32 and state.good_steps.dtype == jnp.int32
    for field, value in old["counters"].items():
        np.testing.assert_array_equal(getattr(state.counters, field), value, err_msg=field)
    for field in ("skipped", "skipped_steps", "consecutive_skips", "growths", "backoffs", "steps_at_min"):
        np.testing.assert_array_equal(getattr(state.record, field), old[field], err_msg=field)
    for field in ("skip_reason", "nonfinite_losses"):
        np.testing.assert_array_equal(getattr(state.record, field), old[field], err_msg=field)
    for field, value in old["stats"].items():
        np.testing.assert_array_equal(getattr(state.record, field), value, err_msg=field)
    saved_inner = jax.tree.leaves(old["inner_state"])
    assert len(jax.tree.leaves(state.inner_state)) == len(saved_inner)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.inner_state)[0]:
        keys = [str(getattr(e, "name", getattr(e, "key", getattr(e, "idx", "")))) for e in path]
        expected = old["inner_state"]
        for key in keys:
            expected = expected[key]
        np.testing.assert_array_equal(leaf, expected, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_migrated_state_takes_the_next_step_as_0_2_0_did(name, jit):
    run = saved()[name]
    tx = BUILDERS[name]()
    params = params_of(run)
    state = ls.migrate_state(run["state"], tx, params)
    grads = {key: jnp.asarray(value) for key, value in run["next_grads"].items()}
    update = jax.jit(tx.update) if jit else tx.update
    updates, after = update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    for key, value in run["next_params"].items():
        np.testing.assert_allclose(new_params[key], value, rtol=2e-6, atol=1e-7, err_msg=key)
    old_after = run["next_state"]
    assert after.scale == old_after["scale"] and after.good_steps == old_after["good_steps"]
    for field in ("skipped", "skipped_steps", "consecutive_skips", "growths", "backoffs", "skip_reason"):
        np.testing.assert_array_equal(getattr(after.record, field), old_after[field], err_msg=field)
    for field, value in old_after["counters"].items():
        np.testing.assert_array_equal(getattr(after.counters, field), value, err_msg=field)


def test_a_migrated_state_comes_through_an_orbax_checkpoint(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    run = saved()["dynamic"]
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "old", run["state"])
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "old")  # no target: what a 0.2.0 user has
    tx = BUILDERS["dynamic"]()
    state = ls.migrate_state(restored, tx, params_of(run))
    direct = ls.migrate_state(run["state"], tx, params_of(run))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(a, b)
    # The migrated state checkpoints and restores in the new layout.
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "new", state)
    with ocp.StandardCheckpointer() as checkpointer:
        again = checkpointer.restore(tmp_path / "new", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert jax.tree.structure(again) == jax.tree.structure(state)


def test_the_fields_in_order_migrate_as_the_mapping_does():
    run = saved()["predictive"]
    old = run["state"]
    order = [
        *("scale", "good_steps", "skipped", "skipped_steps", "consecutive_skips", "growths", "backoffs"),
        *("steps_at_min", "skip_reason", "nonfinite_losses", "counters", "stats", "inner_state"),
    ]
    tx = BUILDERS["predictive"]()
    by_position = ls.migrate_state([old[field] for field in order], tx, params_of(run))
    by_name = ls.migrate_state(old, tx, params_of(run))
    for a, b in zip(jax.tree.leaves(by_position), jax.tree.leaves(by_name), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_state_in_the_new_layout_is_returned_as_it_is():
    tx = ls.dynamic(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    assert ls.migrate_state(state, tx, params) is state
    with pytest.raises(ValueError, match=r"at \.record\.grad_norm: None here, float32\[\] expected"):
        ls.migrate_state(state, ls.dynamic(optax.adam(1e-3), track_grad_norm=True), params)


def test_a_saved_state_that_does_not_fit_is_refused_with_where():
    run = saved()["dynamic"]
    tx = BUILDERS["dynamic"]()
    params = params_of(run)
    missing = {key: value for key, value in run["state"].items() if key != "backoffs"}
    with pytest.raises(ValueError, match="misses backoffs"):
        ls.migrate_state(missing, tx, params)
    # Saved without track_grad_norm, used with a transformation that records it: the statistic is absent.
    no_norm = dict(run["state"], stats={k: v for k, v in run["state"]["stats"].items() if k != "grad_norm"})
    with pytest.raises(ValueError, match=r"nothing at \.record\.grad_norm"):
        ls.migrate_state(no_norm, tx, params)
    # Another optimizer's inner state: the first leaf that differs is named.
    with pytest.raises(ValueError, match=r"\.inner_state\[0\]\.mu\['w'\]"):
        ls.migrate_state(run["state"], ls.dynamic(optax.adam(1e-2)), {"b": params["b"], "w": jnp.ones(3)})
    with pytest.raises(ValueError, match="float16.* at .*float32.* expected"):
        inner = jax.tree.map(
            lambda x: x.astype(np.float16) if x.dtype == np.float32 else x, run["state"]["inner_state"]
        )
        ls.migrate_state(dict(run["state"], inner_state=inner), tx, params)
    with pytest.raises(ValueError, match="expected the saved state as a mapping"):
        ls.migrate_state(3.0, tx, params)
    with pytest.raises(ValueError, match="loss-scaling transformation"):
        ls.migrate_state(run["state"], optax.adam(1e-3), params)


def test_wrap_opt_state_names_the_leaf_that_differs_and_both_types():
    params = {"w": jnp.ones((2, 3))}
    tx = ls.dynamic(optax.adam(1e-3))
    plain = optax.adam(1e-3).init({"w": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match=r"at \[0\]\.mu\['w'\]: float32\[3, 2\] here, float32\[2, 3\] expected"):
        ls.wrap_opt_state(tx, plain, params)


def test_a_state_of_this_version_from_another_rule_says_how_to_change_the_rule(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.ones(3)}
    saved = ls.dynamic(optax.adam(1e-3)).init(params)
    tx = ls.predictive(optax.adam(1e-3))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt")  # no target: its fields by name
    # Restored without a target, the packed values are words whose names the
    # checkpoint does not keep: their count is what differs.
    for state, detail in [(saved, "at .counters.overflows_left"), (restored, "int32[13] at .packed.data")]:
        with pytest.raises(ValueError) as error:
            ls.migrate_state(state, tx, params)
        message = str(error.value)
        assert message.startswith("the saved state is already in this version's layout"), message
        assert detail in message and "0.2.0" in message
        assert "ls.wrap_opt_state(tx, restored_state, params)" in message
        assert "old transformation's init as the target" in message
    # Restored without a target, a state that tx made is laid out as tx's.
    same = ls.dynamic(optax.adam(1e-3))
    laid_out = ls.migrate_state(restored, same, params)
    assert jax.tree.structure(laid_out) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(laid_out), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    # A statistic tx tracks and the saved state lacks, or one it does not track: refused.
    widths = r"already in this version's layout.*int32\[{}\] at \.packed\.data, int32\[{}\]"
    with pytest.raises(ValueError, match=widths.format(13, 14)):
        ls.migrate_state(restored, ls.dynamic(optax.adam(1e-3), track_grad_norm=True), params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "norm", ls.dynamic(optax.adam(1e-3), track_grad_norm=True).init(params))
        with_norm = checkpointer.restore(tmp_path / "norm")
    with pytest.raises(ValueError, match=widths.format(14, 13)):
        ls.migrate_state(with_norm, same, params)


def test_wrap_opt_state_takes_a_state_of_another_rule_and_keeps_its_inner_state():
    params = {"w": jnp.ones(3)}
    old = ls.dynamic(optax.adam(1e-3), track_grad_norm=True)
    state = old.init(params)
    _, state = old.update({"w": jnp.full(3, 2.0**10)}, state, params)
    moved = ls.wrap_opt_state(ls.predictive(optax.adam(1e-3)), state, params)
    assert type(moved.counters).__name__ == "PredictiveCounters" and moved.record.grad_norm is None
    assert moved.inner_state is state.inner_state and int(moved.inner_state[0].count) == 1
    # Another inner optimizer is still refused, naming the leaf.
    with pytest.raises(ValueError, match=r"is not the one the wrapped optimizer makes, at \[0\]"):
        ls.wrap_opt_state(ls.predictive(optax.sgd(1e-3)), state, params)

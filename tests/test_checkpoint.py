"""Checkpoints: orbax and plain serialization, bit-identical resumption,
settings that survive any tree round trip, migration from plain optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import loss_scale as ls
from tests._compare import assert_trees_bitwise

TX = ls.dynamic(optax.adamw(1e-2), initial_scale=2.0**6, growth_interval=3, min_scale=2.0, hysteresis=2)


def grads_for(step, params):
    rng = np.random.default_rng(step)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    if step % 5 == 3:  # an overflow now and then, so the scale moves both ways
        grads["w"] = grads["w"].at[0, 0].set(jnp.inf)
    return grads


@jax.jit
def step(params, opt_state, grads):
    grads = jax.tree.map(lambda g: g * ls.get_scale(opt_state).astype(g.dtype), grads)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train(params, opt_state, start, stop):
    for i in range(start, stop):
        params, opt_state = step(params, opt_state, grads_for(i, params))
    return params, opt_state


def init():
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    return params, TX.init(params)


@pytest.fixture(scope="module")
def uninterrupted():
    return train(*init(), 0, 40)


def test_orbax_standard_checkpointer_resumes_bit_identically(tmp_path, uninterrupted):
    params, opt_state = train(*init(), 0, 17)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], ls.LossScaleState)
    assert_trees_bitwise(restored["opt_state"], opt_state)
    assert_trees_bitwise(train(restored["params"], restored["opt_state"], 17, 40), uninterrupted)


def test_orbax_checkpoint_manager(tmp_path, uninterrupted):
    params, opt_state = init()
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=10)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        for i in range(25):
            params, opt_state = step(params, opt_state, grads_for(i, params))
            manager.save(i + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        manager.wait_until_finished()
        assert manager.latest_step() == 20
    fresh_params, fresh_state = init()
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        restored = manager.restore(
            20, args=ocp.args.StandardRestore({"params": fresh_params, "opt_state": fresh_state})
        )
    assert int(ls.find_state(restored["opt_state"]).skipped_steps) == 4  # steps 3, 8, 13, 18
    assert_trees_bitwise(train(restored["params"], restored["opt_state"], 20, 40), uninterrupted)


def test_flax_serialization_round_trip(uninterrupted):
    params, opt_state = train(*init(), 0, 23)
    blob = serialization.to_bytes({"params": params, "opt_state": opt_state})
    restored = serialization.from_bytes({"params": init()[0], "opt_state": init()[1]}, blob)
    assert_trees_bitwise(restored["opt_state"], opt_state)
    assert_trees_bitwise(train(restored["params"], restored["opt_state"], 23, 40), uninterrupted)


def test_settings_survive_tree_round_trips():
    # jmp 0.0.4 keeps min_loss_scale in pytree aux data and loses it under
    # jit; here every setting lives in the transformation, the state holds
    # only arrays.
    params, opt_state = init()
    leaves, treedef = jax.tree.flatten(opt_state)
    assert all(isinstance(x, jax.Array) for x in leaves)
    opt_state = jax.tree.unflatten(treedef, [jnp.array(x) for x in leaves])
    opt_state = jax.jit(lambda s: jax.tree.map(lambda x: x, s))(opt_state)
    bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    for _ in range(12):  # hysteresis 2: backs off from the second overflow on
        _, opt_state = jax.jit(TX.update)(bad, opt_state, params)
    assert float(opt_state.scale) == 2.0  # the configured min_scale, not 1


def test_wrap_opt_state_migrates_a_plain_optax_checkpoint():
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    plain = optax.adamw(1e-2)
    plain_state = plain.init(params)
    for i in range(5):
        _, plain_state = plain.update(grads_for(i * 5, params), plain_state, params)
    migrated = ls.wrap_opt_state(TX, plain_state, params)
    assert_trees_bitwise(migrated.inner_state, plain_state)
    assert float(migrated.scale) == 2.0**6 and int(migrated.inner_state[0].count) == 5
    params, migrated = step(params, migrated, grads_for(0, params))
    assert int(migrated.inner_state[0].count) == 6
    with pytest.raises(ValueError, match="is not the one the wrapped optimizer makes, at "):
        ls.wrap_opt_state(TX, optax.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match=r"at \[0\]\.mu\['b'\]: float16\[3\] here, bfloat16\[3\] expected"):
        ls.wrap_opt_state(TX, jax.tree.map(lambda x: x.astype(jnp.float16) if x.ndim else x, plain_state), params)
    with pytest.raises(ValueError, match="loss-scaling transformation"):
        ls.wrap_opt_state(plain, plain_state, params)


@pytest.mark.parametrize(
    ("saved_with", "used_with", "field"),
    [
        ({}, {"track_grad_norm": True}, "grad_norm"),
        ({}, {"locate_overflows": True}, "nonfinite_leaves"),
        ({"track_underflow": True}, {}, "zero_fraction"),
        ({"max_grad_norm": 1.0}, {}, "grad_norm"),
    ],
)
def test_a_state_from_other_settings_gets_one_clear_error(tmp_path, saved_with, used_with, field):
    params = {"w": jnp.ones((2, 3))}
    saved = ls.dynamic(optax.adam(1e-3), **saved_with).init(params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", saved)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, saved))
    tx = ls.dynamic(optax.adam(1e-3), **used_with)
    # The message names the first differing field and both sides.
    with pytest.raises(
        ValueError,
        match=rf"at \.record\.{field}: (None here, \S+ expected|\S+ here, None expected).* built with other settings",
    ):
        tx.update(jax.tree.map(jnp.ones_like, params), restored, params)
    # The predictive rule keeps counters the dynamic rule's state lacks.
    with pytest.raises(ValueError, match=r"the state keeps DynamicCounters, this rule PredictiveCounters"):
        ls.predictive(optax.adam(1e-3), **used_with).update(jax.tree.map(jnp.ones_like, params), restored, params)


def test_a_dynamic_checkpoint_resumes_under_predictive_keeping_the_inner_state(tmp_path):
    # Saved under TX (ls.dynamic around adamw), resumed under ls.predictive:
    # restored with the old rule's init as the target, then wrapped.
    params, opt_state = train(*init(), 0, 17)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": TX.init(params)})
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    new_tx = ls.predictive(optax.adamw(1e-2), initial_scale=2.0**6)
    moved = ls.wrap_opt_state(new_tx, restored["opt_state"], restored["params"])
    assert isinstance(moved.counters, type(new_tx.init(params).counters))
    assert_trees_bitwise(moved.inner_state, opt_state.inner_state)
    assert float(moved.scale) == 2.0**6 and int(moved.record.skipped_steps) == 0  # the new rule starts afresh
    count = int(moved.inner_state[0].count)
    assert count == 17 - int(opt_state.skipped_steps)

    @jax.jit
    def new_step(params, opt_state, grads):
        grads = jax.tree.map(lambda g: g * ls.get_scale(opt_state).astype(g.dtype), grads)
        updates, opt_state = new_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = restored["params"]
    for i in range(17, 21):
        params, moved = new_step(params, moved, grads_for(i, params))
    # Adam's count goes on from the saved one; step 18 overflows and is skipped.
    assert int(moved.inner_state[0].count) == count + 3 and int(moved.record.skipped_steps) == 1
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(params))
    # Restoring straight into the new rule's layout is what fails.
    with pytest.raises(ValueError), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.restore(
            tmp_path / "ckpt",
            jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": new_tx.init(params)}),
        )


def _segmented(names):
    return ls.predictive(optax.adam(1e-3), initial_scale=2.0**8, segments=names)


@pytest.mark.parametrize(
    "saved, restored",
    [
        (("embed", "body"), ("encoder", "decoder")),
        (("embed", "body"), ("embed", "head")),
        (("a" * 70,), ("a" * 69 + "b",)),
    ],
    ids=["other-names", "one-name-differs", "long-names"],
)
def test_segment_names_are_checked_on_restore(tmp_path, saved, restored):
    # The exponents belong to the boundaries by name: a state saved with
    # some names and restored (as the guide shows) into an optimizer with
    # others is refused, naming both lists, not trained on with the
    # exponents on the wrong boundaries.
    params = {"w": jnp.ones(3)}
    state = _segmented(saved).init(params)
    state = state._replace(
        counters=state.counters._replace(segments=state.counters.segments.replace(exponent=jnp.array([5] * len(saved))))
    )
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", state)
    with ocp.StandardCheckpointer() as checkpointer, pytest.raises(ValueError) as error:
        checkpointer.restore(tmp_path / "ckpt", _segmented(restored).init(params))
    message = str(error.value)
    assert str(sorted(restored)) in message, message
    if len(saved[0]) <= 64:
        assert str(sorted(saved)) in message, message
    else:  # cut to 60 bytes and its CRC-32: the saved name's start is shown
        assert saved[0][:60] in message, message
    # The same names restore, the exponents on their boundaries.
    with ocp.StandardCheckpointer() as checkpointer:
        same = checkpointer.restore(tmp_path / "ckpt", _segmented(saved).init(params))
    assert same.counters.segments.exponents() == dict.fromkeys(sorted(saved), 5)
    tx = _segmented(saved)
    jax.jit(tx.update)({"w": jnp.ones(3)}, same, params)  # and train on

"""A non-finite loss passed as ``tx.update(..., value=loss)`` is a forward
failure: skipped, counted apart, and (by default) not a reason to back off."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import loss_scale as ls
from tests._compare import assert_trees_bitwise

FACTORIES = {
    "dynamic": lambda inner, **kw: ls.dynamic(inner, initial_scale=1024.0, growth_interval=3, **kw),
    "predictive": lambda inner, **kw: ls.predictive(inner, initial_scale=1024.0, **kw),
    "static": lambda inner, **kw: ls.static(inner, 1024.0, **kw),
    "cerebras": lambda inner, **kw: ls.presets.cerebras(inner, initial_loss_scale=1024.0, **kw),
    "deepspeed": lambda inner, **kw: ls.presets.deepspeed(inner, initial_scale_power=10, **kw),
}
PARAMS = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
GOOD = {"w": jnp.full((2, 3), 0.5), "b": jnp.full(3, 2.0)}
BAD = {"w": jnp.full((2, 3), 0.5), "b": jnp.array([1.0, jnp.inf, 1.0])}


def _rule_part(state):
    return state.scale, state.good_steps, state.counters


def assert_moved(params):
    """Some element of ``params`` differs from ``PARAMS``'s, bit for bit."""
    with pytest.raises(AssertionError, match="not bit for bit equal"):
        assert_trees_bitwise(params, PARAMS)


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("loss", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("grads", [GOOD, BAD], ids=["finite_grads", "overflowing_grads"])
def test_a_non_finite_loss_skips_without_touching_the_scale(name, loss, grads):
    tx = FACTORIES[name](optax.adam(1e-2))
    state = tx.init(PARAMS)
    _, state = tx.update(GOOD, state, PARAMS, value=jnp.float32(1.0))  # one clean step first
    updates, new = jax.jit(tx.update)(grads, state, PARAMS, value=jnp.float32(loss))
    assert bool(new.skipped) and int(new.skip_reason) == 2
    assert int(new.nonfinite_losses) == 1 and int(new.skipped_steps) == 1
    assert_trees_bitwise(_rule_part(new), _rule_part(state))  # the rule did not see it
    assert_trees_bitwise(new.inner_state, state.inner_state)  # nothing lost
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", ["dynamic", "deepspeed", "cerebras"])
def test_backoff_on_nonfinite_loss_backs_off_as_for_an_overflow(name):
    tx = FACTORIES[name](optax.sgd(0.1), backoff_on_nonfinite_loss=True)
    reference = FACTORIES[name](optax.sgd(0.1))
    state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
    for _ in range(3):
        _, state = tx.update(GOOD, state, PARAMS, value=jnp.float32(jnp.nan))
        _, ref_state = reference.update(BAD, ref_state, PARAMS)
        assert float(state.scale) == float(ref_state.scale)
        assert int(state.skip_reason) == 2 and int(ref_state.skip_reason) == 1


@pytest.mark.parametrize("name", FACTORIES)
def test_a_finite_value_changes_nothing(name):
    """With finite losses, passing value= gives the very states of not passing it."""
    tx = FACTORIES[name](optax.adam(1e-2))
    update_with_value = jax.jit(lambda g, s: tx.update(g, s, PARAMS, value=jnp.float32(2.5)))
    update = jax.jit(lambda g, s: tx.update(g, s, PARAMS))
    with_value, without = tx.init(PARAMS), tx.init(PARAMS)
    for grads in [GOOD, GOOD, BAD, GOOD, GOOD, GOOD, BAD, BAD, GOOD]:
        u1, with_value = update_with_value(grads, with_value)
        u2, without = update(grads, without)
        assert_trees_bitwise((u1, with_value), (u2, without))
        assert int(without.skip_reason) == (0 if grads is GOOD else 1)


def test_the_fused_step_skips_a_forward_failure_and_keeps_the_params():
    tx = ls.dynamic(optax.adam(1e-2))
    state = tx.init(PARAMS)
    params, new = ls.apply_gradients(tx, GOOD, state, PARAMS, value=jnp.float32(jnp.nan))
    assert_trees_bitwise(params, PARAMS)
    assert int(new.skip_reason) == 2
    params, new = ls.apply_gradients(tx, GOOD, new, PARAMS, value=jnp.float32(1.0))
    assert_moved(params)
    assert int(new.skip_reason) == 0


def test_max_consecutive_skips_says_which_failure_it_was():
    tx = ls.dynamic(optax.sgd(0.1), max_consecutive_skips=2)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    _, state = update(GOOD, state, PARAMS, value=jnp.float32(jnp.nan))
    with pytest.raises(Exception, match="forward failure"):
        _, state = update(GOOD, state, PARAMS, value=jnp.float32(jnp.nan))
        jax.block_until_ready(state)
    state = tx.init(PARAMS)
    _, state = update(BAD, state, PARAMS, value=jnp.float32(1.0))
    with pytest.raises(Exception, match=r"gradient overflow; non-finite gradient leaves: \['b'\]"):
        _, state = update(BAD, state, PARAMS, value=jnp.float32(1.0))
        jax.block_until_ready(state)


def test_under_vmap_each_model_has_its_own_reason():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=1024.0)
    params = jax.tree.map(lambda x: jnp.stack([x, x, x]), PARAMS)
    grads = jax.tree.map(lambda g, b: jnp.stack([g, g, b]), GOOD, BAD)
    state = jax.vmap(tx.init)(params)
    _, state = jax.vmap(tx.update)(grads, state, params, value=jnp.array([1.0, jnp.nan, 1.0]))
    assert state.skip_reason.tolist() == [0, 2, 1]
    assert state.scale.tolist() == [1024.0, 1024.0, 512.0]


def test_a_forward_failure_on_one_replica_is_skipped_by_all():
    mesh = jax.make_mesh((4,), ("data",))
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=1024.0, axis_name="data")

    def loss_fn(params, x):
        return jnp.mean(jnp.log(x) * params["w"][0, 0])  # log of a negative input: nan on its replica

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    def step(params, state, x):
        loss, grads = ls.value_and_grad(loss_fn, axis_name="data")(state, params, x)
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state

    state = tx.init(PARAMS)
    batch = jax.NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.ones(8).at[5].set(-1.0), batch)
    params, state = step(PARAMS, state, x)
    assert int(state.skip_reason) == 2 and float(state.scale) == 1024.0
    assert_trees_bitwise(params, PARAMS)
    params, state = step(PARAMS, state, jax.device_put(jnp.ones(8) * 2.0, batch))
    assert int(state.skip_reason) == 0
    assert_moved(params)


def test_a_model_that_fails_forward_keeps_its_scale_where_it_belongs():
    """A float16 regression whose every fourth batch overflows in the forward
    pass: passing the loss keeps the scale where the gradients need it; not
    passing it drives the scale down with every forward failure."""
    w = jnp.full((8, 1), 0.01)

    def loss_fn(w, x, y):
        pred = x.astype(jnp.float16) @ w.astype(jnp.float16)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    def run(pass_value):
        tx = ls.dynamic(optax.sgd(1e-3), initial_scale=2.0**15, growth_interval=1000)

        @jax.jit
        def step(params, state, x):
            loss, grads = ls.value_and_grad(loss_fn)(state, params, x, jnp.ones((4, 1)))
            extra = {"value": loss} if pass_value else {}
            updates, state = tx.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state

        params, state = w, tx.init(w)
        for i in range(40):
            params, state = step(params, state, jnp.full((4, 8), 7e4 if i % 4 == 3 else 1.0))  # 7e4 is inf in float16
        return state

    with_value, without = run(True), run(False)
    assert int(with_value.nonfinite_losses) == 10 and int(with_value.skipped_steps) == 10
    assert float(with_value.scale) == 2.0**15
    assert int(without.skipped_steps) == 10 and float(without.scale) == 2.0**5  # ten needless backoffs

"""How a step is skipped: without a branch where the inner update allows it,
inside a ``lax.cond`` where it has control flow or effects; bit for bit the
kept values either way."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from tests._compare import assert_trees_bitwise
from tests._jaxprs import primitives

PARAMS = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([-0.0, 1.0, 2.0])}


def with_control_flow(inner):
    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return jax.lax.cond(True, lambda u: u, lambda u: u, updates), state

    return optax.GradientTransformation(inner.init, update)


def with_a_callback(inner, seen):
    def update(updates, state, params=None):
        jax.debug.callback(lambda: seen.append(1))
        return inner.update(updates, state, params)

    return optax.GradientTransformation(inner.init, update)


def test_an_elementwise_inner_update_has_no_branch_and_control_flow_keeps_one():
    for tx, branched in [
        (ls.dynamic(optax.adam(1e-3)), False),
        (ls.dynamic(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))), False),
        (ls.dynamic(with_control_flow(optax.adam(1e-3))), True),
        (ls.dynamic(optax.MultiSteps(optax.adam(1e-3), 2)), True),
        (ls.dynamic(with_a_callback(optax.sgd(0.1), [])), True),
    ]:
        state = tx.init(PARAMS)
        names = primitives(functools.partial(tx.update, params=PARAMS), PARAMS, state)
        assert ("cond" in names) is branched, names


def test_a_callback_in_the_inner_update_does_not_run_on_a_skipped_step():
    seen = []
    tx = ls.dynamic(with_a_callback(optax.sgd(0.1), seen), initial_scale=4.0)
    state = tx.init(PARAMS)
    step = jax.jit(tx.update)
    _, state = step(jax.tree.map(jnp.ones_like, PARAMS), state, PARAMS)
    jax.effects_barrier()
    assert seen == [1]
    _, state = step({"w": jnp.full((2, 3), jnp.inf), "b": jnp.ones(3)}, state, PARAMS)
    jax.effects_barrier()
    assert seen == [1] and bool(state.skipped)


def sharing(updates, state, params=None):
    """An inner update whose new state shares one value between two leaves,
    returns one leaf unchanged and one as a constant."""
    new = jax.tree.map(lambda u, m: 0.5 * m + u, updates, state["a"])
    return updates, {"a": new, "b": new, "same": state["same"], "const": jnp.float32(3.0)}


def sharing_init(params):
    return {
        "a": jax.tree.map(lambda p: jnp.full_like(p, 1.0), params),
        "b": jax.tree.map(lambda p: jnp.full_like(p, 2.0), params),
        "same": jnp.float32(7.0),
        "const": jnp.float32(5.0),
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fused", [False, True], ids=["optax", "fused"])
def test_a_skipped_step_keeps_every_leaf_whatever_the_update_shares(jit, fused):
    tx = ls.static(optax.GradientTransformation(sharing_init, sharing), scale=2.0)
    state = tx.init(PARAMS)
    grads = {"w": jnp.ones((2, 3)).at[0, 1].set(jnp.nan), "b": jnp.ones(3)}
    if fused:
        step = jax.jit(tx.apply_gradients) if jit else tx.apply_gradients
        out, new = step(grads, state, PARAMS)
        assert_trees_bitwise(out, PARAMS)  # -0.0 kept as -0.0
    else:
        step = jax.jit(tx.update) if jit else tx.update
        out, new = step(grads, state, PARAMS)
        assert_trees_bitwise(out, jax.tree.map(jnp.zeros_like, PARAMS))
    assert bool(new.skipped)
    assert_trees_bitwise(new.inner_state, state.inner_state)
    # Applied, the shared value lands in both leaves and the constant in its own.
    out, new = step(jax.tree.map(jnp.ones_like, PARAMS), state, PARAMS)
    assert_trees_bitwise(new.inner_state["a"], new.inner_state["b"])
    assert float(new.inner_state["const"]) == 3.0 and float(new.inner_state["same"]) == 7.0


def test_the_update_computes_on_zeros_where_it_skips():
    # A derivative through a skipped step, with an inner update whose
    # derivative is not finite at inf, stays 0 (not 0 * inf = nan).
    def log_update(updates, state, params=None):
        return jax.tree.map(lambda u: -jnp.log1p(jnp.abs(u)) * state, updates), state

    tx = ls.static(optax.GradientTransformation(lambda p: jnp.float32(1.0), log_update), scale=1.0)

    def moved(lr):
        state = tx.init(PARAMS)._replace(inner_state=lr)
        grads = {"w": jnp.full((2, 3), jnp.inf), "b": jnp.ones(3)}
        updates, _ = tx.update(grads, state, PARAMS)
        return sum(jnp.sum(u) for u in jax.tree.leaves(updates))

    assert float(jax.grad(moved)(jnp.float32(0.1))) == 0.0
    np.testing.assert_array_equal(jax.jit(jax.grad(moved))(jnp.float32(0.1)), 0.0)

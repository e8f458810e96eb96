"""value_and_grad, scale_loss, unscale and finding the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import loss_scale as ls
from tests._compare import assert_trees_close


def test_find_state_in_nested_states():
    params = {"w": jnp.zeros(2)}
    dyn = ls.dynamic(optax.adam(1e-3), initial_scale=64.0)
    nestings = {
        "bare": dyn,
        "chain": optax.chain(optax.add_decayed_weights(1e-4), dyn),
        "multisteps_outside": optax.MultiSteps(dyn, every_k_schedule=2),
        "multisteps_inside": ls.dynamic(optax.MultiSteps(optax.adam(1e-3), 2), initial_scale=64.0),
        "inject": ls.dynamic(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), initial_scale=64.0),
        "named_chain": optax.named_chain(("decay", optax.add_decayed_weights(1e-4)), ("scaled", dyn)),
    }
    for name, tx in nestings.items():
        state = tx.init(params)
        assert float(ls.get_scale(state)) == 64.0, name
        assert isinstance(ls.find_state(state), ls.LossScaleState)
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=dyn)
    assert float(ls.get_scale(ts)) == 64.0 and float(ls.get_scale(ts.opt_state)) == 64.0


def test_find_state_errors_are_clear():
    with pytest.raises(ValueError, match="no LossScaleState found .* loss_scale.dynamic"):
        ls.get_scale(optax.adam(1e-3).init(jnp.zeros(2)))
    two = optax.chain(ls.static(optax.identity(), 2.0), ls.static(optax.sgd(1.0), 4.0)).init(jnp.zeros(2))
    with pytest.raises(
        ValueError, match=r"holds 2 loss-scaling states \(at \[0\], \[1\]\).*Wrap the whole optimizer once"
    ):
        ls.get_scale(two)
    assert float(ls.get_scale(two[1])) == 4.0


def test_sibling_loss_scalers_are_refused_with_the_fix_that_works():
    # optax.chain(ls.dynamic(clip), ls.dynamic(adam)) divides the gradients
    # by both scales; the message must lead to one wrapper around the whole
    # optimizer, never to passing one part of the state (which trains with
    # gradients divided twice).
    params = jnp.ones(3)
    siblings = optax.chain(ls.dynamic(optax.clip(1.0)), ls.dynamic(optax.adam(1e-3)))
    state = siblings.init(params)
    for call in (
        lambda: ls.value_and_grad(lambda p: jnp.sum(p**2))(state, params),
        lambda: ls.value_grad_and_peak(lambda p: jnp.sum(p**2))(state, params),
        lambda: ls.scale_loss(jnp.float32(1.0), state),
        lambda: ls.metrics(state),
    ):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert "2 loss-scaling states" in message and "Wrap the whole optimizer once" in message, message
        assert "pass the part" not in message
    multi = optax.multi_transform(
        {"a": ls.dynamic(optax.sgd(0.1)), "b": ls.dynamic(optax.adam(0.1))}, {"x": "a", "y": "b"}
    )
    with pytest.raises(ValueError, match="2 loss-scaling states"):
        ls.value_and_grad(lambda p: p["x"] + p["y"])(multi.init({"x": 1.0, "y": 2.0}), {"x": 1.0, "y": 2.0})
    # A chain's update can see it too: the second scaler is handed the
    # first one's output (eagerly and under jit, in both APIs).
    for update in (siblings.update, jax.jit(siblings.update)):
        with pytest.raises(ValueError, match="output of another loss-scaling update.*Wrap the whole optimizer once"):
            update(jnp.ones(3), state, params)
    first, second = ls.dynamic(optax.clip(1.0)), ls.dynamic(optax.adam(1e-3))
    unscaled, _ = first.update(jnp.ones(3), first.init(params), params)
    with pytest.raises(ValueError, match="output of another loss-scaling update"):
        ls.apply_gradients(second, unscaled, second.init(params), params)
    # The fix the message gives trains with one division.
    once = ls.dynamic(optax.chain(optax.clip(1.0), optax.adam(1e-3)), initial_scale=2.0**10)
    state = once.init(params)
    _, grads = ls.value_and_grad(lambda p: jnp.sum(p**2))(state, params)
    updates, _ = once.update(grads, state, params)
    np.testing.assert_allclose(updates, -1e-3 * np.ones(3), rtol=1e-3)


def test_the_missing_state_message_lists_every_factory():
    with pytest.raises(ValueError) as error:
        ls.value_and_grad(lambda p: jnp.sum(p))(optax.adam(1e-3).init(jnp.zeros(2)), jnp.zeros(2))
    for factory in ("dynamic", "static", "no_op", "predictive", "for_dtype", "Policy.loss_scaling", "presets.torch"):
        assert factory in str(error.value), (factory, str(error.value))


def test_value_and_grad_returns_unscaled_loss_and_scaled_grads():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=2.0**10)
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    state = tx.init(params)

    def loss_fn(p, x, *, shift):
        return jnp.sum((p["w"] * x + p["b"] - shift) ** 2)

    x = jnp.array([3.0, 4.0])
    loss, grads = jax.jit(ls.value_and_grad(loss_fn))(state, params, x, shift=1.0)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, shift=1.0)
    assert float(loss) == float(ref_loss)
    assert_trees_close(grads, jax.tree.map(lambda r: r * 2.0**10, ref_grads), rtol=1e-6, atol=0)
    unscaled = ls.unscale(grads, state)
    assert_trees_close(unscaled, ref_grads, rtol=1e-6, atol=0)


def test_value_and_grad_with_aux_and_argnums():
    tx = ls.static(optax.sgd(0.1), 8.0)
    state = tx.init(jnp.zeros(1))

    def loss_fn(a, b):
        return jnp.sum(a * b), {"a_sum": jnp.sum(a)}

    (loss, aux), (ga, gb) = ls.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state, jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    )
    assert float(loss) == 11.0 and float(aux["a_sum"]) == 3.0
    np.testing.assert_array_equal(ga, [24.0, 32.0])
    np.testing.assert_array_equal(gb, [8.0, 16.0])
    (loss, aux), gb = ls.value_and_grad(loss_fn, argnums=1, has_aux=True)(state, jnp.ones(2), jnp.ones(2))
    np.testing.assert_array_equal(gb, [8.0, 8.0])


def test_float16_loss_is_scaled_in_float32_and_gradients_survive():
    # A float16 forward pass: with the scale the tiny gradients of a mean over
    # many elements are representable, without it they flush to zero.
    n = 2**16
    x = jnp.full((n,), 1e-3, jnp.float16)
    params = jnp.ones((), jnp.float32)

    def loss_fn(p):
        return jnp.mean((p.astype(jnp.float16) * x).astype(jnp.float32) ** 2).astype(jnp.float16)

    for scale, expect_zero in [(1.0, True), (2.0**15, False)]:
        state = ls.static(optax.sgd(1.0), scale).init(params)
        loss, grads = ls.value_and_grad(loss_fn)(state, params)
        assert loss.dtype == jnp.float16
        assert (float(grads) == 0.0) == expect_zero
    assert ls.scale_loss(jnp.float16(60000.0), state).dtype == jnp.float32
    assert np.isfinite(float(ls.scale_loss(jnp.float16(60000.0), state)))


def test_allow_int_passes_integer_arguments():
    state = ls.static(optax.sgd(1.0), 2.0).init(jnp.zeros(1))
    _, grads = ls.value_and_grad(lambda p: jnp.sum(p["w"]) * p["n"], allow_int=True)(
        state, {"w": jnp.ones(2), "n": jnp.array(3)}
    )
    np.testing.assert_array_equal(grads["w"], [6.0, 6.0])
    assert grads["n"].dtype == jax.dtypes.float0

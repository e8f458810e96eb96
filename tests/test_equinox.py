"""loss_scale.equinox: scaled filtered gradients of eqx.Modules against
``eqx.filter_value_and_grad``, float16 training of an ``eqx.nn.MLP``, and a
forced overflow that leaves the model and the optimizer state untouched."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale import equinox as lsq
from tests._compare import assert_trees_bitwise, assert_trees_close, assert_trees_close_to_largest

POLICY = ls.Policy.from_string("params=float32,compute=float16,output=float32")


class Net(eqx.Module):
    """An MLP with fields that are not arrays: an activation function, an
    int, a flag, which a plain ``jax.grad`` of the module would trip on."""

    mlp: eqx.nn.MLP
    scale_out: jax.Array
    steps_seen: int = eqx.field(static=True)
    activation: object
    use_bias: bool

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(8, 1, width_size=32, depth=2, activation=jax.nn.relu, key=key)
        self.scale_out = jnp.ones(())
        self.steps_seen = 0
        self.activation = jax.nn.gelu
        self.use_bias = True

    def __call__(self, x):
        return self.activation(self.mlp(x)) * self.scale_out


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (np.sin(x @ np.linspace(-1, 1, 8)) * 0.5)[:, None].astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def loss_fn(model, x, y, dtype=jnp.float32):
    model, x = POLICY.cast_to_compute((model, x)) if dtype == jnp.float16 else (model, x)
    pred = jax.vmap(model)(x).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def params_of(model):
    return eqx.filter(model, eqx.is_inexact_array)


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gradients_are_eqx_filter_gradients_times_the_scale(dtype, has_aux):
    model = Net(jax.random.key(0))
    x, y = data(64)
    state = ls.static(optax.sgd(0.1), 2.0**8).init(params_of(model))

    def fn(model, x, y):
        loss = loss_fn(model, x, y, dtype)
        return (loss, {"pred_mean": jnp.mean(x)}) if has_aux else loss

    value, grads = eqx.filter_jit(lsq.filter_value_and_grad(fn, has_aux=has_aux))(state, model, x, y)
    # The reference differentiates loss * scale with equinox's own transform.
    ref_value, ref_grads = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x, y: (fn(m, x, y)[0] if has_aux else fn(m, x, y)) * 2.0**8)
    )(model, x, y)
    loss = value[0] if has_aux else value
    got, want = (loss * 2.0**8, grads), (ref_value, ref_grads)
    if dtype == jnp.float32:
        assert_trees_close(got, want, rtol=0, atol=0)
    else:
        # Two programs (the scale a runtime value in ours, a constant in the
        # reference), which XLA fuses each its own way: their float16
        # passes may round differently (a CPU with float16 arithmetic
        # contracts a multiply and an add that share a kernel into one
        # rounding). A gradient sums 64 examples of float16 products, and
        # cancels: within 16 units of roundoff of the leaf's largest
        # magnitude on each side (12 measured against float32), 2 * 16.
        assert_trees_close_to_largest(got, want, rtol=32 * 2.0**-11)
    assert grads.activation is None and grads.steps_seen == 0  # non-arrays are not differentiated


def test_misuse_raises_what_jax_raises():
    model = Net(jax.random.key(0))
    state = ls.dynamic(optax.sgd(0.1)).init(params_of(model))
    with pytest.raises(TypeError, match="two-element tuple"):
        lsq.filter_value_and_grad(lambda m: jnp.sum(m.scale_out), has_aux=True)(state, model)
    with pytest.raises(TypeError, match="real-valued outputs"):
        lsq.filter_value_and_grad(lambda m: jnp.sum(m.scale_out).astype(jnp.int32))(state, model)


def train(dtype, tx, steps=150, poison=()):
    model = Net(jax.random.key(1))
    opt_state = tx.init(params_of(model))
    x, y = data()

    @eqx.filter_jit(donate="all-except-first")
    def step(poisoned, model, opt_state):
        xb = jnp.where(poisoned, jnp.inf, x)
        loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, xb, y, dtype)
        model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)
        return model, opt_state, loss

    losses = []
    for i in range(steps):
        model, opt_state, loss = step(jnp.bool_(i in poison), model, opt_state)
        losses.append(float(loss))
    return model, opt_state, losses


def test_float16_mlp_trains_like_float32():
    _, _, f32 = train(jnp.float32, ls.no_op(optax.adam(3e-3)))
    model, opt_state, f16 = train(jnp.float16, ls.dynamic(optax.adam(3e-3), growth_interval=50))
    assert f16[-1] < 0.2 * f16[0]
    np.testing.assert_allclose(f16[-1], f32[-1], rtol=0.05)
    assert int(ls.find_state(opt_state).skipped_steps) == 0 and float(ls.get_scale(opt_state)) >= 2.0**15
    assert model.steps_seen == 0 and model.activation is jax.nn.gelu  # the other fields are kept


def test_a_forced_overflow_leaves_model_and_state_bit_identical():
    tx = ls.dynamic(optax.adam(3e-3), initial_scale=2.0**10)
    model = Net(jax.random.key(1))
    opt_state = tx.init(params_of(model))
    x, y = data()
    _, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x, y, jnp.float16)
    model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)  # one clean step first
    before = (params_of(model), ls.find_state(opt_state).inner_state)
    _, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x.at[0, 0].set(jnp.inf), y, jnp.float16)
    new_model, new_state = eqx.filter_jit(lambda g, s, m: lsq.apply_gradients(tx, g, s, m))(grads, opt_state, model)
    assert bool(ls.find_state(new_state).skipped) and float(ls.get_scale(new_state)) == 2.0**9
    assert_trees_bitwise(params_of(new_model), before[0])
    assert_trees_bitwise(ls.find_state(new_state).inner_state, before[1])
    assert ls.metrics(new_state)["loss_scale/skipped_steps"] == 1


def test_overflows_in_training_are_skipped_and_recovered():
    model, opt_state, losses = train(jnp.float16, ls.dynamic(optax.adam(3e-3)), steps=60, poison={10, 11, 30})
    assert int(ls.find_state(opt_state).skipped_steps) == 3
    assert np.isfinite(losses[-1]) and losses[-1] < 0.5 * losses[0]
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params_of(model)))


def test_the_gradient_functions_report_their_own_signature():
    # They take the optimizer state first: a signature copied from the loss
    # function (functools.wraps) made eqx.filter_jit bind the arguments wrongly.
    import inspect

    def fn(model, x):
        return jnp.sum(jax.vmap(model)(x))

    for wrapped in (lsq.filter_value_and_grad(fn), ls.value_and_grad(fn)):
        assert list(inspect.signature(wrapped).parameters)[0] == "opt_state" and wrapped.__name__ == "fn"
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = ls.static(optax.sgd(1.0), 4.0).init(params_of(model))
    _, grads = eqx.filter_jit(ls.value_and_grad(lambda p, x: jnp.sum(p @ x)))(state, jnp.ones((2, 2)), jnp.ones(2))
    np.testing.assert_array_equal(grads, jnp.full((2, 2), 4.0))

"""ls.autocast with module objects: flax NNX modules mutated inside the
function (BatchNorm's running statistics, Dropout's RNG counter) keep
those writes, eagerly, under nnx.jit, inside nnx.grad/nnx.value_and_grad
and through loss_scale.flax's NNX helpers, whether the module is an
argument, the function itself or the owner of a method; and
full_precision's linen, NNX and Equinox ways."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loss_scale as ls
import loss_scale.flax as lsf

X = jax.random.normal(jax.random.key(0), (8, 3)) * 3 + jnp.arange(3.0)[None]


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x)))

    def loss(self, x):
        return jnp.mean(self(x) ** 2)


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def twice(call):
    """Two calls on one model and the same calls on a float32 twin."""
    ref, model = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    refs = [call(ref, False), call(ref, False)]
    outs = [call(model, True), call(model, True)]
    return ref, model, refs, outs


CALLS = {
    "eager": lambda m, f16: (ls.autocast(loss_fn) if f16 else loss_fn)(m, X),
    "nnx.jit": lambda m, f16: nnx.jit(ls.autocast(loss_fn) if f16 else loss_fn)(m, X),
    "nnx.value_and_grad": lambda m, f16: nnx.value_and_grad(ls.autocast(loss_fn) if f16 else loss_fn)(m, X)[0],
    "nnx.grad": lambda m, f16: jnp.sum(nnx.grad(ls.autocast(loss_fn) if f16 else loss_fn)(m, X)["linear"]["kernel"]),
    "module as the function": lambda m, f16: jnp.mean((ls.autocast(m) if f16 else m)(X) ** 2),
    "a module's method": lambda m, f16: (ls.autocast(m.loss) if f16 else m.loss)(X),
}


@pytest.mark.parametrize("call", list(CALLS), ids=list(CALLS))
def test_nnx_state_written_inside_the_function_is_kept(call):
    ref, model, refs, outs = twice(CALLS[call])
    # BatchNorm's running statistics move as in float32 (within the float16
    # rounding of the product that feeds them)...
    np.testing.assert_allclose(model.norm.mean[...], ref.norm.mean[...], rtol=2e-2, atol=1e-3)
    np.testing.assert_allclose(model.norm.var[...], ref.norm.var[...], rtol=2e-2, atol=1e-3)
    assert float(jnp.max(jnp.abs(model.norm.mean[...]))) > 0
    # ...and Dropout's RNG advanced once per call: two calls, two masks, the
    # float32 twin's.
    assert int(model.dropout.rngs.count[...]) == int(ref.dropout.rngs.count[...]) == 2
    np.testing.assert_allclose(outs, refs, rtol=2e-2)
    assert not np.isclose(float(outs[0]), float(outs[1]))


def test_loss_scale_flax_nnx_helpers_keep_the_state():
    results = {}
    for f16 in (False, True):
        model = Net(nnx.Rngs(0))
        optimizer = lsf.Optimizer(model, ls.dynamic(optax.sgd(0.1)), wrt=nnx.Param)
        fn = ls.autocast(loss_fn) if f16 else loss_fn

        @nnx.jit
        def step(model, optimizer, x, fn=fn):
            loss, grads = lsf.nnx_value_and_grad(fn)(optimizer, model, x)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, X)) for _ in range(3)]
        results[f16] = (losses, np.asarray(model.norm.mean[...]), int(model.dropout.rngs.count[...]))
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-2)
    np.testing.assert_allclose(results[True][1], results[False][1], rtol=2e-2, atol=1e-3)
    assert results[True][2] == results[False][2] == 3


def test_a_module_passed_twice_is_one_module():
    model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))

    def both(a, b, x):
        return jnp.mean(a(x)) + jnp.mean(b(x))

    ls.autocast(both)(model, model, X)
    both(ref, ref, X)
    assert int(model.dropout.rngs.count[...]) == 2
    np.testing.assert_allclose(model.norm.mean[...], ref.norm.mean[...], rtol=2e-2, atol=1e-3)


# -- full_precision: linen, NNX and Equinox ----------------------------------------


def dot_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(ls.autocast(fn))(*args)
    from loss_scale._jaxpr import equations

    return [str(e.outvars[0].aval.dtype) for e in equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]


def test_full_precision_of_a_linen_class_is_refused_and_of_an_instance_works():
    with pytest.raises(TypeError, match=r"not a class.*full_precision\(Dense\(\.\.\.\)\)"):
        ls.full_precision(nn.Dense)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            return ls.full_precision(nn.Dense(2))(h)

    model = Model()
    params = model.init(jax.random.key(0), X)
    assert dot_dtypes(model.apply, params, X) == ["float16", "float32"]


def test_full_precision_attention_fn_in_linen():
    attention = nn.MultiHeadDotProductAttention(num_heads=1, attention_fn=ls.full_precision(nn.dot_product_attention))
    x = jnp.ones((2, 4, 8))
    params = attention.init(jax.random.key(0), x)
    dtypes = dot_dtypes(attention.apply, params, x)
    # The projections in half precision, the attention's two products in float32.
    assert dtypes.count("float32") == 2 and dtypes.count("float16") == 4, dtypes


def test_full_precision_of_an_nnx_layer_and_an_equinox_layer():
    class Head(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return ls.full_precision(self.head)(self.body(x))

    with pytest.raises(TypeError, match="not a class"):
        ls.full_precision(nnx.Linear)
    assert dot_dtypes(lambda m, x: m(x), Head(nnx.Rngs(0)), X) == ["float16", "float32"]

    class EqxHead(eqx.Module):
        body: eqx.nn.Linear
        head: eqx.nn.Linear

        def __call__(self, x):
            return ls.full_precision(self.head)(self.body(x))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = EqxHead(eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2))
    assert dot_dtypes(lambda m, x: jax.vmap(m)(x), model, X) == ["float16", "float32"]

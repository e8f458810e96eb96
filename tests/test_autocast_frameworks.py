"""ls.autocast on models with no dtype plumbing: flax linen (``apply``
inside the loss), flax NNX (``nnx.grad`` of a module), Equinox (a module
whose activation is a leaf that is not an array), and the diagnostics:
``range_report`` of an autocast loss shows each operation's dtype at the
user's line."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls
from loss_scale._jaxpr import equations
from tests import _autocast_models as models

pytest.importorskip("flax")

from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
X = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
Y = jax.random.normal(jax.random.PRNGKey(1), (16, 1))


def product_dtypes(fn, *args):
    """The dtypes the products read (their operands); a product whose
    result a float32 operation reads returns float32 from them."""
    return {
        np.dtype(v.aval.dtype)
        for e in equations(jax.make_jaxpr(fn)(*args).jaxpr)
        if e.primitive.name == "dot_general"
        for v in e.invars
    }


def close(a, b, tol):
    return float(jnp.abs(a - b)) <= tol * float(jnp.abs(b))


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.gelu(nn.LayerNorm()(nn.Dense(32)(x))))


def test_flax_linen_apply_inside_the_loss():
    model = Linen()
    params = model.init(jax.random.PRNGKey(0), X)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    f16 = ls.autocast(loss)
    assert product_dtypes(f16, params, X, Y) == {F16}
    assert close(f16(params, X, Y), loss(params, X, Y), 5e-3)
    grads = jax.jit(jax.grad(f16))(params, X, Y)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


class NNX(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.ln = nnx.LayerNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.ln(self.l1(x))))


def test_flax_nnx_module_gradients():
    model = NNX(nnx.Rngs(0))

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    f16 = ls.autocast(loss)
    assert close(f16(model, X, Y), loss(model, X, Y), 5e-3)
    grads = nnx.grad(f16)(model, X, Y)
    grads32 = nnx.grad(loss)(model, X, Y)
    leaves, leaves32 = jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(grads32))
    assert {g.dtype for g in leaves} == {F32}
    for g, g32 in zip(leaves, leaves32, strict=True):
        assert float(jnp.max(jnp.abs(g - g32))) <= 3e-2 * float(jnp.max(jnp.abs(g32))) + 1e-6


def test_equinox_module_with_an_activation_leaf():
    mlp = eqx.nn.MLP(8, 1, 32, 2, activation=jax.nn.relu, key=jax.random.PRNGKey(0))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    f16 = ls.autocast(loss)
    assert close(f16(mlp, X, Y), loss(mlp, X, Y), 5e-3)
    grads = eqx.filter_jit(eqx.filter_grad(f16))(mlp, X, Y)
    arrays = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    assert arrays and {g.dtype for g in arrays} == {F32}
    params, static = eqx.partition(mlp, eqx.is_array)
    assert product_dtypes(lambda p, x, y: f16(eqx.combine(p, static), x, y), params, X, Y) == {F16}


def test_range_report_shows_each_operations_dtype_at_the_users_line():
    params, x, y = models.mlp_params(jax.random.PRNGKey(0)), *models.classification_batch(jax.random.PRNGKey(1))
    report = ls.range_report(ls.autocast(models.mlp_loss), params, x, y)
    rows = {(row.primitive, str(row.dtype)) for row in report.rows}
    assert ("dot_general", "float16") in rows
    assert ("exp", "float32") in rows or ("reduce_sum", "float32") in rows
    products = [row for row in report.rows if row.primitive == "dot_general"]
    assert all("_autocast_models.py" in row.where for row in products), [row.where for row in products]
    # Operations of a jnp function autocast entered keep its name.
    inside = [row for row in report.rows if row.primitive == "exp"]
    assert inside and all("log_softmax" in row.where for row in inside), [row.where for row in inside]
    plain = ls.range_report(models.mlp_loss, params, x, y)
    assert {str(row.dtype) for row in plain.rows} == {"float32"}

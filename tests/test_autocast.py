"""ls.autocast: a model written in float32 runs its products and
convolutions in half precision, its float32 list in float32, and keeps its
outputs' and gradients' dtypes; checked on the jaxpr (every operation's
dtype, nested bodies included), on the numbers (against float32 and
against the same model cast by hand), and through jit, grad, vmap, scan,
remat, cond, while, custom rules, full_precision, bfloat16 and a float16
training run with dynamic loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import loss_scale as ls
from loss_scale._autocast import FLOAT32, HALF
from loss_scale._jaxpr import equations
from tests import _autocast_models as models
from tests._compare import assert_trees_bitwise

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
KEY = jax.random.PRNGKey(0)


def all_equations(fn, *args):
    return list(equations(jax.make_jaxpr(fn)(*args).jaxpr))


def dtypes_of(variables):
    return [np.dtype(v.aval.dtype) for v in variables if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def assert_rewritten(eqns, half=F16, min_products=1, float32_list=True):
    """Every product/convolution reads ``half`` and writes ``half``, or
    float32 where a softmax reads its result (it returns its float32
    accumulation then); every operation of the float32 list reads and
    writes float32."""
    products = [e for e in eqns if e.primitive.name in HALF]
    assert len(products) >= min_products, [e.primitive.name for e in eqns]
    for e in products:
        assert set(dtypes_of(e.invars)) == {half}, e
        assert dtypes_of(e.outvars) in ([half], [F32]), e
    if not float32_list:
        return
    wide = [e for e in eqns if e.primitive.name in FLOAT32]
    assert wide, "the model has no float32-list operation"
    for e in wide:
        assert set(dtypes_of(e.invars) + dtypes_of(e.outvars)) <= {F32}, e


def operands_half(eqns, half=F16):
    """The products of ``eqns`` (at least one) read ``half``."""
    products = [e for e in eqns if e.primitive.name in HALF]
    return bool(products) and all(set(dtypes_of(e.invars)) == {half} for e in products)


def rel_err(a, b):
    return float(jnp.abs(a - b) / (jnp.abs(b) + 1e-12))


def max_rel_tree(a, b):
    errs = jax.tree.leaves(jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12), a, b))
    return float(max(errs))


MLP = (models.mlp_params(KEY), *models.classification_batch(jax.random.PRNGKey(1)))
BLOCK = (models.block_params(KEY), *models.token_batch(jax.random.PRNGKey(2)))
CNN = (
    models.cnn_params(KEY),
    jax.random.normal(jax.random.PRNGKey(3), (4, 1, 8, 8)),
    jax.nn.one_hot(jnp.arange(4) % 10, 10),
)


# -- the jaxpr: which dtype each operation runs in -------------------------------


@pytest.mark.parametrize(
    "loss, args",
    [(models.mlp_loss, MLP), (models.block_loss, BLOCK), (models.cnn_loss, CNN)],
    ids=["mlp", "block", "cnn"],
)
def test_products_in_half_and_float32_list_in_float32(loss, args):
    eqns = all_equations(ls.autocast(loss), *args)
    assert_rewritten(eqns)
    # The backward pass is JAX's derivative of the rewritten forward: the
    # transposed products are half products too. (Its sums are JAX's
    # transposes: a bias's gradient sums half cotangents, as a hand-cast
    # model's does.)
    grad_eqns = all_equations(jax.grad(ls.autocast(loss)), *args)
    n_forward = len([e for e in eqns if e.primitive.name in HALF])
    assert_rewritten(grad_eqns, min_products=2 * n_forward, float32_list=False)


def test_a_product_a_softmax_reads_returns_float32_and_the_others_half():
    # The MLP's hidden products feed products; its logits feed the
    # cross-entropy's log-softmax: float16 operands, float32 result.
    products = [e for e in all_equations(ls.autocast(models.mlp_loss), *MLP) if e.primitive.name in HALF]
    assert [dtypes_of(e.invars) for e in products] == [[F16, F16]] * len(products)
    assert [dtypes_of(e.outvars) for e in products] == [[F16]] * (len(products) - 1) + [[F32]]


def test_convolution_in_half():
    eqns = all_equations(ls.autocast(models.cnn_loss), *CNN)
    convs = [e for e in eqns if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 2 and all(set(dtypes_of(e.invars)) == {F16} for e in convs)


def test_softmax_and_layer_norm_statistics_stay_float32():
    eqns = all_equations(ls.autocast(models.block_loss), *BLOCK)
    exps = [e for e in eqns if e.primitive.name == "exp"]
    sums = [e for e in eqns if e.primitive.name == "reduce_sum"]
    rsqrts = [e for e in eqns if e.primitive.name == "rsqrt"]
    assert exps and sums and rsqrts
    assert all(dtypes_of(e.outvars) == [F32] for e in exps + sums + rsqrts)
    # The softmax's normalisation (a float32 result divided into float32)
    # stays float32: no division reads a half value and a float32 sum.
    for e in eqns:
        if e.primitive.name == "div":
            assert len(set(dtypes_of(e.invars))) == 1, e


def test_bias_activation_and_residual_follow_half_precision():
    eqns = all_equations(ls.autocast(models.mlp_loss), *MLP)
    adds = [e for e in eqns if e.primitive.name == "add"]
    # The bias added to each hidden product is cast to half where it is
    # read; the logits' bias feeds the softmax's float32 statistics, so that
    # addition runs in float32 (what a float32 operation reads is computed
    # in float32 back to the last product).
    assert [dtypes_of(e.outvars) for e in adds] == [[F16], [F16], [F32]]


# -- dtypes of outputs and gradients ----------------------------------------------


def test_outputs_keep_their_dtypes_and_gradients_are_float32():
    def fn(params, x):
        logits = models.mlp_logits(params, x)
        return logits, logits.astype(jnp.float16), jnp.argmax(logits, -1), {"n": jnp.sum(x > 0)}

    out = ls.autocast(fn)(MLP[0], MLP[1])
    ref = fn(MLP[0], MLP[1])
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, ref)
    grads = jax.grad(ls.autocast(models.mlp_loss))(*MLP)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


# -- numbers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss, hand_cast, args",
    [(models.mlp_loss, models.mlp_loss_hand_cast, MLP), (models.block_loss, models.block_loss_hand_cast, BLOCK)],
    ids=["mlp", "block"],
)
def test_close_to_float32_and_to_the_hand_cast_model(loss, hand_cast, args):
    value, grads = jax.value_and_grad(ls.autocast(loss))(*args)
    value32, grads32 = jax.value_and_grad(loss)(*args)
    value16, grads16 = jax.value_and_grad(hand_cast)(*args)
    assert rel_err(value, value32) < 5e-3
    assert rel_err(value, value16) < 5e-3
    assert max_rel_tree(grads, grads32) < 3e-2
    assert max_rel_tree(grads, grads16) < 3e-2
    # and it is not float32: the products rounded to float16
    assert float(value) != float(value32)


def test_float32_dtype_is_the_function_itself():
    assert ls.autocast(models.mlp_loss, dtype=jnp.float32) is models.mlp_loss


def test_without_a_product_bit_identical_values_and_gradients():
    def loss(x, y):
        z = jnp.tanh(x) * 3.0 + jnp.exp(-x)
        return jnp.mean(jax.nn.log_softmax(z) * y) + jnp.sum(jax.nn.gelu(x) ** 2)

    x, y = MLP[1], jnp.abs(MLP[1])
    assert_trees_bitwise(ls.autocast(loss)(x, y), loss(x, y))
    assert_trees_bitwise(jax.grad(ls.autocast(loss))(x, y), jax.grad(loss)(x, y))
    assert_trees_bitwise(jax.jit(ls.autocast(loss))(x, y), jax.jit(loss)(x, y))


# -- transformations and structured primitives ------------------------------------


def test_jit_grad_vmap():
    f = ls.autocast(models.mlp_loss)
    eager = jax.value_and_grad(f)(*MLP)
    jitted = jax.jit(jax.value_and_grad(f))(*MLP)
    assert rel_err(jitted[0], eager[0]) < 1e-3
    params, x, y = MLP
    per_example = jax.vmap(f, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
    assert per_example.shape == (x.shape[0],)
    assert rel_err(jnp.mean(per_example), eager[0]) < 5e-3
    eqns = all_equations(jax.vmap(f, in_axes=(None, 0, 0)), params, x[:, None], y[:, None])
    assert_rewritten(eqns)


def _stack(params):
    return jax.tree.map(lambda *a: jnp.stack(a), *params)


def scan_loss(stacked, x):
    def layer(h, wb):
        w, b = wb
        hw = h @ w
        return jnp.tanh(hw + b[None]), jnp.sum(hw)

    h, ys = lax.scan(layer, x, stacked)
    return jnp.mean(jnp.exp(h)) + jnp.mean(ys)


def remat_loss(params, x):
    step = jax.checkpoint(lambda h, w: jnp.tanh(h @ w), policy=jax.checkpoint_policies.dots_saveable)
    return jnp.mean(jnp.exp(step(step(x, params[0][0]), params[0][0])))


def cond_loss(params, x):
    w = params[0][0]
    h = lax.cond(jnp.sum(x) > 0, lambda a: jnp.tanh(a @ w), lambda a: jnp.sin(a @ w), x)
    return jnp.mean(jnp.exp(h))


def while_fn(params, x):
    w = params[0][0] / 8

    def body(carry):
        i, h = carry
        return i + 1, jnp.tanh(h @ w)

    return jnp.sum(jnp.exp(lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]))


def jit_loss(params, x):
    inner = jax.jit(lambda a, w: jax.nn.gelu(a @ w))
    return jnp.mean(jnp.exp(inner(inner(x, params[0][0]), params[0][0] / 4)))


SQUARE = [(jax.random.normal(KEY, (32, 32)) / 6, jnp.zeros(32))] * 3
XS = jax.random.normal(jax.random.PRNGKey(4), (16, 32))


@pytest.mark.parametrize(
    "fn, params",
    [(scan_loss, _stack(SQUARE)), (remat_loss, SQUARE), (cond_loss, SQUARE), (jit_loss, SQUARE)],
    ids=["scan", "remat", "cond", "jit"],
)
def test_bodies_rewritten_values_and_gradients(fn, params):
    f = ls.autocast(fn)
    eqns = all_equations(f, params, XS)
    assert_rewritten(eqns)
    nested = [e for e in eqns if e.primitive.name in HALF]
    top = [e for e in jax.make_jaxpr(f)(params, XS).jaxpr.eqns if e.primitive.name in HALF]
    if fn is jit_loss:
        # A jitted call is entered: its equations join the caller's.
        assert len(nested) == len(top) == 2
    else:
        assert len(nested) > len(top), "the products are inside the body"
    value, grads = jax.value_and_grad(f)(params, XS)
    value32, grads32 = jax.value_and_grad(fn)(params, XS)
    assert rel_err(value, value32) < 1e-2
    assert max_rel_tree(grads, grads32) < 5e-2
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert rel_err(jax.jit(f)(params, XS), value) < 1e-3


def test_while_body_rewritten():
    f = ls.autocast(while_fn)
    assert_rewritten(all_equations(f, SQUARE, XS))
    assert rel_err(f(SQUARE, XS), while_fn(SQUARE, XS)) < 1e-2
    tangent = jax.jvp(f, (SQUARE, XS), (SQUARE, XS))[1]
    assert rel_err(tangent, jax.jvp(while_fn, (SQUARE, XS), (SQUARE, XS))[1]) < 5e-2


def test_remat_keeps_its_policy():
    (remat,) = [
        e for e in jax.make_jaxpr(ls.autocast(remat_loss))(SQUARE, XS).jaxpr.eqns if "remat" in e.primitive.name
    ][:1]
    assert remat.params["policy"] is jax.checkpoint_policies.dots_saveable
    assert remat.params["prevent_cse"] is True


def test_custom_jvp_rule_kept():
    @jax.custom_jvp
    def f(a, w):
        return jnp.tanh(a @ w)

    @f.defjvp
    def f_jvp(primals, tangents):
        a, w = primals
        da, dw = tangents
        # A deliberately unusual rule: autocast must keep it.
        return f(a, w), 3.0 * (da @ w + a @ dw)

    def loss(w, x):
        return jnp.sum(f(x, w))

    w = SQUARE[0][0]
    got = jax.grad(ls.autocast(loss))(w, XS)
    want = jax.grad(loss)(w, XS)
    assert got.dtype == F32
    assert max_rel_tree(got, want) < 1e-6
    # The body, called without differentiation, is rewritten.
    assert operands_half(all_equations(ls.autocast(loss), w, XS))


def test_custom_vjp_rule_kept():
    @jax.custom_vjp
    def f(a, w):
        return jnp.sin(a @ w)

    def fwd(a, w):
        return f(a, w), (a, w)

    def bwd(res, g):
        a, w = res
        gg = 2.0 * g * jnp.cos(a @ w)  # twice the true derivative: a rule of its own
        return gg @ w.T, a.T @ gg

    f.defvjp(fwd, bwd)

    def loss(w, x):
        return jnp.sum(f(x, w))

    w = SQUARE[0][0]
    got = jax.grad(ls.autocast(loss))(w, XS)
    assert max_rel_tree(got, jax.grad(loss)(w, XS)) < 1e-6
    assert rel_err(ls.autocast(loss)(w, XS), loss(w, XS)) < 1e-2
    assert operands_half(all_equations(ls.autocast(loss), w, XS))


def test_relu_gelu_softplus_derivatives():
    def loss(w, x):
        h = x @ w
        return jnp.sum(jax.nn.relu(h) + jax.nn.gelu(h) + jax.nn.softplus(h))

    w = SQUARE[0][0]
    got = jax.grad(ls.autocast(loss))(w, XS)
    assert got.dtype == F32 and bool(jnp.all(jnp.isfinite(got)))
    assert max_rel_tree(got, jax.grad(loss)(w, XS)) < 2e-2


# -- full_precision, bfloat16, errors -----------------------------------------------


def test_full_precision_keeps_a_region_float32():
    def loss(params, x, y):
        h = jax.nn.relu(x @ params[0][0] + params[0][1][None])
        logits = ls.full_precision(lambda a: jax.jit(lambda b: b @ params[1][0])(a) + params[1][1][None])(h)
        return models.cross_entropy(logits @ params[2][0], y)

    eqns = all_equations(ls.autocast(loss), *MLP)
    # The region's product reads float32 operands; the others read float16.
    products = [dtypes_of(e.invars)[0] for e in eqns if e.primitive.name == "dot_general"]
    assert sorted(p.name for p in products) == ["float16", "float16", "float32"]
    # outside autocast it is the function itself
    assert_trees_bitwise(jax.grad(loss)(*MLP), jax.grad(lambda *a: loss(*a))(*MLP))


def test_full_precision_outputs_pull_followers_to_float32():
    def fn(w, x):
        a = x @ w
        b = ls.full_precision(jnp.tanh)(x)
        return a + b

    eqns = all_equations(ls.autocast(fn), SQUARE[0][0], XS)
    (add,) = [e for e in eqns if e.primitive.name == "add"]
    assert dtypes_of(add.outvars) == [F32]


def test_bfloat16():
    eqns = all_equations(ls.autocast(models.block_loss, dtype=jnp.bfloat16), *BLOCK)
    assert_rewritten(eqns, half=BF16)
    value = ls.autocast(models.block_loss, jnp.bfloat16)(*BLOCK)
    assert rel_err(value, models.block_loss(*BLOCK)) < 3e-2


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.int32, "float8_e4m3fn"])
def test_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match="autocast: dtype must be jnp.float16, jnp.bfloat16 or jnp.float32"):
        ls.autocast(models.mlp_loss, dtype=dtype)


def test_rejects_a_non_callable():
    with pytest.raises(TypeError, match="autocast: fun must be callable"):
        ls.autocast(3)
    with pytest.raises(TypeError, match="full_precision: fn must be callable"):
        ls.full_precision(None)


# -- arguments and effects ---------------------------------------------------------


def test_non_array_leaves_pass_through():
    def fn(params, x, *, activation, scale, training):
        h = activation(x @ params[0][0]) * scale
        return jnp.sum(h) if training else jnp.mean(h)

    kwargs = {"activation": jax.nn.tanh, "scale": 2.0, "training": True}
    got = ls.autocast(fn)(SQUARE, XS, **kwargs)
    assert rel_err(got, fn(SQUARE, XS, **kwargs)) < 1e-2
    assert (
        rel_err(
            ls.autocast(fn)(SQUARE, XS, **{**kwargs, "training": False}),
            fn(SQUARE, XS, **{**kwargs, "training": False}),
        )
        < 1e-2
    )


def test_opaque_operations_get_their_declared_dtypes():
    def fn(w, x, key):
        h = x @ w
        noise = jax.random.normal(key, h.shape)
        seen = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        return jnp.sum(seen + noise)

    f = ls.autocast(fn)
    eqns = all_equations(f, SQUARE[0][0], XS, KEY)
    (callback,) = [e for e in eqns if e.primitive.name == "pure_callback"]
    assert dtypes_of(callback.invars) == [F32]
    assert rel_err(f(SQUARE[0][0], XS, KEY), fn(SQUARE[0][0], XS, KEY)) < 1e-2


# -- composition with loss scaling ---------------------------------------------------


def test_composes_with_value_and_grad():
    params, x, y = MLP
    tx = ls.dynamic(optax.adam(1e-3))
    opt_state = tx.init(params)
    loss, scaled = ls.value_and_grad(ls.autocast(models.mlp_loss))(opt_state, params, x, y)
    assert rel_err(loss, models.mlp_loss(params, x, y)) < 5e-3
    assert {g.dtype for g in jax.tree.leaves(scaled)} == {F32}
    grads = jax.tree.map(lambda g: g / ls.get_scale(opt_state), scaled)
    assert max_rel_tree(grads, jax.grad(models.mlp_loss)(params, x, y)) < 3e-2


def test_policy_autocast():
    policy = ls.Policy.from_string("params=f32,compute=f16,output=f16")
    logits = policy.autocast(models.mlp_logits)(MLP[0], MLP[1])
    assert logits.dtype == F16
    eqns = all_equations(policy.autocast(models.mlp_logits), MLP[0], MLP[1])
    assert all(dtypes_of(e.outvars) == [F16] for e in eqns if e.primitive.name == "dot_general")  # none feeds float32
    same = ls.Policy.from_string("params=f32,compute=f32,output=f32").autocast(models.mlp_loss)
    assert_trees_bitwise(same(*MLP), models.mlp_loss(*MLP))


def test_float16_training_with_dynamic_loss_scaling_matches_float32():
    params0, x, y = MLP

    def train(loss_fn, tx, steps=200):
        state = tx.init(params0)

        @jax.jit
        def step(params, state):
            loss, grads = ls.value_and_grad(loss_fn)(state, params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        params = params0
        for _ in range(steps):
            params, state, loss = step(params, state)
        return float(models.mlp_loss(params, x, y)), state

    loss16, state16 = train(ls.autocast(models.mlp_loss), ls.dynamic(optax.adam(3e-3)))
    loss32, _ = train(models.mlp_loss, ls.no_op(optax.adam(3e-3)))
    first = float(models.mlp_loss(params0, x, y))
    assert loss32 < 0.2 * first
    assert abs(loss16 - loss32) < 0.05 * first, (loss16, loss32, first)
    assert float(ls.get_scale(state16)) >= 1.0


@pytest.mark.parametrize("fill", [float(jnp.finfo(jnp.float32).min), -1e9])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_constant_beyond_the_half_range_keeps_its_operation_in_float32(fill, jit):
    def scores(w, x):
        s = x @ w
        mask = jnp.tril(jnp.ones(s.shape, bool))
        return jnp.where(mask, s, fill)

    f = ls.autocast(scores)
    out = (jax.jit(f) if jit else f)(SQUARE[0][0], XS[:32])
    # The fill cast to float16 would be -inf; the select ran in float32.
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.min(out)) == np.float32(fill)


def test_each_value_is_cast_once_per_dtype():
    eqns = jax.make_jaxpr(ls.autocast(models.block_loss))(*BLOCK).jaxpr.eqns
    converts = [
        (id(e.invars[0]), str(e.params["new_dtype"]))
        for e in eqns
        if e.primitive.name == "convert_element_type" and not hasattr(e.invars[0], "val")
    ]
    assert len(converts) == len(set(converts))


def test_softmax_runs_in_float32_from_its_input():
    def attention_weights(w, x):
        return jax.nn.softmax(x @ w, axis=-1)

    eqns = all_equations(ls.autocast(attention_weights), SQUARE[0][0], XS)
    names = {e.primitive.name: dtypes_of(e.outvars) for e in eqns}
    # The logits: float16 operands, their float32 accumulation returned (the
    # softmax reads them), as jax.nn.dot_product_attention computes them.
    (product,) = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dtypes_of(product.invars) == [F16, F16] and names["dot_general"] == [F32]
    # Its derivative's products run in float16, as (a @ b).astype(float32)'s.
    grads = all_equations(jax.grad(lambda w, x: jnp.sum(ls.autocast(attention_weights)(w, x) ** 2)), SQUARE[0][0], XS)
    products = [e for e in grads if e.primitive.name == "dot_general"]
    forward = [e for e in products if dtypes_of(e.outvars) == [F32]]
    backward = [e for e in products if e not in forward]
    assert len(forward) == 1 and dtypes_of(forward[0].invars) == [F16, F16]
    assert backward and all(set(dtypes_of(e.invars) + dtypes_of(e.outvars)) == {F16} for e in backward)
    assert names["reduce_max"] == names["exp"] == names["reduce_sum"] == names["div"] == [F32]
    assert ls.autocast(attention_weights)(SQUARE[0][0], XS).dtype == F32


def test_under_and_around_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    w, x = SQUARE[0][0], XS

    def loss(w, x):
        return jnp.mean(jnp.exp(jnp.tanh(x @ w)))

    def per_shard(w, x):
        value, grad = jax.value_and_grad(ls.autocast(loss))(w, x)
        return jax.lax.pmean(value, "data"), jax.lax.pmean(grad, "data")

    mapped = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
    value, grad = mapped(w, x)
    assert rel_err(value, loss(w, x)) < 1e-2 and grad.dtype == F32

    def sharded_loss(w, x):
        h = jax.shard_map(lambda w, x: jnp.tanh(x @ w), mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(w, x)
        return jnp.mean(jnp.exp(h))

    eqns = all_equations(ls.autocast(sharded_loss), w, x)
    assert [dtypes_of(e.outvars) for e in eqns if e.primitive.name == "dot_general"] == [[F16]]  # tanh bounds it
    assert rel_err(ls.autocast(sharded_loss)(w, x), sharded_loss(w, x)) < 1e-2
    assert jax.grad(ls.autocast(sharded_loss))(w, x).dtype == F32

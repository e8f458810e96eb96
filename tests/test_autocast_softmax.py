"""Softmaxes whose probabilities are read in half precision: autocast keeps
them for the backward pass in half precision (``loss_scale/_autocast/_softmax.py``),
as a hand-cast model's float16 softmax does, and computes them in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls
from loss_scale._autocast._softmax import half_softmax

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


def softmax_by_hand(x, axis=-1):
    e = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


SOFTMAXES = {
    "jax.nn.softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "written out": softmax_by_hand,
}


@pytest.fixture(params=[False, True], ids=["inline", "custom_jvp"])
def softmax_form(request):
    """jax.nn.softmax as operations (jax < 0.11's default) or as its custom_jvp."""
    previous = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", request.param)
    yield request.param
    jax.config.update("jax_softmax_custom_jvp", previous)


def attention(params, x, softmax):
    q, k, v = x @ params["q"], x @ params["k"], x @ params["v"]
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None]
    probs = softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min))
    return jnp.mean(jnp.square(jnp.einsum("bqk,bkd->bqd", probs, v)))


def inputs(seed=0, scale=1.0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {n: jax.random.normal(k, (16, 16)) / 4 for n, k in zip("qkv", keys[:3], strict=True)}
    return params, scale * jax.random.normal(keys[3], (2, 8, 16))


def equations(fn, *args):
    from loss_scale._jaxpr import equations as every

    return list(every(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_probabilities_a_product_reads_are_half_and_kept_in_half(softmax_form, name):
    params, x = inputs()
    loss = ls.autocast(lambda p, x: attention(p, x, SOFTMAXES[name]))
    kept = [e for e in equations(loss, params, x) if e.primitive.name == "custom_vjp_call"]
    assert len(kept) == 1, "the softmax was not found"
    assert [v.aval.dtype for v in kept[0].outvars] == [F16]
    # The probabilities computed in float32 inside it: exp and the sum.
    inner = [e.primitive.name for e in equations(lambda x: half_softmax(x, (2,), jnp.float16), jnp.ones((2, 3, 3)))]
    assert "exp" in inner and "reduce_sum" in inner


def test_the_step_equals_float32_and_the_hand_cast_model(softmax_form):
    params, x = inputs()

    def hand_cast(p, x):
        p, x = jax.tree.map(lambda a: a.astype(jnp.float16), (p, x))
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
        causal = jnp.tril(jnp.ones((8, 8), bool))[None]
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float16).min), axis=-1)
        return jnp.mean(jnp.square(jnp.einsum("bqk,bkd->bqd", probs, v).astype(jnp.float32)))

    f32 = jax.grad(lambda p, x: attention(p, x, SOFTMAXES["jax.nn.softmax"]))(params, x)
    auto = jax.grad(ls.autocast(lambda p, x: attention(p, x, SOFTMAXES["jax.nn.softmax"])))(params, x)
    hand = jax.grad(hand_cast)(params, x)
    for key in "qkv":
        scale = float(jnp.max(jnp.abs(f32[key])))
        assert float(jnp.max(jnp.abs(auto[key] - f32[key]))) < 2e-2 * scale, key
        assert float(jnp.max(jnp.abs(auto[key] - hand[key]))) < 2e-2 * scale, key


def test_half_softmax_is_softmax_and_its_derivative():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5)) * 3
    g = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
    y, vjp = jax.vjp(lambda x: half_softmax(x, (1,), jnp.float16), x)
    y32, vjp32 = jax.vjp(lambda x: jax.nn.softmax(x, axis=1), x)
    assert y.dtype == F16
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, atol=1e-3)
    (dx,), (dx32,) = vjp(g.astype(jnp.float16)), vjp32(g)
    assert dx.dtype == F32  # the input's dtype
    np.testing.assert_allclose(dx, dx32, atol=3e-3)


def test_a_large_cotangent_on_a_zero_probability_is_no_nan():
    """y * (g - sum(y * g)) in float16 with g at float16's largest: the
    difference overflows to an infinity that a zero probability would turn
    into a NaN; written as y * g - y * sum it is exact and finite."""
    x = jnp.array([[0.0, -100.0, 5.0]], jnp.float16)  # exp(-100) is 0 in float16
    g = jnp.array([[-60000.0, 60000.0, 60000.0]], jnp.float16)
    _, vjp = jax.vjp(lambda x: half_softmax(x, (1,), jnp.float16), x)
    (dx,) = vjp(g)
    assert bool(jnp.all(jnp.isfinite(dx))), dx
    _, vjp32 = jax.vjp(lambda x: jax.nn.softmax(x, axis=1), x.astype(jnp.float32))
    # Within two float16 spacings at max|g| (32 at 6e4) of the float32
    # derivative, the hand-cast model's rounding of y * g.
    np.testing.assert_allclose(np.asarray(dx, np.float32), vjp32(g.astype(jnp.float32))[0], atol=64.0)
    assert float(dx[0, 1]) == 0.0


@pytest.mark.parametrize(
    "reader",
    [
        "entropy",  # log(probs): a FLOAT32 operation reads them
        "returned",  # an output of the function
    ],
)
def test_probabilities_a_float32_operation_or_the_caller_reads_stay_float32(softmax_form, reader):
    params, x = inputs()

    def fn(p, x):
        scores = jnp.einsum("bqd,bkd->bqk", x @ p["q"], x @ p["k"])
        probs = jax.nn.softmax(scores, axis=-1)
        if reader == "entropy":
            return -jnp.sum(probs * jnp.log(probs + 1e-9))
        return probs

    eqns = equations(ls.autocast(fn), params, x)
    assert not [e for e in eqns if e.primitive.name == "custom_vjp_call"]
    out = ls.autocast(fn)(params, x)
    assert out.dtype == F32
    np.testing.assert_allclose(out, fn(params, x), rtol=2e-2, atol=2e-3)


def test_a_softmax_under_full_precision_is_left_alone(softmax_form):
    params, x = inputs()

    def fn(p, x):
        probs = ls.full_precision(lambda s: jax.nn.softmax(s, axis=-1))(jnp.einsum("bqd,bkd->bqk", x, x))
        return jnp.mean(jnp.einsum("bqk,bkd->bqd", probs, x @ p["v"]))

    assert not [e for e in equations(ls.autocast(fn), params, x) if e.primitive.name == "custom_vjp_call"]


def test_a_softmax_inside_scan_keeps_half_probabilities(softmax_form):
    params, x = inputs()

    def fn(p, x):
        def layer(h, _):
            return h + jnp.einsum(
                "bqk,bkd->bqd", jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", h, h), axis=-1), h @ p["v"]
            ), None

        return jnp.mean(jnp.square(jax.lax.scan(layer, x, None, length=2)[0]))

    grad = jax.grad(ls.autocast(fn))(params, x)
    reference = jax.grad(fn)(params, x)
    assert [e for e in equations(ls.autocast(fn), params, x) if e.primitive.name == "custom_vjp_call"]
    scale = float(jnp.max(jnp.abs(reference["v"])))
    assert float(jnp.max(jnp.abs(grad["v"] - reference["v"]))) < 3e-2 * scale


@pytest.mark.parametrize("style", ["llama", "gemma3", "qwen3"])
def test_todays_decoders_under_autocast_give_float32s_loss_and_gradient(style):
    """The benchmark's decoders (benchmarks/_harness/decoders.py), tiny:
    autocast's loss and gradient near float32's, the hand-cast model's
    loss too."""
    import sys

    from tests._scripts import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _harness import decoders

    config = {"vocab": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "batch_size": 2}
    f32 = decoders.make_decoder(style, "f32", **config)
    hand = decoders.make_decoder(style, "mixed", **config)
    loss, grads = jax.value_and_grad(f32.loss_fn)(f32.params, f32.batch)
    auto_loss, auto_grads = jax.value_and_grad(ls.autocast(f32.loss_fn))(f32.params, f32.batch)
    assert abs(float(auto_loss) - float(loss)) < 1e-2 * float(loss)
    assert abs(float(hand.loss_fn(hand.params, hand.batch)) - float(loss)) < 1e-2 * float(loss)
    for a, b in zip(jax.tree.leaves(auto_grads), jax.tree.leaves(grads), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 5e-2 * float(jnp.max(jnp.abs(b))) + 1e-6


@pytest.mark.parametrize("transform", ["vmap", "checkpoint", "jit"])
def test_half_probabilities_under_vmap_checkpoint_and_jit(softmax_form, transform):
    """The attention, vmapped over its batch, under jax.checkpoint, or
    jitted: the softmax is still found, and the gradient is float32's."""
    params, x = inputs()

    def loss(p, x):
        return attention(p, x, SOFTMAXES["jax.nn.softmax"])

    if transform == "vmap":
        wrapped = lambda p, x: jnp.mean(jax.vmap(lambda xi: loss(p, xi[None]))(x))  # noqa: E731
    elif transform == "checkpoint":
        wrapped = jax.checkpoint(loss)
    else:
        wrapped = jax.jit(loss)
    auto = ls.autocast(wrapped)
    assert [e for e in equations(auto, params, x) if e.primitive.name == "custom_vjp_call"]
    grad, reference = jax.grad(auto)(params, x), jax.grad(wrapped)(params, x)
    for key in "qkv":
        scale = float(jnp.max(jnp.abs(reference[key])))
        assert float(jnp.max(jnp.abs(grad[key] - reference[key]))) < 2e-2 * scale, key

"""ls.autocast's rules where a float32 program meets the half range:
what a statistic reads is computed in float32 (squares, variances, norms,
an MSE's errors, a mask added to logits), constants beyond the half range
keep their operations in float32 wherever they are read, the decisions do
not depend on how the function is called (eagerly or under jit), a value
read inside a loop body and outside it, a body with effects, a function
without products (its own results, bit for bit) and what full_precision
accepts. The references are the same computations cast by hand the way
flax's half-precision layers do it: products in float16, statistics in
float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback

import loss_scale as ls
from loss_scale._autocast import FOLLOW
from loss_scale._jaxpr import equations
from tests._compare import assert_trees_bitwise

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
MAGNITUDES = (1.0, 300.0, 1000.0, 10000.0)
# float16 keeps 11 significant bits (a relative rounding of 2**-11, about
# 5e-4 per operation); a product of 8 terms and a statistic of a few more
# stay well inside 1e-2 of the largest value.
TOLERANCE = 1e-2

W = jnp.eye(8) + 0.01 * jax.random.normal(jax.random.key(0), (8, 8))
X = jax.random.normal(jax.random.key(1), (4, 8))
PROBE = jax.random.normal(jax.random.key(2), (4, 8))  # a cotangent: loss = sum(out * PROBE)


def jaxpr_equations(fn, *args):
    return list(equations(jax.make_jaxpr(fn)(*args).jaxpr))


def out_dtype(eqn):
    return np.dtype(eqn.outvars[0].aval.dtype)


def close(a, b, tol=TOLERANCE):
    return float(jnp.max(jnp.abs(a - b))) <= tol * (float(jnp.max(jnp.abs(b))) + 1e-30)


# -- what a statistic reads is float32 --------------------------------------------

STATISTICS = {
    "rms x**2": lambda h: h * lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6),
    "rms x*x": lambda h: h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6),
    "jnp.var": lambda h: (h - jnp.mean(h, -1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5),
    "linalg.norm": lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True),
    "mse at 800": lambda h: jnp.mean((h - (h + 800.0 * jnp.sign(PROBE))) ** 2, -1, keepdims=True),
}


def float32_fn(stat):
    return lambda w, x: stat(x @ w)


def by_hand(stat):
    """The product in float16, the statistic in float32 (flax's norms cast
    their input up; torch runs pow, the norms and mse_loss in float32)."""
    return lambda w, x: stat((x.astype(F16) @ w.astype(F16)).astype(F32))


def summed(fn):
    return lambda w, x: jnp.sum(fn(w, x) * PROBE)


@pytest.mark.parametrize("stat", list(STATISTICS), ids=list(STATISTICS))
@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_a_statistic_of_half_precision_values_is_computed_in_float32(stat, mode):
    fn, ref = float32_fn(STATISTICS[stat]), by_hand(STATISTICS[stat])
    f16 = ls.autocast(fn)
    if mode == "grad":
        f16, ref, fn = (jax.jit(jax.grad(summed(f))) for f in (f16, ref, fn))
    elif mode == "jit":
        f16, ref, fn = jax.jit(f16), jax.jit(ref), jax.jit(fn)
    failing = []
    for m in MAGNITUDES:
        got, want, exact = f16(W, m * X), ref(W, m * X), fn(W, m * X)
        assert bool(jnp.all(jnp.isfinite(want))), (stat, m)
        assert got.dtype == F32
        if not (bool(jnp.all(jnp.isfinite(got))) and close(got, want) and close(got, exact)):
            failing.append((m, float(jnp.max(jnp.abs(got - want)))))
    assert not failing, f"{stat} ({mode}) differs from the hand-cast reference at magnitudes {failing}"


def test_the_square_a_mean_reads_runs_in_float32_and_the_product_in_half():
    eqns = jaxpr_equations(ls.autocast(float32_fn(STATISTICS["rms x**2"])), W, X)
    by_name = {e.primitive.name: out_dtype(e) for e in eqns}
    assert by_name["dot_general"] == F16
    assert by_name["integer_pow"] == by_name["reduce_sum"] == by_name["rsqrt"] == F32


def test_activations_between_products_stay_half_unless_a_statistic_reads_them():
    def two_layers(w, x):
        return jax.nn.gelu(x @ w) @ w  # the activation feeds a product only

    eqns = jaxpr_equations(ls.autocast(two_layers), W, X)
    between = [e for e in eqns if e.primitive.name in FOLLOW]
    assert len(between) >= 4 and all(out_dtype(e) == F16 for e in between), [
        (e.primitive.name, out_dtype(e)) for e in between
    ]


def test_a_statistic_inside_a_jitted_function_or_a_loop_body_reaches_back_to_the_product():
    @jax.jit
    def rms(h):
        return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True))

    def in_jit(w, x):
        return rms(x @ w)

    def in_scan(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), jnp.mean(jnp.square(h @ w))

        _, stats = lax.scan(body, x, None, length=2)
        return jnp.sum(stats)

    for fn in (in_jit, in_scan):
        squares = [e for e in jaxpr_equations(ls.autocast(fn), W, X) if e.primitive.name in ("mul", "square")]
        assert squares and all(out_dtype(e) == F32 for e in squares[-1:]), fn.__name__
        got = jax.jit(ls.autocast(fn))(W, 1000.0 * X)
        assert bool(jnp.all(jnp.isfinite(got))) and close(got, fn(W, 1000.0 * X)), fn.__name__


# -- constants and arguments beyond the half range -----------------------------------

MASK = np.array([[0, 0, -1e9, 0] * 2, [-1e9] * 8, [0, -1e9, 0, 0] * 2, [0] * 8], np.float32)
WIDE = np.diag(np.full(8, 1e5, np.float32))


def mask_in_checkpoint(w, x):
    return jax.checkpoint(lambda w, x: jax.nn.softmax(x @ w + MASK))(w, x)


def wide_constant_product(w, x):
    return (x @ WIDE) @ w * 1e-5


def mask_argument(w, x, bias):
    return jax.nn.softmax(x @ w + bias)


def where_fill_in_cond(w, x):
    return lax.cond(True, lambda s: jnp.where(s > 0, s, -1e9), lambda s: s, x @ w)


@pytest.mark.parametrize(
    "fn, extra",
    [(mask_in_checkpoint, ()), (wide_constant_product, ()), (mask_argument, (MASK,)), (where_fill_in_cond, ())],
    ids=["closed-over mask in checkpoint", "closed-over 1e5 product", "-1e9 argument", "fill in cond"],
)
def test_values_beyond_the_half_range_give_float32s_answer_eagerly_and_under_jit(fn, extra):
    want = fn(W, X, *extra)
    eager = ls.autocast(fn)(W, X, *extra)
    jitted = jax.jit(ls.autocast(fn))(W, X, *extra)
    for got in (eager, jitted):
        assert bool(jnp.all(jnp.isfinite(got)))
        assert close(got, want), float(jnp.max(jnp.abs(got - want)))
    assert close(eager, jitted)


def test_what_is_decided_does_not_depend_on_an_arguments_value():
    # An argument is never looked at: a float32 input beyond the half range
    # added to a half-precision value (and read by no float32 operation)
    # becomes an infinity eagerly as under jit, as in a hand-cast model; the
    # mask above runs in float32 because a softmax reads it, whatever its
    # value.
    def biased(w, x, b):
        return x @ w + b

    big = jnp.zeros((1, 8)).at[0, 0].set(1e6)
    eager, jitted = ls.autocast(biased)(W, X, big), jax.jit(ls.autocast(biased))(W, X, big)
    by_hand = (X.astype(F16) @ W.astype(F16) + big.astype(F16)).astype(F32)
    assert np.array_equal(np.isfinite(eager), np.isfinite(jitted))
    assert np.array_equal(np.isfinite(eager), np.isfinite(by_hand))


# -- a weight read inside a loop body and outside it ---------------------------------


# Read inside the body first (the cast is made in the body's trace), then
# outside; and outside first, then inside.
def tied_scan(w, x):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
    return jnp.sum(h @ w)


def tied_scan_outside_first(w, x):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x @ w, None, length=3)
    return jnp.sum(h)


def tied_fori(w, x):
    return jnp.sum(lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x) @ w)


def tied_while(w, x):
    _, h = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))
    return jnp.sum(h @ w)


def siamese(w, x):
    # The same encoder inside a checkpoint and a cond, and outside both.
    encode = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
    return jnp.sum(lax.cond(True, lambda x: jnp.tanh(x @ w), lambda x: x, x) * encode(w, x) * (x @ w))


@pytest.mark.parametrize(
    "fn",
    [tied_scan, tied_scan_outside_first, tied_fori, tied_while, siamese],
    ids=["scan", "scan-outside-first", "fori_loop", "while_loop", "checkpoint-and-cond"],
)
@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_a_weight_read_inside_a_loop_body_and_outside_it(fn, mode):
    if mode == "grad" and fn is tied_while:
        fn_f16, ref = jax.jit(jax.jacfwd(ls.autocast(fn))), jax.jit(jax.jacfwd(fn))  # no reverse mode for while
    elif mode == "grad":
        fn_f16, ref = jax.jit(jax.grad(ls.autocast(fn))), jax.jit(jax.grad(fn))
    else:
        fn_f16, ref = ls.autocast(fn), fn
        if mode == "jit":
            fn_f16 = jax.jit(fn_f16)
    got = fn_f16(W / 2, X)
    assert close(got, ref(W / 2, X), tol=2e-2)


# -- effects -----------------------------------------------------------------------


def test_a_body_with_an_effect_is_rewritten_and_its_effect_still_happens():
    seen = []

    def record(v):
        seen.append(float(v))

    def in_scan(w, x):
        def body(h, _):
            jax.debug.callback(record, jnp.sum(h))
            return h @ w, None

        return jnp.sum(lax.scan(body, x, None, length=2)[0])

    def in_checkpoint(w, x):
        def body(w, x):
            jax.debug.print("{s}", s=jnp.sum(x))
            return x @ w

        return jnp.sum(jax.checkpoint(body)(w, x))

    def in_cond(w, x):
        def taken(x):
            io_callback(record, None, jnp.sum(x))
            return x @ w

        return jnp.sum(lax.cond(True, taken, lambda x: x, x))

    for fn in (in_scan, in_checkpoint, in_cond):
        products = [e for e in jaxpr_equations(ls.autocast(fn), W, X) if e.primitive.name == "dot_general"]
        assert products and all({np.dtype(v.aval.dtype) for v in e.invars} == {F16} for e in products), fn.__name__
    seen.clear()
    jax.jit(ls.autocast(in_scan))(W, X)
    assert len(seen) == 2
    jax.jit(ls.autocast(in_cond))(W, X)
    assert len(seen) == 3


# -- a function without products: its own results -----------------------------------


def no_products(x):
    h = jnp.sin(x) * 3.0
    return jnp.sum(jnp.exp(h)) / 7.0 + jnp.var(h) + jnp.sum(lax.cumsum(h))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_function_without_products_gives_its_own_results_bit_for_bit(jit):
    x = jax.random.normal(jax.random.key(3), (1000,))
    wrap = jax.jit if jit else (lambda f: f)
    got = wrap(jax.value_and_grad(ls.autocast(no_products)))(x)
    assert_trees_bitwise(got, wrap(jax.value_and_grad(no_products))(x))

    def mixed(x):
        return jnp.sum(x), jnp.all(x > -10), 3

    out, ref = ls.autocast(mixed)(x), mixed(x)
    assert [type(o) for o in out] == [type(o) for o in ref]


def test_constants_a_function_returns_come_back_as_arrays_of_their_dtypes():
    def with_product(w, x):
        return jnp.sum(x @ w), True, jnp.float32(2.0), 1

    out = ls.autocast(with_product)(W, X)
    ref = jax.jit(with_product)(W, X)
    assert all(isinstance(o, jax.Array) for o in out)
    assert [o.dtype for o in out] == [o.dtype for o in ref]


# -- full_precision ----------------------------------------------------------------


class Head:
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x @ self.w


def test_full_precision_refuses_a_class_and_says_what_to_wrap():
    with pytest.raises(TypeError, match=r"not a class.*ls\.full_precision\(Head\(\.\.\.\)\)\(x\)"):
        ls.full_precision(Head)


def test_full_precision_of_an_instance_keeps_its_calls_in_float32():
    def loss(w, x):
        return jnp.sum(ls.full_precision(Head(w))(x @ w))

    dtypes = [out_dtype(e) for e in jaxpr_equations(ls.autocast(loss), W, X) if e.primitive.name == "dot_general"]
    assert dtypes == [F16, F32]

"""``ls.value_and_grad`` against ``jax.value_and_grad``: for every argnums,
has_aux and dtype, the value is jax's and the gradients are jax's times the
scale; misuse raises jax's error."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scale as ls
from tests._compare import assert_trees_close

SCALE = 2.0**4
DTYPES = ["float32", "float16", "bfloat16", "float64"]


def make_args(dtype):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.uniform(0.5, 1.5, (3,)), dtype),
        {"w": jnp.asarray(rng.uniform(-1, 1, (3, 2)), dtype), "b": jnp.asarray(0.25, dtype)},
        jnp.asarray(rng.uniform(-1, 1, (2,)), dtype),
    )


def loss_fn(a, p, c, *, shift=0.5):
    return jnp.sum((a @ p["w"] + p["b"] - shift) * c) ** 2


def loss_with_aux(a, p, c, *, shift=0.5):
    return loss_fn(a, p, c, shift=shift), {"norm": jnp.sum(a**2), "count": 3}


ARGNUMS = [0, 1, 2, -1, -2, -3, (0, 2), (-1, 0), (1,), ()]


def state():
    return ls.static(optax.sgd(1.0), SCALE).init(jnp.zeros(1))


# The two sides are two programs (ours multiplies the loss by the scale in
# float32 and sends the cotangent ``scale`` back, jax's sends 1), and XLA fuses
# each its own way: in 16 bits, where a CPU with float16 arithmetic
# (AVX512-FP16) contracts a multiply and an add that share a kernel into one
# rounding, they may round differently. A value or gradient of ``loss_fn``
# goes through about 8 roundings (the 3-term dot, bias, shift, weight, 2-term
# sum, square and its derivative, the outer product), which either side may
# take differently: 2 * 8 units of roundoff. 32 and 64 bits: exact.
ROUNDINGS = 16
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def rtol(dtype):
    """The relative tolerance in ``dtype``: equal in 32 and 64 bits; within
    ``ROUNDINGS`` roundings in 16 bits."""
    return ROUNDINGS * UNIT_ROUNDOFF.get(dtype, 0.0)


def assert_scaled(ours, theirs, dtype):
    assert [g.dtype for g in jax.tree.leaves(ours)] == [r.dtype for r in jax.tree.leaves(theirs)]
    # A power-of-two scale commutes with rounding: the scaled gradients are
    # jax's times the scale, exactly where both programs round alike.
    scaled = jax.tree.map(lambda r: np.asarray(r, np.float64) * SCALE, theirs)
    assert_trees_close(ours, scaled, rtol=rtol(dtype), atol=0, check_dtypes=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("argnums", ARGNUMS, ids=str)
def test_value_and_grad_equals_jax_times_the_scale(dtype, has_aux, argnums):
    with jax.enable_x64(dtype == "float64"):
        fn = loss_with_aux if has_aux else loss_fn
        args = make_args(dtype)
        if argnums == ():
            with pytest.raises(Exception) as theirs:
                jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)(*args, shift=0.25)
            with pytest.raises(type(theirs.value)):
                ls.value_and_grad(fn, argnums=argnums, has_aux=has_aux)(state(), *args, shift=0.25)
            return
        # Both compiled: XLA may fuse 16-bit arithmetic and round once, where
        # op-by-op execution rounds after every op.
        value, grads = jax.jit(ls.value_and_grad(fn, argnums=argnums, has_aux=has_aux))(state(), *args, shift=0.25)
        ref_value, ref_grads = jax.jit(jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux))(*args, shift=0.25)
        if has_aux:
            assert int(value[1]["count"]) == 3
        assert_trees_close(value, ref_value, rtol=rtol(dtype), atol=0)
        assert_scaled(grads, ref_grads, dtype)


@settings(max_examples=25, deadline=None)
@given(
    n_args=st.integers(1, 4),
    data=st.data(),
    has_aux=st.booleans(),
)
def test_hypothesis_argnums_mean_what_they_mean_in_jax(n_args, data, has_aux):
    picks = st.integers(-n_args, n_args - 1)
    argnums = data.draw(st.one_of(picks, st.lists(picks, min_size=1, max_size=n_args, unique_by=lambda i: i % n_args)))
    argnums = tuple(argnums) if isinstance(argnums, list) else argnums
    args = [jnp.full((2,), float(i + 1)) for i in range(n_args)]

    def fn(*xs):
        loss = sum(jnp.sum(x * (i + 1)) ** 2 for i, x in enumerate(xs))
        return (loss, len(xs)) if has_aux else loss

    value, grads = ls.value_and_grad(fn, argnums=argnums, has_aux=has_aux)(state(), *args)
    ref_value, ref_grads = jax.value_and_grad(fn, argnums=argnums, has_aux=has_aux)(*args)
    assert jax.tree.structure(value) == jax.tree.structure(ref_value)
    assert_scaled(grads, ref_grads, "float32")


BAD_OUTPUTS = {
    "integer loss": (lambda a: (a * 2).astype(jnp.int32), False),
    "bool loss": (lambda a: a > 1, False),
    "complex loss": (lambda a: a * 1j, False),
    "vector loss": (lambda a: jnp.stack([a, a]), False),
    "None": (lambda a: None, False),
    "aux: a bare scalar": (lambda a: a, True),
    "aux: a vector": (lambda a: jnp.stack([a, a]), True),
    "aux: a 3-tuple": (lambda a: (a, 1, 2), True),
    "aux: (vector, aux)": (lambda a: (jnp.stack([a]), 1), True),
    "aux: (int loss, aux)": (lambda a: (a.astype(jnp.int32), 1), True),
}


@pytest.mark.parametrize("name", list(BAD_OUTPUTS))
def test_misuse_raises_what_jax_raises(name):
    fn, has_aux = BAD_OUTPUTS[name]
    with pytest.raises(Exception) as theirs:
        jax.value_and_grad(fn, has_aux=has_aux)(jnp.float32(2.0))
    with pytest.raises(type(theirs.value)) as ours:
        ls.value_and_grad(fn, has_aux=has_aux)(state(), jnp.float32(2.0))
    # The same message, up to the repr of the traced value it quotes.
    assert str(ours.value).split(" with value ")[0] == str(theirs.value).split(" with value ")[0]


@pytest.mark.parametrize(
    ("argnums", "args", "allow_int"),
    [(5, (1.0, 2.0), False), (-3, (1.0, 2.0), False), (0, (1, 2.0), False), ((0, 5), (1.0, 2.0), False)],
)
def test_bad_arguments_raise_what_jax_raises(argnums, args, allow_int):
    def fn(a, b):
        return a * b

    args = tuple(jnp.asarray(a) for a in args)
    with pytest.raises(Exception) as theirs:
        jax.value_and_grad(fn, argnums=argnums, allow_int=allow_int)(*args)
    with pytest.raises(type(theirs.value)) as ours:
        ls.value_and_grad(fn, argnums=argnums, allow_int=allow_int)(state(), *args)
    assert str(ours.value) == str(theirs.value)


def test_negative_argnums_never_reach_the_scale():
    # argnums=-1 used to differentiate the hidden scale argument.
    for n in range(1, 4):
        args = [jnp.float32(i + 2) for i in range(n)]
        for k in itertools.chain(range(n), range(-n, 0)):
            _, g = ls.value_and_grad(lambda *xs: jnp.prod(jnp.stack(xs)), argnums=k)(state(), *args)
            _, ref = jax.value_and_grad(lambda *xs: jnp.prod(jnp.stack(xs)), argnums=k)(*args)
            assert float(g) == float(ref) * SCALE

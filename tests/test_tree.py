"""all_finite, unscaling and the per-leaf finite check on trees users have."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from loss_scale._check import gradient_stats
from loss_scale._unscale import unscale_leaf, unscale_tree


def leaf_finite_flags(tree, scale):
    return list(gradient_stats(tree, scale).leaf_finite)


FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_finds_any_non_finite_element(dtype, bad):
    clean = {"a": jnp.ones((3, 4), dtype), "b": [jnp.zeros(5, dtype), jnp.arange(3)]}
    assert bool(jax.jit(ls.all_finite)(clean))
    for path in (("a",), ("b", 0)):
        leaf = clean[path[0]] if len(path) == 1 else clean[path[0]][path[1]]
        poisoned = leaf.reshape(-1).at[-1].set(bad).reshape(leaf.shape)
        tree = jax.tree_util.tree_map(lambda x, p=poisoned, t=leaf: p if x is t else x, clean)
        assert not bool(jax.jit(ls.all_finite)(tree))


def test_all_finite_passes_over_integers_none_masked_and_empty():
    tree = {"i": jnp.array([2**31 - 1], jnp.int32), "n": None, "m": optax.MaskedNode(), "b": jnp.array([True])}
    assert bool(ls.all_finite(tree))
    assert bool(ls.all_finite({}))
    assert bool(ls.all_finite([jnp.zeros((0, 3))]))
    assert ls.all_finite({}).dtype == jnp.bool_ and ls.all_finite({}).shape == ()


def test_mixed_precision_tree_unscales_in_float32_and_keeps_dtypes():
    scale = jnp.float32(2.0**15)
    tree = {
        "h": jnp.array([2.0**-24 * 2**15, 3.0], jnp.float16),
        "b": jnp.array([1.0, 2.0**15], jnp.bfloat16),
        "f": jnp.array([3.0, 6.0], jnp.float32),
        "i": jnp.array([7, 8], jnp.int32),
        "none": None,
    }
    out = jax.jit(unscale_tree)(tree, scale)
    assert {k: v.dtype for k, v in out.items() if v is not None} == {
        k: v.dtype for k, v in tree.items() if v is not None
    }
    # 2**-24 is float16's smallest subnormal: dividing in float16 arithmetic
    # would keep it, computing 3 / 2**15 in float32 then casting gives the
    # correctly rounded float16 value.
    np.testing.assert_array_equal(out["h"], np.float16([2.0**-24, 3.0 / 2**15]))
    np.testing.assert_array_equal(out["b"], jnp.array([2.0**-15, 1.0], jnp.bfloat16))
    np.testing.assert_array_equal(out["f"], np.float32([3.0, 6.0]) / 2**15)
    np.testing.assert_array_equal(out["i"], tree["i"])
    assert out["none"] is None


@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**15, 2.0**-10, 1e-30, 2.0**127, 3e38])
def test_unscale_multiplies_by_the_reciprocal_without_flushing(scale):
    x = np.float32([1.0, 0.7, 0.123456, 1e-3])
    s = np.float32(scale)
    scaled = np.float32(np.float64(x) * np.float64(s))
    got = np.asarray(jax.jit(unscale_leaf)(jnp.asarray(scaled), jnp.float32(s)))
    if scale <= 2.0**126:
        # torch's unscale: x * (1 / s), the reciprocal rounded to float32.
        expected = np.float32(np.float64(scaled) * np.float64(np.float32(1 / np.float64(s))))
        np.testing.assert_array_equal(got, expected)
    # No flush to zero, and within float32 rounding of the true quotient.
    np.testing.assert_allclose(got, np.float64(scaled) / np.float64(s), rtol=2.0**-22)


@pytest.mark.parametrize("dtype", FLOATS)
def test_finite_check_sees_overflow_that_the_unscale_creates(dtype):
    # A finite gradient divided by a scale below 1 can overflow its dtype.
    big = float(jnp.finfo(dtype).max)
    tree = [jnp.array([big / 2], dtype)]
    assert bool(leaf_finite_flags(tree, jnp.float32(1.0))[0])
    assert not bool(leaf_finite_flags(tree, jnp.float32(0.25))[0])
    assert not np.isfinite(np.float32(unscale_tree(tree, jnp.float32(0.25))[0][0]))


def test_finite_check_agrees_with_the_unscale_elementwise():
    # Random magnitudes around the overflow threshold, float16, many scales.
    rng = np.random.default_rng(0)
    for scale in [0.5, 0.75, 1.0, 1.5, 2.0**-3]:
        x = jnp.asarray(rng.uniform(0, 65504, size=200).astype(np.float16))
        flag = bool(leaf_finite_flags([x], jnp.float32(scale))[0])
        assert flag == bool(np.all(np.isfinite(np.asarray(unscale_leaf(x, jnp.float32(scale)), np.float32))))


def test_float64_leaves_with_x64():
    with jax.enable_x64(True):
        x = jnp.array([1e300, 3.0], jnp.float64)
        assert bool(ls.all_finite([x]))
        out = unscale_tree([x], jnp.float32(4.0))[0]
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(out, [2.5e299, 0.75])
        assert not bool(leaf_finite_flags([x], jnp.float32(2.0**-100))[0])
        # The reciprocal of a scale that is not a power of two is taken in
        # float64 for float64 leaves (a float32 1/3 is off in the 8th digit).
        y = jnp.array([0.1, 7.0, 1e-200], jnp.float64)
        got = np.asarray(unscale_tree([y], jnp.float32(3.0))[0])
        np.testing.assert_array_equal(got, np.asarray(y) * (1 / np.float64(3.0)))


def test_leaf_flags_keep_leaf_order_across_dtypes_and_integer_leaves():
    # Maxima are unscaled one dtype group at a time; the flags and the maximum
    # must still line up with jax.tree.leaves.
    tree = [
        jnp.ones(3),
        jnp.arange(3),
        jnp.array([1.0, jnp.inf], jnp.float16),
        jnp.full((2,), 5.0),
        jnp.array([jnp.nan], jnp.bfloat16),
        jnp.array([7.0], jnp.bfloat16),
    ]
    stats = gradient_stats(tree, jnp.float32(2.0))
    assert list(stats.leaf_finite) == [True, True, False, True, False, True]
    clean = [tree[0], tree[1], jnp.array([1.0, 3.0], jnp.float16), tree[3], jnp.array([9.0], jnp.bfloat16)]
    stats = gradient_stats(clean, jnp.float32(2.0))
    assert list(stats.leaf_finite) == [True] * 5 and float(stats.grad_max) == 4.5


def test_complex_leaves_unscale_both_parts_in_their_own_dtype():
    x = jnp.array([3 + 4j, -1e30 + 2e-30j, 0.5j], jnp.complex64)
    got = np.asarray(unscale_tree([x], jnp.float32(4.0))[0])
    assert got.dtype == np.complex64
    np.testing.assert_array_equal(got, np.asarray(x) / np.complex64(4.0))

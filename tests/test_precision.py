"""The mixed-precision policy and the choice of loss scaling per dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


# Parsing.


@pytest.mark.parametrize(
    "text, expected",
    [
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("p=f32,c=f16,o=f32", (F32, F16, F32)),
        ("params=full,compute=half,output=full", (F32, F16, F32)),
        ("param=fp32,compute=bf16,outputs=fp16", (F32, BF16, F16)),
        (" Compute = BF16 , P = F32 ", (F32, BF16, F32)),
        ("o=bfloat16,c=float16,p=float64", (F64, F16, BF16)),
        ("c=f16", (F32, F16, F32)),
        ("output=f16", (F32, F32, F16)),
        ("bf16", (BF16, BF16, BF16)),
        ("float32", (F32, F32, F32)),
    ],
)
def test_from_string(text, expected):
    policy = ls.Policy.from_string(text)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_str_round_trips():
    policy = ls.Policy.from_string("p=f32,c=bf16,o=f16")
    assert str(policy) == "params=float32,compute=bfloat16,output=float16"
    assert ls.Policy.from_string(str(policy)) == policy


@pytest.mark.parametrize(
    "text, message",
    [
        ("params=float32,compute=float8,output=float32", r"unknown dtype 'float8' for compute"),
        ("params=int32", r"unknown dtype 'int32' for params"),
        ("params=float32,kompute=float16", r"unknown key 'kompute'"),
        ("params=float32,compute", r"expected 'key=dtype' but got 'compute'"),
        ("params=float32,,compute=f16", r"expected 'key=dtype' but got ''"),
        ("params=", r"expected 'key=dtype' but got 'params='"),
        ("=f16", r"expected 'key=dtype' but got '=f16'"),
        ("c=f16,compute=bf16", r"compute is given twice"),
        ("", r"empty policy string"),
        ("   ", r"empty policy string"),
        ("quarter", r"unknown dtype 'quarter' for params, compute and output"),
    ],
)
def test_from_string_errors_name_the_bad_part(text, message):
    with pytest.raises(ValueError, match=message):
        ls.Policy.from_string(text)


def test_from_string_error_quotes_the_whole_string():
    with pytest.raises(ValueError, match=r"in policy string 'p=f32,c=f17'"):
        ls.Policy.from_string("p=f32,c=f17")


def test_from_string_rejects_non_strings():
    with pytest.raises(TypeError, match="must be a str"):
        ls.Policy.from_string(jnp.float16)


# Construction.


def test_constructor_accepts_dtypes_and_names():
    policy = ls.Policy(param_dtype=jnp.float32, compute_dtype="f16", output_dtype=np.float32)
    assert policy == ls.Policy.from_string("c=f16")
    assert hash(policy) == hash(ls.Policy.from_string("c=f16"))
    assert ls.Policy() == ls.Policy.from_string("float32")


def test_constructor_rejects_non_floating_dtypes():
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype, got int32"):
        ls.Policy(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="unknown dtype 'f12' for param_dtype"):
        ls.Policy(param_dtype="f12")
    with pytest.raises(TypeError, match="output_dtype must be a dtype"):
        ls.Policy(output_dtype=object())
    with pytest.raises(TypeError, match="compute_dtype must be a dtype or a dtype name, got None"):
        ls.Policy(compute_dtype=None)


def test_policy_is_frozen():
    with pytest.raises(AttributeError):
        ls.Policy().compute_dtype = F16


# Casting.


def test_casts_touch_only_floating_leaves():
    policy = ls.Policy.from_string("p=f32,c=bf16,o=f16")
    tree = {
        "w": jnp.ones((2, 3), jnp.float32),
        "h": jnp.ones(2, jnp.float16),
        "ids": jnp.arange(3),
        "mask": jnp.array([True, False]),
        "z": jnp.ones(2, jnp.complex64),
        "lr": 0.5,
        "none": None,
        "np": np.ones(2, np.float64),
    }
    out = policy.cast_to_compute(tree)
    assert out["w"].dtype == BF16 and out["h"].dtype == BF16 and out["np"].dtype == BF16
    assert out["ids"] is tree["ids"] and out["mask"] is tree["mask"] and out["z"] is tree["z"]
    assert out["lr"] == 0.5 and isinstance(out["lr"], float) and out["none"] is None
    assert policy.cast_to_param(out)["w"].dtype == F32
    assert policy.cast_to_output(out)["w"].dtype == F16
    assert policy.cast_to_output(out)["ids"].dtype == tree["ids"].dtype


def test_cast_to_same_dtype_returns_the_leaf_itself():
    x = jnp.ones(3)
    assert ls.Policy().cast_to_compute({"x": x})["x"] is x


def test_cast_keeps_numpy_arrays_on_host():
    out = ls.Policy(compute_dtype="f16").cast_to_compute(np.ones(3, np.float32))
    assert isinstance(out, np.ndarray) and out.dtype == F16


def test_gradients_through_cast_to_compute_arrive_in_param_dtype():
    policy = ls.Policy.from_string("p=f32,c=f16,o=f32")
    params = {"w": jnp.ones(4), "step": jnp.array(0)}

    def loss_fn(w):
        p = policy.cast_to_compute({"w": w})
        return policy.cast_to_output(jnp.sum(p["w"] * 2))

    assert loss_fn(params["w"]).dtype == F32
    assert jax.grad(loss_fn)(params["w"]).dtype == F32


# Choosing the loss scaling.


def test_for_dtype_float16_is_dynamic():
    params = jnp.zeros(2)
    tx = ls.for_dtype(optax.sgd(1.0), jnp.float16, initial_scale=8.0, growth_interval=3)
    state = tx.init(params)
    assert float(ls.get_scale(state)) == 8.0
    _, state = tx.update(jnp.array([8.0, jnp.inf]), state, params)
    assert bool(state.skipped) and float(ls.get_scale(state)) == 4.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "bf16", "float32", jnp.float32, np.float64])
def test_for_dtype_wide_range_dtypes_are_no_op(dtype):
    params = jnp.zeros(2)
    tx = ls.for_dtype(optax.sgd(1.0), dtype, initial_scale=8.0)
    state = tx.init(params)
    assert float(ls.get_scale(state)) == 1.0
    updates, new_state = tx.update(jnp.array([1.0, 2.0]), state, params)
    np.testing.assert_array_equal(updates, [-1.0, -2.0])
    # The inner update alone: the counters and the record pass through.
    for old, new in zip(
        jax.tree.leaves(state._replace(inner_state=None)),
        jax.tree.leaves(new_state._replace(inner_state=None)),
        strict=True,
    ):
        assert old is new


def test_for_dtype_state_layout_does_not_depend_on_dtype():
    """Every dtype's state saves the same leaves (one checkpoint restores
    under any of them); bfloat16's and float32's scale is the constant 1 of
    their layout, float16's a word that its rule moves."""
    params = {"w": jnp.zeros((3, 2))}
    states = {dtype: ls.for_dtype(optax.adam(1e-3), dtype).init(params) for dtype in ("f16", "bf16", "f32")}
    saved = {
        dtype: tuple((jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in jax.tree_util.tree_flatten_with_path(s)[0])
        for dtype, s in states.items()
    }
    assert len(set(saved.values())) == 1
    assert [s.packed.layout.fixed_scale for s in states.values()] == [None, 1.0, 1.0]
    # The float16 state's leaves, restored into the bfloat16 state's tree.
    restored = jax.tree.unflatten(jax.tree.structure(states["bf16"]), jax.tree.leaves(states["f16"]))
    assert float(restored.scale) == 1.0 and int(restored.skipped_steps) == 0


def test_for_dtype_validates_dynamic_settings_for_every_dtype():
    with pytest.raises(ValueError, match="growth_factor"):
        ls.for_dtype(optax.sgd(1.0), "bf16", growth_factor=0.5)
    with pytest.raises(TypeError):
        ls.for_dtype(optax.sgd(1.0), "f32", growth_intervall=10)


def test_for_dtype_rejects_dtypes_without_a_rule():
    with pytest.raises(ValueError, match="no loss-scaling rule for float8_e4m3fn"):
        ls.for_dtype(optax.sgd(1.0), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        ls.for_dtype(optax.sgd(1.0), jnp.int8)


@pytest.mark.parametrize(
    "text, scaled",
    [("c=f16", True), ("p=f16,c=f16,o=f16", True), ("o=f16", True), ("c=bf16", False), ("f32", False)],
)
def test_policy_loss_scaling(text, scaled):
    tx = ls.Policy.from_string(text).loss_scaling(optax.sgd(1.0), initial_scale=64.0)
    assert float(ls.get_scale(tx.init(jnp.zeros(1)))) == (64.0 if scaled else 1.0)


def test_float16_gradients_survive_with_the_chosen_scaling():
    # d loss / d w = a * b = 2**-30 per element, below half of float16's
    # smallest subnormal (2**-25): computed in float16 without scaling, the
    # backward pass rounds it to 0. (a and b are inputs, not constants: XLA
    # folds constant float16 factors into one, which underflows by itself, so
    # they are passed to jit as arguments.)
    policy = ls.Policy.from_string("p=f32,c=f16,o=f32")
    params = jnp.ones(64)
    a, b = jnp.full(64, 2.0**-20), jnp.full(64, 2.0**-10)

    def loss_fn(w, a, b):
        w, a, b = policy.cast_to_compute((w, a, b))
        return policy.cast_to_output(jnp.sum(w * a * b))

    @jax.jit
    def true_grads(state, params, a, b):
        _, grads = ls.value_and_grad(loss_fn)(state, params, a, b)
        return ls.unscale(grads, state)

    unscaled = ls.for_dtype(optax.sgd(1.0), "f32")
    scaled = policy.loss_scaling(optax.sgd(1.0))
    assert bool(jnp.all(true_grads(unscaled.init(params), params, a, b) == 0))
    np.testing.assert_array_equal(true_grads(scaled.init(params), params, a, b), 2.0**-30)


def test_for_dtype_can_skip_nonfinite_steps_in_wide_dtypes():
    params = jnp.zeros(2)
    bad = jnp.array([1.0, jnp.nan])
    for make in (
        lambda **kw: ls.for_dtype(optax.sgd(1.0), "bf16", **kw),
        lambda **kw: ls.Policy.from_string("p=f32,c=bf16,o=f32").loss_scaling(optax.sgd(1.0), **kw),
    ):
        unchecked = make()
        updates, _ = jax.jit(unchecked.update)(bad, unchecked.init(params))
        assert bool(jnp.isnan(updates[1]))
        checked = make(skip_nonfinite=True)
        updates, state = jax.jit(checked.update)(bad, checked.init(params))
        assert bool(state.skipped) and bool(jnp.all(updates == 0))

"""The transformation: clean steps, skipped steps, and optax compositions."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scale as ls
from tests._compare import assert_trees_bitwise, assert_trees_close

# The params below have a float16 leaf on purpose (mixed-dtype trees are what
# the transformation must handle), so Adam-like optimizers here keep float16
# state; the tests of the warning itself record it with pytest.warns/recwarn.
pytestmark = pytest.mark.filterwarnings("ignore::loss_scale.Float16StateWarning")


def make_params():
    return {
        "dense": {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)},
        "half": jnp.array([0.5, -0.25], jnp.float16),
        "bf": jnp.array([1.0, 2.0, 3.0], jnp.bfloat16),
    }


def make_grads(scale, poison=None):
    """Gradients of a made-up loss, times ``scale``; ``poison`` puts an inf/nan
    into one leaf."""
    grads = {
        "dense": {"w": jnp.full((3, 4), 0.3) * scale, "b": jnp.arange(4.0) * scale},
        "half": (jnp.array([1e-3, -2e-3]) * scale).astype(jnp.float16),
        "bf": (jnp.array([0.1, 0.2, 0.3]) * scale).astype(jnp.bfloat16),
    }
    if poison is not None:
        key, value = poison
        grads[key] = grads[key].at[0].set(value) if key != "dense" else grads[key]
        if key == "dense":
            grads["dense"]["w"] = grads["dense"]["w"].at[1, 2].set(value)
    return grads


def leaf_rounding(dtype):
    """The relative tolerance of a leaf of ``dtype``, to its dtype's rounding:
    16-bit leaves to 8 units of their roundoff (4 epsilons), since a compiled
    update (XLA:GPU computes a fused bfloat16 expression in float32 and rounds
    once; a CPU with float16 arithmetic contracts a multiply and an add into
    one rounding) and an op-by-op one (rounds after every op) may differ by a
    rounding in each multiply-add of a moment, which three steps carry on (3
    units seen between rounding every op and rounding once), and the update
    reads two moments: 2 * (3 + 1); float32 leaves to 2e-5, since XLA:GPU sums
    a global norm (clip_by_global_norm) in another order when compiled, and
    Adam's moments carry that difference on (8e-6 seen on an H100)."""
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    return 4 * float(jnp.finfo(dtype).eps) if inexact and jnp.finfo(dtype).bits < 32 else 2e-5


INNERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(optax.linear_schedule(1e-2, 0.0, 10))),
}


@pytest.mark.parametrize("name", list(INNERS))
def test_clean_step_equals_inner_update_on_unscaled_grads(name, jit):
    make_inner = INNERS[name]
    params = make_params()
    tx = ls.dynamic(make_inner(), initial_scale=2.0**12)
    inner = make_inner()
    state, inner_state = tx.init(params), inner.init(params)
    update, inner_update = jit(tx.update), jit(inner.update)
    for _ in range(3):
        grads = make_grads(ls.get_scale(state))
        updates, state = update(grads, state, params)
        expected, inner_state = inner_update(ls.unscale(grads, state), inner_state, params)
        assert_trees_close(updates, expected, rtol=leaf_rounding, atol=0, what=name)
        assert_trees_close(state.inner_state, inner_state, rtol=leaf_rounding, atol=0, what=name)
        params = optax.apply_updates(params, updates)
    assert int(state.good_steps) == 3 and not bool(state.skipped)


# Each optimizer meets one kind of poison in one kind of leaf.
POISONS = [("dense", jnp.inf), ("half", -jnp.inf), ("bf", jnp.nan), ("dense", jnp.nan), ("half", jnp.nan)]


POISONED = list(zip(INNERS, POISONS, strict=True))


@pytest.mark.parametrize(("name", "poison"), POISONED, ids=[f"{n}-{p[0]}" for n, p in POISONED])
def test_skipped_step_leaves_everything_untouched(name, poison, jit):
    params = make_params()
    tx = ls.dynamic(INNERS[name](), initial_scale=2.0**12, min_scale=2.0**10)
    state = tx.init(params)
    update = jit(tx.update)
    updates, state = update(make_grads(ls.get_scale(state)), state, params)  # one clean step
    params = optax.apply_updates(params, updates)
    before = state
    updates, state = update(make_grads(ls.get_scale(state), poison), state, params)
    assert_trees_bitwise(state.inner_state, before.inner_state)
    assert_trees_bitwise(updates, jax.tree.map(jnp.zeros_like, params))
    new_params = optax.apply_updates(params, updates)
    assert_trees_bitwise(new_params, params)
    assert bool(state.skipped), name
    assert float(state.scale) == 2.0**11
    assert (int(state.good_steps), int(state.skipped_steps), int(state.consecutive_skips)) == (0, 1, 1)
    # A second overflow: floored at min_scale, counters go on.
    _, state = update(make_grads(ls.get_scale(state), poison), state, params)
    assert (float(state.scale), int(state.skipped_steps), int(state.consecutive_skips)) == (2.0**10, 2, 2)
    # The next clean step applies and clears the run of skips.
    _, state = update(make_grads(ls.get_scale(state)), state, params)
    assert (bool(state.skipped), int(state.skipped_steps), int(state.consecutive_skips)) == (False, 2, 0)


def test_static_skips_but_never_moves_the_scale(jit):
    params = make_params()
    tx = ls.static(optax.adam(1e-2), scale=256.0)
    state = tx.init(params)
    update = jit(tx.update)
    for poison in [None, ("dense", jnp.inf), None, None]:
        before = state.inner_state
        updates, state = update(make_grads(256.0, poison), state, params)
        assert float(state.scale) == 256.0
        assert bool(state.skipped) == (poison is not None)
        if poison is not None:
            assert_trees_bitwise(state.inner_state, before)
    assert int(state.good_steps) == 2 and int(state.skipped_steps) == 1


def test_no_op_applies_every_step_and_optionally_skips():
    params = {"w": jnp.ones(2)}
    tx = ls.no_op(optax.sgd(1.0))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan])}, state)
    assert np.isnan(np.asarray(updates["w"][1])) and not bool(state.skipped)
    assert float(state.scale) == 1.0
    tx = ls.no_op(optax.sgd(1.0), skip_nonfinite=True)
    updates, state = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan])}, tx.init(params))
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
    assert bool(state.skipped)
    with pytest.raises(TypeError, match="skip_nonfinite"):
        ls.no_op(optax.sgd(1.0), skip_nonfinite="yes")


@pytest.mark.parametrize("inner", [optax.adam, "adam", None, 3.0, object()])
def test_non_optax_inner_is_a_type_error(inner):
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
        ls.dynamic(inner)


def test_uncalled_factory_gets_a_hint():
    with pytest.raises(TypeError, match=r"optax\.adam\(1e-3\)"):
        ls.static(optax.adam, scale=2.0)


def test_wrong_state_is_a_type_error():
    tx = ls.dynamic(optax.sgd(0.1))
    with pytest.raises(TypeError, match="LossScaleState"):
        tx.update(jnp.ones(2), optax.sgd(0.1).init(jnp.ones(2)), jnp.ones(2))


PROMOTING = {
    # optax initialises Adam's moments in the params' dtype and promotes them
    # when the gradients are wider; plain optax accepts that.
    "adam, bf16 params, f32 grads": (lambda: optax.adam(0.1), jnp.bfloat16, jnp.float32),
    "adam, bf16 params, f16 grads": (lambda: optax.adam(0.1), jnp.bfloat16, jnp.float16),
    "adam, f16 params, f32 grads": (lambda: optax.adam(0.1), jnp.float16, jnp.float32),
    "inject_hyperparams(scale_by_adam, hyperparam_dtype=f32), bf16": (
        lambda: optax.inject_hyperparams(optax.scale_by_adam, hyperparam_dtype=jnp.float32)(),
        jnp.bfloat16,
        jnp.float32,
    ),
}


@pytest.mark.parametrize("name", list(PROMOTING))
def test_inner_update_that_widens_its_state_works_as_in_plain_optax(name):
    make_inner, param_dtype, grad_dtype = PROMOTING[name]
    params = {"w": jnp.array([0.5, -1.0, 2.0], param_dtype)}
    tx, inner = ls.static(make_inner(), 1.0), make_inner()
    state, inner_state = tx.init(params), inner.init(params)
    update, inner_update = jax.jit(tx.update), jax.jit(inner.update)
    for step, poison in enumerate([None, None, jnp.nan, None, jnp.inf]):
        grads = {"w": jnp.array([0.25, -0.5, 1.0 + step], grad_dtype)}
        if poison is not None:
            grads["w"] = grads["w"].at[1].set(poison)
        before = state.inner_state
        updates, state = update(grads, state, params)
        if poison is None:
            expected, inner_state = inner_update(grads, inner_state, params)
            # Two programs (the inner update inside the skip's lax.cond, and
            # bare), which XLA may fuse differently (before jax 0.10 XLA:CPU
            # did, and one case came out one bfloat16 ulp apart): Adam's second
            # moment is rounded to the params' 16-bit dtype, which the two may
            # do, or read, differently. Every leaf within that one rounding
            # (the update reads the moment through a square root: half of it).
            rtol = float(jnp.finfo(param_dtype).eps)
            chex.assert_trees_all_close((updates, state.inner_state), (expected, inner_state), rtol=rtol, atol=0)
            inner_state = state.inner_state  # go on from the same state, so the skip below is exact
        else:
            # Skipped: the state as it was (in the dtype the update gives it, exactly).
            assert bool(state.skipped)
            widened = jax.tree.map(lambda old, new: old.astype(new.dtype), before, state.inner_state)
            assert_trees_bitwise(state.inner_state, widened)
            assert_trees_bitwise(state.inner_state, inner_state)


@pytest.mark.parametrize("poison", [1.0, jnp.nan])
def test_python_numbers_in_the_inner_state_work_as_in_plain_optax(poison, jit):
    """A custom optimizer may keep Python numbers in its state; plain optax
    accepts them, and so does the skip branch (they become arrays of their
    JAX type, as under jit)."""

    def init(params):
        return {"count": 0, "lr": 0.5}

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -state["lr"] * g, updates), {"count": state["count"] + 1, "lr": state["lr"]}

    params = {"w": jnp.ones(3)}
    tx = ls.dynamic(optax.GradientTransformation(init, update), initial_scale=1.0)
    updates, state = jit(tx.update)({"w": jnp.full(3, poison)}, tx.init(params), params)
    assert int(state.inner_state["count"]) == (1 if poison == 1.0 else 0)
    assert float(state.inner_state["lr"]) == 0.5 and bool(state.skipped) == (poison != 1.0)
    np.testing.assert_array_equal(updates["w"], [-0.5] * 3 if poison == 1.0 else [0.0] * 3)


def test_inner_update_that_narrows_its_state_is_named():
    # A skipped step could not return a narrowed state unchanged: refused.
    def init(params):
        return {"acc": jnp.zeros_like(params, jnp.float32)}

    def update(updates, state, params=None):
        return updates, {"acc": (state["acc"] + updates).astype(jnp.bfloat16)}

    tx = ls.dynamic(optax.GradientTransformation(init, update))
    # The message names the leaf and says what to do.
    fix = r"Initialise it with the dtype it will keep \(for example, pass params of that dtype to init\)$"
    with pytest.raises(TypeError, match=r"\['acc'\] from float32\(2,\) to bfloat16\(2,\).*" + fix):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))


def test_inner_update_that_reshapes_its_state_is_named():
    def init(params):
        return {"acc": jnp.zeros(2)}

    def update(updates, state, params=None):
        return updates, {"acc": jnp.zeros(3)}

    tx = ls.dynamic(optax.GradientTransformation(init, update))
    with pytest.raises(TypeError, match=r"\['acc'\] from float32\(2,\) to float32\(3,\)"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))


def test_chain_outside_and_get_scale_through_it():
    params = {"w": jnp.ones(3)}
    tx = optax.chain(ls.dynamic(optax.scale_by_adam(), initial_scale=8.0), optax.scale(-0.1))
    state = tx.init(params)
    assert float(ls.get_scale(state)) == 8.0
    updates, state = tx.update({"w": jnp.array([8.0, jnp.inf, 0.0])}, state, params)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0, 0.0])
    assert float(ls.get_scale(state)) == 4.0 and bool(ls.find_state(state).skipped)


def test_inject_hyperparams_inside():
    params = {"w": jnp.ones(2)}
    tx = ls.dynamic(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), initial_scale=4.0)
    state = tx.init(params)
    state.inner_state.hyperparams["learning_rate"] = jnp.array(0.25)
    updates, state = jax.jit(tx.update)({"w": jnp.array([4.0, 8.0])}, state, params)
    np.testing.assert_allclose(updates["w"], [-0.25, -0.5])
    assert float(state.inner_state.hyperparams["learning_rate"]) == 0.25


def test_extra_args_reach_the_inner_optimizer():
    params = jnp.array([1.0, 2.0])
    tx = ls.dynamic(optax.polyak_sgd(max_learning_rate=10.0), initial_scale=2.0)
    state = tx.init(params)
    grads = 2.0 * params * 2.0  # grad of sum(p**2), scaled by 2
    updates, state = jax.jit(tx.update)(grads, state, params, value=jnp.sum(params**2))
    expected, _ = optax.polyak_sgd(max_learning_rate=10.0).update(
        2.0 * params, optax.polyak_sgd(10.0).init(params), params, value=jnp.sum(params**2)
    )
    np.testing.assert_allclose(updates, expected, rtol=1e-6)


def test_params_none_where_the_inner_allows_it():
    tx = ls.dynamic(optax.adam(0.1), initial_scale=2.0)
    state = tx.init(jnp.zeros(2))
    updates, state = jax.jit(tx.update)(jnp.array([2.0, 4.0]), state)
    assert updates.shape == (2,) and bool(jnp.all(jnp.isfinite(updates)))
    updates, state = jax.jit(tx.update)(jnp.array([2.0, jnp.nan]), state)
    np.testing.assert_array_equal(updates, [0.0, 0.0])


def test_empty_and_masked_trees():
    tx = ls.dynamic(optax.adam(0.1))
    state = tx.init({})
    updates, state = jax.jit(tx.update)({}, state, {})
    assert updates == {} and not bool(state.skipped)
    params = {"w": jnp.ones(2), "frozen": jnp.ones(3)}
    tx = ls.dynamic(optax.masked(optax.adam(0.1), {"w": True, "frozen": False}), initial_scale=2.0)
    state = tx.init(params)
    grads = {"w": jnp.array([2.0, 2.0]), "frozen": jnp.array([1.0, 1.0, 1.0])}
    updates, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["frozen"], [0.5, 0.5, 0.5])  # unscaled, not optimized


def test_integer_leaves_pass_through():
    params = {"w": jnp.ones(2), "step": jnp.array(3, jnp.int32)}
    tx = ls.dynamic(optax.identity(), initial_scale=4.0)
    updates, state = jax.jit(tx.update)({"w": jnp.array([4.0, 8.0]), "step": jnp.array(7, jnp.int32)}, tx.init(params))
    assert updates["step"].dtype == jnp.int32 and int(updates["step"]) == 7
    np.testing.assert_array_equal(updates["w"], [1.0, 2.0])


def test_float16_params_still_train():
    # Keep float32 master params in real training: an update smaller than half
    # the float16 spacing of a weight leaves it unchanged. It still works.
    params = {"w": jnp.array([1.0, -1.0], jnp.float16)}
    tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**10)
    with pytest.warns(ls.Float16StateWarning, match=r"\[0\]\.mu\['w'\].*eps=1e-8 is 0"):
        state = tx.init(params)
    for _ in range(5):
        loss, grads = ls.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2))(state, params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert params["w"].dtype == jnp.float16 and state.inner_state[0].mu["w"].dtype == jnp.float16
    assert float(params["w"][0]) < 1.0 and int(state.skipped_steps) == 0


def test_no_warning_for_float32_or_bfloat16_state(recwarn):
    ls.dynamic(optax.adam(1e-3)).init({"w": jnp.zeros(2), "b": jnp.zeros(2, jnp.bfloat16)})
    assert not [w for w in recwarn if issubclass(w.category, ls.Float16StateWarning)]


def test_scale_is_traced_so_nothing_recompiles():
    params = make_params()
    tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**12, growth_interval=2)
    traces = []  # one entry per trace of step: compiling it again needs a new trace

    @jax.jit
    def step(params, state, poison):
        traces.append(None)
        grads = make_grads(ls.get_scale(state))
        grads["dense"]["w"] = grads["dense"]["w"] * poison
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    scales = set()
    for poison in [1.0, 1.0, 1.0, jnp.inf, 1.0, jnp.nan, 1.0, 1.0]:
        params, state = step(params, state, jnp.float32(poison))
        scales.add(float(state.scale))
    assert len(scales) >= 3 and len(traces) == 1


def test_donated_state():
    params = make_params()
    tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**12)

    def step(params, state, poison):
        grads = make_grads(ls.get_scale(state))
        grads["half"] = grads["half"] * poison.astype(jnp.float16)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    state = tx.init(params)
    for poison in [1.0, jnp.inf, 1.0]:
        old = state
        params, state = step(params, state, jnp.float32(poison))
        assert old.packed.data.is_deleted()
    assert int(state.skipped_steps) == 1 and int(state.inner_state[0].count) == 2


def test_vmap_gives_each_model_its_own_decision():
    tx = ls.dynamic(optax.adam(0.1), initial_scale=8.0)
    params = jnp.ones((3, 2))
    states = jax.vmap(tx.init)(params)
    grads = jnp.array([[8.0, 8.0], [jnp.inf, 8.0], [8.0, jnp.nan]])
    updates, states = jax.jit(jax.vmap(tx.update))(grads, states, params)
    np.testing.assert_array_equal(states.skipped, [False, True, True])
    np.testing.assert_array_equal(states.scale, [8.0, 4.0, 4.0])
    np.testing.assert_array_equal(states.inner_state[0].count, [1, 0, 0])
    assert bool(jnp.all(jnp.isfinite(updates))) and bool(jnp.all(updates[1:] == 0))


def test_loss_scale_outside_multisteps_drops_only_the_bad_micro_batch():
    params = jnp.zeros(2)
    tx = ls.dynamic(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3), initial_scale=4.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    micro = [jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 0.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0])]
    for g in micro:
        updates, state = update(g * ls.get_scale(state), state, params)
        params = optax.apply_updates(params, updates)
    # The window is the three finite micro-batches; the overflowing one
    # was dropped and did not count.
    np.testing.assert_allclose(params, -(micro[0] + micro[2] + micro[3]) / 3)
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0


def test_loss_scale_inside_multisteps_skips_the_whole_window():
    params = jnp.zeros(2)
    tx = optax.MultiSteps(ls.dynamic(optax.sgd(1.0), initial_scale=4.0), every_k_schedule=2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in [jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 0.0])]:
        updates, state = update(g * ls.get_scale(state), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params, [0.0, 0.0])
    assert float(ls.get_scale(state)) == 2.0 and bool(ls.find_state(state).skipped)
    # optax.MultiSteps resets its accumulator as (1 - emit) * acc, and
    # 0 * inf is nan: the accumulator stays poisoned and every later
    # window is skipped too. This is why the README recommends
    # ls.dynamic(optax.MultiSteps(...)), where overflows never reach it.
    assert not bool(ls.all_finite(state.acc_grads))
    for g in [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])]:
        updates, state = update(g * ls.get_scale(state), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params, [0.0, 0.0])
    assert bool(ls.find_state(state).skipped) and bool(jnp.all(jnp.isfinite(params)))


@pytest.mark.parametrize("poison", [1.0, jnp.inf])
def test_apply_gradients_equals_update_then_apply(poison):
    params = make_params()
    for make_tx in [
        lambda: ls.dynamic(optax.adam(1e-2), initial_scale=2.0**12),
        lambda: ls.static(optax.sgd(0.1, momentum=0.9), 64.0, max_grad_norm=0.5),
        lambda: ls.no_op(optax.adam(1e-2)),
        lambda: optax.chain(ls.dynamic(optax.scale_by_adam(), initial_scale=8.0), optax.scale(-1e-2)),  # two-step path
    ]:
        tx = make_tx()
        state = tx.init(params)
        grads = make_grads(8.0)
        grads["dense"]["w"] = grads["dense"]["w"] * poison
        fused_params, fused_state = jax.jit(functools.partial(ls.apply_gradients, tx))(grads, state, params)
        updates, ref_state = jax.jit(tx.update)(grads, state, params)
        ref_params = optax.apply_updates(params, updates)
        # XLA may fuse the update into the addition (as it does for a bare
        # optimizer), and round ``p + u`` once where the reference rounds ``u``
        # first: params agree to one rounding of their dtype (float32's, and
        # one ulp of the float16 and bfloat16 leaves). The state exactly: from
        # the initial, zero state each moment is one rounded product in either
        # program, a contracted multiply-add included.
        assert_trees_close(
            fused_params,
            ref_params,
            rtol=lambda dtype: float(jnp.finfo(dtype).eps) if jnp.finfo(dtype).bits == 16 else 1e-6,
            atol=lambda dtype: 0.0 if jnp.finfo(dtype).bits == 16 else 1e-7,
        )
        assert_trees_bitwise(fused_state, ref_state)
        if poison != 1.0 and bool(ls.find_state(fused_state).skipped):  # no_op does not check
            assert_trees_bitwise(fused_params, params)


def test_apply_gradients_with_donation_and_a_skip():
    params = make_params()
    tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**12)
    step = jax.jit(lambda p, s, g: ls.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
    state = tx.init(params)
    params, state = step(params, state, make_grads(2.0**12))
    snapshot = jax.tree.map(np.asarray, params)
    params, state = step(params, state, make_grads(2.0**11, ("bf", jnp.nan)))
    assert bool(state.skipped)
    assert_trees_bitwise(params, snapshot)


def test_nested_loss_scaling_is_refused():
    # Nested, the outer scale would multiply the loss while both divide the
    # gradients: updates too small by the inner scale.
    with pytest.raises(ValueError, match="already a loss-scaling transformation"):
        ls.dynamic(ls.dynamic(optax.sgd(1.0), initial_scale=16.0), initial_scale=4.0)
    with pytest.raises(ValueError, match="already a loss-scaling transformation"):
        ls.presets.torch(ls.static(optax.sgd(1.0), 2.0))
    # Hidden in a chain, it is found at init.
    tx = ls.dynamic(optax.chain(optax.clip(1.0), ls.static(optax.sgd(1.0), 2.0)))
    with pytest.raises(ValueError, match="nested inside another"):
        tx.init({"w": jnp.zeros(2)})


def test_the_transformation_is_an_optax_transformation_with_its_fused_step():
    tx = ls.dynamic(optax.sgd(0.5), initial_scale=4.0)
    assert isinstance(tx, optax.GradientTransformationExtraArgs) and isinstance(tx, ls.LossScaleTransformation)
    init, update = tx  # unpacks like any optax transformation
    params = {"w": jnp.ones(2)}
    grads = {"w": jnp.array([4.0, 8.0])}
    fused = tx.apply_gradients(grads, init(params), params)
    updates, state = update(grads, init(params), params)
    assert_trees_bitwise(fused, (optax.apply_updates(params, updates), state))
    assert_trees_bitwise(ls.apply_gradients(tx, grads, init(params), params), fused)


def test_inject_hyperparams_learning_rate_is_reachable_through_the_state():
    params = {"w": jnp.ones(2)}
    tx = ls.static(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 2.0)
    state = tx.init(params)
    assert float(state.hyperparams["learning_rate"]) == np.float32(0.1)
    state.hyperparams["learning_rate"] = jnp.asarray(0.5)  # as optax documents for its own state
    updates, state = jax.jit(tx.update)({"w": jnp.array([2.0, 4.0])}, state, params)
    np.testing.assert_allclose(updates["w"], [-0.5, -1.0])
    # tree_set reaches it through the wrapper too.
    state = optax.tree_utils.tree_set(state, learning_rate=jnp.asarray(0.25))
    updates, state = jax.jit(tx.update)({"w": jnp.array([2.0, 4.0])}, state, params)
    np.testing.assert_allclose(updates["w"], [-0.25, -0.5])


def test_schedule_free_eval_params_through_the_wrapper_equals_plain_optax():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    inner = optax.contrib.schedule_free_adamw(0.1)
    tx = ls.static(optax.contrib.schedule_free_adamw(0.1), 4.0)
    state, inner_state = tx.init(params), inner.init(params)
    p, q = params, params
    for step in range(6):
        grads = {"w": jnp.array([0.5, -1.0, 0.25 * step])}
        poisoned = {"w": grads["w"].at[0].set(jnp.nan)} if step == 3 else grads
        updates, state = tx.update(jax.tree.map(lambda g: g * 4.0, poisoned), state, p)
        p = optax.apply_updates(p, updates)
        if step != 3:  # the skipped step changes nothing
            inner_updates, inner_state = inner.update(grads, inner_state, q)
            q = optax.apply_updates(q, inner_updates)
    ours = optax.contrib.schedule_free_eval_params(state, p)
    theirs = optax.contrib.schedule_free_eval_params(inner_state, q)
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-6)


def test_a_missing_attribute_says_how_to_reach_the_inner_state():
    state = ls.dynamic(optax.chain(optax.clip(1.0), optax.adam(1e-3))).init({"w": jnp.zeros(2)})
    with pytest.raises(AttributeError, match=r"nor has its inner_state \(a tuple\).*find_state"):
        _ = state.hyperparams


def test_an_inner_update_that_changes_its_state_structure_is_refused_by_name():
    # A skipped step returns the old inner state, so the inner update must
    # keep its structure; one that adds a leaf is refused with a message
    # that says so (not a bare lax.cond type error).
    def init(params):
        return {"count": jnp.zeros((), jnp.int32)}

    def update(updates, state, params=None):
        return updates, {"count": state["count"] + 1, "extra": jnp.zeros(())}

    tx = ls.dynamic(optax.GradientTransformation(init, update))
    state = tx.init(jnp.zeros(2))
    with pytest.raises(
        TypeError,
        match=r"changes the structure of its state \(.*at \['extra'\]: float32\[\] here, nothing expected\)",
    ):
        tx.update(jnp.ones(2), state)

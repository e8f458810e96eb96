"""The transformation at its seams with JAX and optax (issue 21).

Differentiating through an update, the options in every precision, the
statistics of the unchecked ``no_op``, copying and pickling the
transformation, and inner states that hold any leaf type JAX allows.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import loss_scale as ls
from tests._compare import assert_trees_bitwise, assert_trees_close

PARAMS = {"w": jnp.array([1.0, -2.0, 0.5]), "m": jnp.array([[0.3, -0.7], [1.5, 0.2]])}
DIRECTION = {"w": jnp.array([3.0, 1.0, -2.0]), "m": jnp.array([[1.0, 2.0], [-1.0, 0.5]])}


def scaled_grads(a, scale):
    """Gradients ``a * DIRECTION``, times the loss scale."""
    return jax.tree.map(lambda d: a * d * scale, DIRECTION)


# 1. Differentiating through the update.

WRAPPERS = {
    "dynamic": lambda inner: ls.dynamic(inner, initial_scale=64.0),
    "predictive": ls.predictive,
    "static": lambda inner: ls.static(inner, 64.0),
    "no_op": ls.no_op,
    "no_op_skipping": functools.partial(ls.no_op, skip_nonfinite=True),
    **{f"presets.{name}": getattr(ls.presets, name) for name in ls.presets.__all__},
}


def unrolled(tx, fused, steps=2):
    """The loss after ``steps`` updates along ``a * DIRECTION`` from
    ``params``: a function of ``(a, params)`` that differentiates through
    every update (and its inner state, momentum here)."""
    state0 = tx.init(PARAMS)
    is_scaled = isinstance(tx, ls.LossScaleTransformation)

    def f(a, params):
        state = state0
        for _ in range(steps):
            scale = ls.get_scale(state) if is_scaled else 1.0
            grads = scaled_grads(a, scale)
            if fused:
                params, state = ls.apply_gradients(tx, grads, state, params)
            else:
                updates, state = tx.update(grads, state, params)
                params = optax.apply_updates(params, updates)
        return sum(jnp.sum(x**2) for x in jax.tree.leaves(params))

    return f


def assert_differentiates_alike(f, bare, jit, atol=1e-7):
    """``jax.grad``, ``jax.jvp`` and ``jax.vjp`` of ``f`` equal ``bare``'s to
    float32 rounding (``atol`` for derivatives that cancel to about 0)."""
    a = jnp.float32(0.7)
    got, want = jit(jax.grad(f, argnums=(0, 1)))(a, PARAMS), jax.grad(bare, argnums=(0, 1))(a, PARAMS)
    assert_trees_close(got, want, rtol=2e-6, atol=atol)
    tangents = (jnp.float32(1.0), jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), PARAMS))
    got = jit(lambda: jax.jvp(f, (a, PARAMS), tangents))()
    assert_trees_close(got, jax.jvp(bare, (a, PARAMS), tangents), rtol=2e-6, atol=atol)
    got = jit(lambda: jax.vjp(f, a, PARAMS)[1](jnp.float32(1.5)))()
    assert_trees_close(got, jax.vjp(bare, a, PARAMS)[1](jnp.float32(1.5)), rtol=2e-6, atol=atol)


def test_grad_through_update_from_the_issue():
    tx = ls.static(optax.sgd(0.1), 64.0)
    p = {"w": jnp.array([1.0, -2.0])}
    s = tx.init(p)

    def f(a):
        return jnp.sum(optax.apply_updates(p, tx.update({"w": a * jnp.array([3.0, 1.0]) * 64.0}, s, p)[0])["w"] ** 2)

    np.testing.assert_allclose(jax.grad(f)(0.7), -0.06, rtol=1e-5)


# Every preset's update is also differentiated (grad, jvp, remat) by the
# composition matrix (tests/composition.py); here, with respect to the params
# too and with vjp, the factories and one preset with hysteresis.
DIFFERENTIATED = [name for name in WRAPPERS if not name.startswith("presets.")] + ["presets.deepspeed"]


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("name", DIFFERENTIATED)
def test_update_differentiates_as_the_bare_optimizer(name, fused):
    inner = optax.sgd(0.1, momentum=0.9)
    f = unrolled(WRAPPERS[name](inner), fused)
    assert_differentiates_alike(f, unrolled(inner, fused=False), jax.jit)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("name", ["dynamic", "no_op"])
def test_update_differentiates_as_the_bare_optimizer_eagerly(name, fused):
    inner = optax.sgd(0.1, momentum=0.9)
    f = unrolled(WRAPPERS[name](inner), fused)
    assert_differentiates_alike(f, unrolled(inner, fused=False), lambda fn: fn)


@pytest.mark.parametrize("wrap", ["dynamic", "for_dtype_bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_clipping_differentiates_as_optax_clip(wrap, fused):
    # The clip is part of the update's math: its derivative (through the
    # norm) must be optax.clip_by_global_norm's. The norm here is about 3.4 a
    # step, so 2.0 clips, and the clipped gradients no longer depend on ``a``:
    # their derivative is 0 up to cancellation, which the clip's own
    # derivative brings about.
    inner = optax.sgd(0.1, momentum=0.9)
    if wrap == "dynamic":
        wrapped = ls.dynamic(inner, initial_scale=64.0, max_grad_norm=2.0)
    else:
        wrapped = ls.for_dtype(inner, "bfloat16", max_grad_norm=2.0)
    bare = optax.chain(optax.clip_by_global_norm(2.0), inner)
    assert_differentiates_alike(unrolled(wrapped, fused), unrolled(bare, fused=False), jax.jit, atol=2e-6)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_grad_norm": 1e-3}, {"track_grad_norm": True, "track_underflow": True, "locate_overflows": True}],
    ids=["plain", "clipping", "statistics"],
)
def test_a_skipped_step_differentiates_as_no_step(options):
    # With clipping, the norm's sum of squares must leave the inf out of its
    # gradient: 0 * inf would make the whole derivative nan.
    inner = optax.sgd(0.1, momentum=0.9)
    tx = ls.dynamic(inner, initial_scale=64.0, **options)
    state = tx.init(PARAMS)

    def f(a):
        grads = scaled_grads(a, 64.0)
        # The inf adds to a gradient that depends on a, as an overflow in a
        # backward pass does (a .set would cut the dependence).
        grads["w"] = grads["w"] + jnp.zeros_like(grads["w"]).at[0].set(jnp.inf)
        updates, _ = tx.update(grads, state, PARAMS)
        return sum(jnp.sum(u) for u in jax.tree.leaves(updates))

    assert float(jax.grad(f)(jnp.float32(0.7))) == 0.0


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_meta_learning_the_learning_rate(jitted):
    # Hyper-gradient descent: the gradient of the loss after a few unrolled
    # steps with respect to a learning rate set through inject_hyperparams.
    target = jax.tree.map(lambda x: 0.5 * x + 0.3, PARAMS)  # no zero gradient, where Adam's sqrt has none

    def loss_fn(params):
        return sum(jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target), strict=True))

    def after_steps(lr, tx, scaled, steps=3):
        params, state = PARAMS, tx.init(PARAMS)
        state = optax.tree_utils.tree_set(state, learning_rate=lr)
        for _ in range(steps):
            if scaled:
                _, grads = ls.value_and_grad(loss_fn)(state, params)
            else:
                grads = jax.grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return loss_fn(params)

    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    wrapped = functools.partial(after_steps, tx=ls.dynamic(inner, initial_scale=2.0**10), scaled=True)
    bare = functools.partial(after_steps, tx=inner, scaled=False)
    hyper = jax.jit(jax.grad(wrapped)) if jitted else jax.grad(wrapped)
    got, want = hyper(jnp.float32(0.05)), jax.grad(bare)(jnp.float32(0.05))
    assert np.isfinite(want) and want != 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5)


# 2. Every option in every precision.

DTYPES = ("float16", "bfloat16", "float32")
OPTION_VALUES = {
    "max_grad_norm": {"max_grad_norm": 1.0},
    "track_grad_norm": {"track_grad_norm": True},
    "locate_overflows": {"locate_overflows": True},
    "track_underflow": {"track_underflow": True},
    "axis_name": {"axis_name": "batch"},
    "max_consecutive_skips": {"max_consecutive_skips": 3, "skip_nonfinite": True},
    "backoff_on_nonfinite_loss": {"backoff_on_nonfinite_loss": True, "skip_nonfinite": True},
}


def layout(state):
    """What a checkpointer saves of ``state``: each leaf's path, shape and
    dtype (a fixed scale, ls.no_op's, is a constant of the tree's metadata,
    which a checkpoint does not hold)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [(jax.tree_util.keystr(path), x.shape, x.dtype) for path, x in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTION_VALUES))
def test_each_option_gives_float16s_state_layout(option, dtype):
    kwargs = OPTION_VALUES[option]
    params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    reference = ls.for_dtype(optax.adam(1e-3), "float16", **kwargs).init(params)
    tx = ls.for_dtype(optax.adam(1e-3), dtype, **kwargs)
    assert layout(tx.init(params)) == layout(reference)
    policy = ls.Policy(compute_dtype=dtype)
    assert layout(policy.loss_scaling(optax.adam(1e-3), **kwargs).init(params)) == layout(reference)
    if option != "axis_name":
        # A float16 checkpoint restores under the other precisions' flag.
        tx.update({"w": jnp.ones(2), "b": jnp.ones(())}, reference, params)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipping_clips_in_every_precision(dtype, jit):
    tx = ls.for_dtype(optax.sgd(1.0), dtype, max_grad_norm=1.0)
    state = tx.init(jnp.zeros(2))
    scale = ls.get_scale(state)
    updates, state = jit(tx.update)(jnp.array([3.0, 4.0]) * scale, state)
    np.testing.assert_allclose(updates, [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(ls.metrics(state)["loss_scale/grad_norm"], 5.0, rtol=1e-6)
    bare = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    np.testing.assert_allclose(updates, bare.update(jnp.array([3.0, 4.0]), bare.init(jnp.zeros(2)))[0], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_statistics_are_measured_in_every_precision(dtype, jit):
    tx = ls.for_dtype(optax.sgd(1.0), dtype, track_grad_norm=True, track_underflow=True)
    state = tx.init(jnp.zeros(4))
    # Scaled gradients: one zero, one below float16's smallest normal.
    _, state = jit(tx.update)(jnp.array([0.0, 1e-6, 3.0, 4.0]), state)
    m = ls.metrics(state)
    scale = float(ls.get_scale(tx.init(jnp.zeros(4))))
    np.testing.assert_allclose(m["loss_scale/grad_norm"], np.hypot(3.0, 4.0) / scale, rtol=1e-5)
    np.testing.assert_allclose(m["loss_scale/grad_max"], 4.0 / scale, rtol=1e-6)
    assert float(m["loss_scale/zero_fraction"]) == 0.25
    assert float(m["loss_scale/below_normal_fraction"]) == 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflows_are_located_in_every_precision(dtype, jit):
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = ls.for_dtype(optax.sgd(1.0), dtype, locate_overflows=True)
    state = tx.init(params)
    _, state = jit(tx.update)({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}, state, params)
    assert ls.overflow_paths(state, params) == ["['b']"]
    _, state = jit(tx.update)({"a": jnp.ones(2), "b": jnp.ones(2)}, state, params)
    assert ls.overflow_paths(state, params) == ["['b']"]  # the evidence stays


@pytest.mark.parametrize("dtype", DTYPES)
def test_axis_name_agrees_across_replicas_in_every_precision(dtype):
    # track_grad_norm: the wider dtypes' no_op measures only when asked to.
    tx = ls.for_dtype(optax.sgd(1.0), dtype, axis_name="batch", track_grad_norm=True)
    states = jax.vmap(lambda _: tx.init(jnp.zeros(2)))(jnp.arange(2))
    scale = ls.get_scale(tx.init(jnp.zeros(2)))
    grads = jnp.array([[1.0, 2.0], [7.0, -3.0]]) * scale
    _, states = jax.vmap(tx.update, axis_name="batch")(grads, states)
    np.testing.assert_array_equal(ls.metrics(states)["loss_scale/grad_max"], [7.0, 7.0])


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize("option", ["max_consecutive_skips", "backoff_on_nonfinite_loss"])
def test_options_for_skipped_steps_need_skipping(option, dtype):
    value = OPTION_VALUES[option][option]
    with pytest.raises(ValueError, match=f"{option}.*skip_nonfinite=True"):
        ls.for_dtype(optax.sgd(1.0), dtype, **{option: value})
    with pytest.raises(ValueError, match=f"{option}.*skip_nonfinite=True"):
        ls.Policy(compute_dtype=dtype).loss_scaling(optax.sgd(1.0), **{option: value})
    assert isinstance(
        ls.for_dtype(optax.sgd(1.0), dtype, skip_nonfinite=True, **{option: value}), optax.GradientTransformation
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_consecutive_skips_raises_in_every_precision(dtype):
    tx = ls.for_dtype(optax.sgd(1.0), dtype, max_consecutive_skips=2, skip_nonfinite=True)
    state = tx.init(jnp.zeros(2))
    _, state = tx.update(jnp.array([1.0, jnp.inf]), state)
    with pytest.raises(ls.SkippedStepsError):
        tx.update(jnp.array([1.0, jnp.inf]), state)


# 3. grad_max without the check.


@pytest.mark.parametrize(
    "make",
    [
        lambda inner: ls.no_op(inner, skip_nonfinite=True),
        lambda inner: ls.for_dtype(inner, "bfloat16", track_grad_norm=True),
    ],
    ids=["no_op_skipping", "for_dtype_bf16_norm"],
)
def test_grad_max_is_measured_where_asked_for(make, jit):
    tx = make(optax.sgd(1.0))
    state = tx.init(PARAMS)
    _, state = jit(tx.update)(scaled_grads(1.0, 1.0), state, PARAMS)
    assert float(ls.metrics(state)["loss_scale/grad_max"]) == 3.0
    grads = scaled_grads(1.0, 1.0)
    grads["m"] = grads["m"].at[0, 0].set(jnp.nan)
    updates, state = jit(tx.update)(grads, state, PARAMS)
    assert float(ls.metrics(state)["loss_scale/grad_max"]) == np.inf


@pytest.mark.parametrize(
    "make", [ls.no_op, lambda inner: ls.for_dtype(inner, "bfloat16")], ids=["no_op", "for_dtype_bf16"]
)
def test_an_unchecked_update_records_nothing_and_applies_every_step(make, jit):
    """Without skipping or a statistic the update is the inner one alone (on
    a GPU, the bare optimizer's program): nothing is measured or counted,
    and a non-finite step is applied as the bare optimizer applies it."""
    tx = make(optax.sgd(1.0))
    start = tx.init(PARAMS)
    _, state = jit(tx.update)(scaled_grads(1.0, 1.0), start, PARAMS)
    grads = scaled_grads(1.0, 1.0)
    grads["m"] = grads["m"].at[0, 0].set(jnp.nan)
    updates, state = jit(tx.update)(grads, state, PARAMS)
    assert np.isnan(updates["m"][0, 0]) and not bool(state.skipped)  # applied, as before
    metrics = ls.metrics(state)
    assert float(metrics["loss_scale/grad_max"]) == 0.0
    assert int(metrics["loss_scale/skipped_steps"]) == 0 and int(state.good_steps) == 0
    for old, new in zip(
        jax.tree.leaves(start._replace(inner_state=None)),
        jax.tree.leaves(state._replace(inner_state=None)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))


# 4. Copying and pickling the transformation.

COPYABLE = {
    "dynamic": lambda: ls.dynamic(optax.adam(1e-2), initial_scale=64.0),
    "predictive": lambda: ls.predictive(optax.adam(1e-2)),
    "no_op": lambda: ls.no_op(optax.adam(1e-2)),
    "presets.cerebras": lambda: ls.presets.cerebras(optax.adam(1e-2), max_gradient_norm=1.0),
    "for_dtype_bf16": lambda: ls.for_dtype(optax.adam(1e-2), "bfloat16", max_grad_norm=1.0),
}


def is_fused(tx) -> bool:
    """Whether ``ls.apply_gradients(tx, ...)`` adds the update to the params
    before it chooses between applying and skipping: the new params are the
    outputs of the ``lax.cond``, or of the ``select_n`` that keeps the old
    params on a skipped step (loss_scale/_skip.py), never of an addition
    after it."""
    state = tx.init(PARAMS)
    closed = jax.make_jaxpr(functools.partial(ls.apply_gradients, tx))(scaled_grads(1.0, 1.0), state, PARAMS)
    new_params = closed.jaxpr.outvars[: len(jax.tree.leaves(PARAMS))]
    return all(_chosen(closed.jaxpr, v) for v in new_params)


def _chosen(jaxpr, var) -> bool:
    """Whether ``var`` is an output of a ``lax.cond`` or a ``select_n``,
    looking through the ``custom_jvp`` function that holds the select path."""
    for eqn in jaxpr.eqns:
        if any(v is var for v in eqn.outvars):
            if eqn.primitive.name == "custom_jvp_call":
                inner = eqn.params["call_jaxpr"].jaxpr
                return _chosen(inner, inner.outvars[[id(v) for v in eqn.outvars].index(id(var))])
            return eqn.primitive.name in ("cond", "select_n")
    return False


def one_update(tx):
    state = tx.init(PARAMS)
    return tx.update(scaled_grads(1.0, ls.get_scale(state)), state, PARAMS)


@pytest.mark.parametrize("name", list(COPYABLE))
@pytest.mark.parametrize("how", ["copy", "deepcopy", "cloudpickle"])
def test_transformation_copies_and_pickles(name, how):
    tx = COPYABLE[name]()
    if how == "cloudpickle":
        cloudpickle = pytest.importorskip("cloudpickle")
        clone = cloudpickle.loads(cloudpickle.dumps(tx))
    else:
        clone = {"copy": copy.copy, "deepcopy": copy.deepcopy}[how](tx)
    assert type(clone) is type(tx)
    assert isinstance(clone, optax.GradientTransformation)
    assert isinstance(clone, optax.GradientTransformationExtraArgs)
    assert_trees_close(one_update(clone), one_update(tx), rtol=0, atol=0)
    state = clone.init(PARAMS)
    fused = ls.apply_gradients(clone, scaled_grads(1.0, ls.get_scale(state)), state, PARAMS)
    assert_trees_close(fused[0], optax.apply_updates(PARAMS, one_update(tx)[0]), rtol=1e-6, atol=1e-7)
    # no_op without skipping has no branch: its step is one pass either way.
    assert is_fused(clone) is is_fused(tx) is (name not in ("no_op", "for_dtype_bf16"))


def test_replace_keeps_the_fused_step_with_its_update():
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=64.0)
    assert is_fused(tx)
    same_update = tx._replace(init=tx.init)
    assert type(same_update) is ls.LossScaleTransformation and is_fused(same_update)

    def halved(updates, state, params=None, **extra_args):
        updates, state = tx.update(updates, state, params, **extra_args)
        return jax.tree.map(lambda u: u / 2, updates), state

    replaced = tx._replace(update=halved)
    state = replaced.init(PARAMS)
    grads = scaled_grads(1.0, 64.0)
    params, _ = replaced.apply_gradients(grads, state, PARAMS)
    want = optax.apply_updates(PARAMS, halved(grads, state, PARAMS)[0])
    assert_trees_close(params, want, rtol=0, atol=0)
    assert_trees_close(ls.apply_gradients(replaced, grads, state, PARAMS)[0], want, rtol=0, atol=0)


def test_flax_train_state_deep_copies():
    train_state = pytest.importorskip("flax.training.train_state")

    state = train_state.TrainState.create(apply_fn=lambda p, x: x, params=PARAMS, tx=ls.dynamic(optax.adam(1e-3)))
    clone = copy.deepcopy(state)
    assert type(clone.tx) is ls.LossScaleTransformation
    grads = scaled_grads(1.0, ls.get_scale(state.opt_state))
    assert_trees_close(
        clone.apply_gradients(grads=grads).params, state.apply_gradients(grads=grads).params, rtol=2e-6, atol=1e-7
    )


def test_nnx_optimizer_deep_copies():
    nnx = pytest.importorskip("flax.nnx")

    import loss_scale.flax as lsf

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = lsf.Optimizer(model, ls.dynamic(optax.adam(1e-3)), wrt=nnx.Param)
    clone = copy.deepcopy(optimizer)
    assert type(clone.tx) is ls.LossScaleTransformation and is_fused(clone.tx)


# 5. Inner states that hold any leaf type JAX allows.


class OddState(NamedTuple):
    typed_key: jax.Array
    raw_key: jax.Array
    tangent: Any
    count: jax.Array
    flag: jax.Array
    py_int: int
    py_float: float
    nothing: None
    empty: jax.Array
    empty_ints: jax.Array


def odd_inner() -> optax.GradientTransformation:
    """SGD with noise, whose state holds one leaf of every kind."""

    def init(params):
        return OddState(
            typed_key=jax.random.key(1),
            raw_key=jax.random.PRNGKey(2),
            tangent=np.zeros((2,), jax.dtypes.float0),
            count=jnp.zeros((), jnp.int32),
            flag=jnp.array(False),
            py_int=3,
            py_float=0.5,
            nothing=None,
            empty=jnp.zeros((0,)),
            empty_ints=jnp.zeros((0, 3), jnp.int8),
        )

    def update(updates, state, params=None):
        del params
        typed_key, typed_sub = jax.random.split(state.typed_key)
        raw_key, raw_sub = jax.random.split(state.raw_key)

        def noisy(g):
            noise = jax.random.normal(typed_sub, g.shape) + jax.random.uniform(raw_sub, g.shape)
            return -0.1 * g + 0.01 * noise

        new = state._replace(
            typed_key=typed_key, raw_key=raw_key, count=state.count + 1, flag=~state.flag, empty=state.empty + 1
        )
        return jax.tree.map(noisy, updates), new

    return optax.GradientTransformation(init, update)


def test_odd_leaves_pass_a_skipped_step_unchanged_and_a_taken_one_as_bare(jit):
    tx, bare = ls.dynamic(odd_inner(), initial_scale=8.0), odd_inner()
    state = tx.init(PARAMS)
    bad = scaled_grads(1.0, 8.0)
    bad["w"] = bad["w"].at[1].set(jnp.nan)
    updates, skipped = jit(tx.update)(bad, state, PARAMS)
    assert bool(skipped.skipped)
    assert_trees_bitwise(skipped.inner_state, state.inner_state)
    assert_trees_close(updates, jax.tree.map(jnp.zeros_like, PARAMS), rtol=0, atol=0)

    updates, taken = jit(tx.update)(scaled_grads(1.0, ls.get_scale(skipped)), skipped, PARAMS)
    want_updates, want_state = jit(bare.update)(scaled_grads(1.0, 1.0), bare.init(PARAMS), PARAMS)
    assert not bool(taken.skipped)
    assert_trees_close(updates, want_updates, rtol=2e-6, atol=1e-7)
    assert_trees_bitwise(taken.inner_state, want_state)


def make_sample() -> dict[str, Any]:
    """optax optimizers of many kinds of state (and contrib ones that
    import)."""
    sample = {
        "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=jax.random.key(0)),
        "adam": lambda: optax.adam(0.1),
        "adamw": lambda: optax.adamw(0.1),
        "lion": lambda: optax.lion(0.1),
        "lamb": lambda: optax.lamb(0.1),
        "adafactor": lambda: optax.adafactor(0.1),
        "sm3": lambda: optax.sm3(0.1),
        "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
        "multi_steps": lambda: optax.MultiSteps(optax.adam(0.1), every_k_schedule=2),
    }
    contrib = {
        "ademamix": (0.1,),
        "adopt": (0.1,),
        "cocob": (),
        "dadapt_adamw": (),
        "dog": (),
        "madgrad": (0.1,),
        "momo": (0.1,),
        "muon": (0.1,),
        "prodigy": (),
        "schedule_free_adamw": (0.1,),
        "reduce_on_plateau": (),
    }
    for name, args in contrib.items():
        if hasattr(optax.contrib, name):
            sample[f"contrib.{name}"] = functools.partial(getattr(optax.contrib, name), *args)
    return sample


SAMPLE = make_sample()


@pytest.mark.parametrize("name", list(SAMPLE))
def test_optax_sample_matches_the_bare_optimizer_around_an_overflow(name):
    # clean, overflow, clean: the wrapped run equals the bare run of the two
    # clean steps, its inner state included.
    tx, bare = ls.dynamic(SAMPLE[name](), initial_scale=2.0**8), optax.with_extra_args_support(SAMPLE[name]())
    state, bare_state = tx.init(PARAMS), bare.init(PARAMS)
    params, bare_params = PARAMS, PARAMS
    update, bare_update = jax.jit(tx.update), jax.jit(bare.update)
    for step, a in enumerate([1.0, np.inf, -0.5]):
        loss = jnp.float32(2.0 + step)
        grads = scaled_grads(jnp.float32(a), ls.get_scale(state))
        updates, state = update(grads, state, params, value=loss)
        params = optax.apply_updates(params, updates)
        assert bool(state.skipped) == (a == np.inf)
        if a != np.inf:
            updates, bare_state = bare_update(scaled_grads(jnp.float32(a), 1.0), bare_state, bare_params, value=loss)
            bare_params = optax.apply_updates(bare_params, updates)
    assert_trees_close(params, bare_params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.inner_state, bare_state, rtol=1e-5, atol=1e-6)

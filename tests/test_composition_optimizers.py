"""The optimizer axis of the composition matrix: every fast path of the skip
equals its reference, the ``lax.cond`` around the inner update, for the
optax zoo.

For each inner optimizer, ``ls.static(inner, scale=4.0)`` runs a sequence of
known gradients (times the scale) through ``tx.update`` + ``apply_updates``
or the fused ``ls.apply_gradients``, eagerly or under ``jit``, against an
oracle that decides each step in Python: the bare optimizer on the unscaled
gradients where they are finite, nothing where they are not (what the
``lax.cond`` computes, step by step). Checked:

* values: a skipped step keeps params and inner state bit for bit; a taken
  step equals the bare optimizer (bit for bit eagerly, where both run op by
  op; to float32 rounding under ``jit``, a differently fused program);
* derivatives of a scalar of the final params and inner state with respect
  to the learning rate, the initial params and every step's gradients
  (``jax.grad``) equal the oracle's and are finite, for the sequences skip,
  skip-take, take-skip;
* with ``jax_debug_nans`` on, a skipped step raises nothing, eagerly and
  under ``jit``; and ``checkify``'s float checks, which see every operation
  of a jitted program, find nothing non-finite computed in a skipped
  update.

The full cross product (optimizer x API x eager/jit x sequence) runs for the
values and the gradient; ``jax.jvp`` and ``jax.vjp`` run on a covering
subset (``TRANSFORMS_SUBSET``), every optimizer class the skip treats
differently (no branch, a branch, guarded divisions, reductions over the
gradients, a typed key in the state).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import loss_scale as ls
from tests._compare import assert_trees_bitwise, assert_trees_close

SCALE = 4.0
PARAMS = {"w": jnp.linspace(-1.0, 1.5, 12).reshape(3, 4), "b": jnp.array([0.5, -0.25, 0.0, 1.0])}
WEIGHTS = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape), PARAMS)


def clean(i):
    # No exact zeros: the bare optimizers' own derivatives with respect to a
    # zero gradient are not finite (sqrt's at 0 in Adam's second moment).
    return jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32) + i + 0.5).reshape(p.shape), PARAMS)


def overflowing(i):
    # Only inf in one leaf: the other leaf's values reach the update on a
    # skipped step in no form.
    g = clean(i)
    return {"w": g["w"].at[1, 2].set(jnp.inf), "b": g["b"]}


def _contrib(name):
    return getattr(optax.contrib, name, None)


def _optimizers():
    zoo = {
        "sgd_momentum": lambda lr: optax.sgd(lr, momentum=0.9),
        "sgd_nesterov": lambda lr: optax.sgd(lr, momentum=0.9, nesterov=True),
        "adam": lambda lr: optax.adam(lr),
        "adamw": lambda lr: optax.adamw(lr, weight_decay=0.1),
        "adamax": lambda lr: optax.adamax(lr),
        "amsgrad": lambda lr: optax.amsgrad(lr),
        "nadam": lambda lr: optax.nadam(lr),
        "radam": lambda lr: optax.radam(lr),
        "adabelief": lambda lr: optax.adabelief(lr),
        "adafactor": lambda lr: optax.adafactor(lr),
        "adagrad": lambda lr: optax.adagrad(lr),
        "adadelta": lambda lr: optax.adadelta(lr),
        "rmsprop": lambda lr: optax.rmsprop(lr),
        "rmsprop_centered": lambda lr: optax.rmsprop(lr, centered=True),
        "lion": lambda lr: optax.lion(lr),
        "lamb": lambda lr: optax.lamb(lr),
        "lars": lambda lr: optax.lars(lr),
        "novograd": lambda lr: optax.novograd(lr),
        "yogi": lambda lr: optax.yogi(lr),
        "sm3": lambda lr: optax.sm3(lr),
        "fromage": lambda lr: optax.fromage(lr),
        "noisy_sgd": lambda lr: optax.noisy_sgd(lr, key=jax.random.key(0)),
        "optimistic_gd": lambda lr: optax.optimistic_gradient_descent(lr),
        "schedule_free_adamw": lambda lr: optax.contrib.schedule_free_adamw(lr),
        "clip_adamw": lambda lr: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)),
        "inject_adam": lambda lr: optax.inject_hyperparams(optax.adam)(learning_rate=lr),
        "multisteps_adam": lambda lr: optax.MultiSteps(optax.adam(lr), every_k_schedule=2),
        "masked_adam": lambda lr: optax.masked(optax.adam(lr), {"w": True, "b": False}),
        "multi_transform": lambda lr: optax.multi_transform(
            {"a": optax.adam(lr), "s": optax.sgd(lr, momentum=0.5)}, {"w": "a", "b": "s"}
        ),
        "cosine_adam": lambda lr: optax.adam(optax.cosine_decay_schedule(lr, decay_steps=10)),
    }
    for name in ("muon", "prodigy", "dadapt_adamw"):
        factory = _contrib(name)
        if factory is not None:
            zoo[name] = functools.partial(lambda f, lr: f(lr), factory)
    return zoo


OPTIMIZERS = _optimizers()
# What the noisy_sgd key looks like: its state holds a typed key.
TRANSFORMS_SUBSET = ("adam", "adafactor", "lars", "clip_adamw", "inject_adam", "multisteps_adam", "noisy_sgd")
# Under jit, a taken step equals the bare optimizer to float32 rounding;
# muon's Newton-Schulz iterations (matrix products) round more.
JIT_RTOL = {"muon": 1e-4}
SEQUENCES = {
    "skip": (overflowing(0),),
    "skip_take": (overflowing(0), clean(1)),
    "take_skip": (clean(0), overflowing(1)),
}


def _finite(tree) -> bool:
    return all(
        bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
    )


def _floats(tree):
    """``tree`` with its leaves that are not floating (``float0`` tangents,
    keys, counts) left out."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _objective(params, inner_state) -> jax.Array:
    """A scalar of the final params and every float leaf of the inner
    state, so that a derivative through any of them is seen."""
    total = sum(jnp.sum(w * p) for w, p in zip(jax.tree.leaves(WEIGHTS), jax.tree.leaves(params), strict=True))
    for leaf in jax.tree.leaves(inner_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total = total + 1e-3 * jnp.sum(leaf)
    return total


def run_wrapped(make, api, lr, params, grads_seq):
    return run_wrapped_steps(make, api, lr, params, grads_seq)[-1]


def run_wrapped_steps(make, api, lr, params, grads_seq):
    """``(params, inner_state)`` before the first step and after each."""
    tx = ls.static(make(lr), scale=SCALE)
    state = tx.init(params)
    steps = [(params, state.inner_state)]
    for g in grads_seq:
        g = jax.tree.map(lambda x: x * SCALE, g)
        if api == "fused":
            params, state = ls.apply_gradients(tx, g, state, params)
        else:
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
        steps.append((params, state.inner_state))
    return steps


def run_oracle(make, taken, lr, params, grads_seq):
    """The ``lax.cond`` step by step, each branch chosen in Python (``taken``
    is known before tracing)."""
    inner = make(lr)
    state = inner.init(params)
    for go, g in zip(taken, grads_seq, strict=True):
        if go:
            updates, state = inner.update(g, state, params)
            params = optax.apply_updates(params, updates)
    return params, state


# The oracles depend on the optimizer and the sequence alone; the four
# variants of a test (eager or jit, update or fused) share them (the file's
# tests run on one worker: --dist loadfile).
@functools.cache
def oracle_values(name: str, sequence: str):
    grads_seq = SEQUENCES[sequence]
    return run_oracle(OPTIMIZERS[name], _taken(grads_seq), jnp.float32(0.1), PARAMS, grads_seq)


@functools.cache
def oracle_derivatives(name: str, sequence: str):
    """The oracle's derivatives with respect to the learning rate, the
    params and every step's gradients; 0 for a skipped step's, which are
    not read (the oracle is fed finite ones there)."""
    make, grads_seq = OPTIMIZERS[name], SEQUENCES[sequence]
    taken = _taken(grads_seq)
    safe_seq = tuple(g if go else clean(9) for go, g in zip(taken, grads_seq, strict=True))

    def oracle(lr, params, grads_seq):
        return _objective(*run_oracle(make, taken, lr, params, grads_seq))

    want = jax.grad(oracle, argnums=(0, 1, 2))(jnp.float32(0.1), PARAMS, safe_seq)
    zeroed = tuple(w if go else jax.tree.map(jnp.zeros_like, w) for go, w in zip(taken, want[2], strict=True))
    return want[0], want[1], zeroed


def _run_wrapped_at(make, grads_seq, lr, params):
    return run_wrapped(make, "update", lr, params, grads_seq)


def _run_oracle_at(make, taken, grads_seq, lr, params):
    return run_oracle(make, taken, lr, params, grads_seq)


def _taken(grads_seq):
    return tuple(_finite(g) for g in grads_seq)


@pytest.mark.parametrize("api", ["update", "fused"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_values_equal_the_reference(name, jit, api):
    make = OPTIMIZERS[name]
    run = functools.partial(run_wrapped_steps, make, api)
    if jit:
        run = jax.jit(run)
    lr = jnp.float32(0.1)
    for sequence, grads_seq in SEQUENCES.items():
        steps = run(lr, PARAMS, grads_seq)
        for k, go in enumerate(_taken(grads_seq)):
            if not go:
                # A skipped step keeps what the step before it left, bit for
                # bit (within one program: float rounding differs between
                # programs).
                assert_trees_bitwise(steps[k + 1], steps[k], f"{name} {sequence} step {k}")
        assert_trees_bitwise(steps[0][1], make(lr).init(PARAMS), f"{name} {sequence} init")
        want = oracle_values(name, sequence)
        if jit:
            assert_trees_close(steps[-1], want, rtol=JIT_RTOL.get(name, 2e-6), atol=1e-7)
        else:
            assert_trees_bitwise(steps[-1], want, f"{name} {sequence}")


@pytest.mark.parametrize("api", ["update", "fused"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_derivatives_equal_the_reference_and_are_finite(name, jit, api):
    make = OPTIMIZERS[name]

    def wrapped(lr, params, grads_seq):
        return _objective(*run_wrapped(make, api, lr, params, grads_seq))

    grad = jax.grad(wrapped, argnums=(0, 1, 2))
    if jit:
        grad = jax.jit(grad)
    for sequence, grads_seq in SEQUENCES.items():
        got = grad(jnp.float32(0.1), PARAMS, grads_seq)
        want = oracle_derivatives(name, sequence)
        assert _finite(got), f"{name} {sequence}: non-finite derivative {got}"
        assert_trees_close(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", TRANSFORMS_SUBSET)
def test_jvp_and_vjp_equal_the_reference(name, jit):
    make = OPTIMIZERS[name]
    for sequence, grads_seq in SEQUENCES.items():
        taken = _taken(grads_seq)
        safe_seq = tuple(g if go else clean(9) for go, g in zip(taken, grads_seq, strict=True))

        wrapped = functools.partial(_run_wrapped_at, make, grads_seq)
        oracle = functools.partial(_run_oracle_at, make, taken, safe_seq)

        tangents = (jnp.float32(1.0), jax.tree.map(jnp.ones_like, PARAMS))
        jvp = jax.jit(jax.jvp, static_argnums=0) if jit else jax.jvp
        got = jvp(wrapped, (jnp.float32(0.1), PARAMS), tangents)
        want = jax.jvp(oracle, (jnp.float32(0.1), PARAMS), tangents)
        assert _finite(got[1]), f"{name} {sequence}: non-finite tangent"
        assert_trees_close(_floats(got[1]), _floats(want[1]), rtol=2e-5, atol=1e-6)

        out, pullback = jax.vjp(wrapped, jnp.float32(0.1), PARAMS)
        cotangent = jax.tree.map(
            lambda x: (
                jnp.ones_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else np.zeros(x.shape, jax.dtypes.float0)
            ),
            out,
        )
        pull = jax.jit(pullback) if jit else pullback
        got_ct = pull(cotangent)
        want_ct = jax.vjp(oracle, jnp.float32(0.1), PARAMS)[1](cotangent)
        assert _finite(got_ct), f"{name} {sequence}: non-finite cotangent"
        assert_trees_close(_floats(got_ct), _floats(want_ct), rtol=2e-5, atol=1e-6)


@pytest.fixture
def debug_nans():
    previous = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        yield
    finally:
        jax.config.update("jax_debug_nans", previous)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_step_computes_nothing_non_finite(name, debug_nans):
    make = OPTIMIZERS[name]
    tx = ls.static(make(0.1), scale=SCALE)
    for state in (tx.init(PARAMS), tx.update(clean(0), tx.init(PARAMS), PARAMS)[1]):
        # jax_debug_nans: eagerly every operation, under jit the outputs.
        for update in (tx.update, jax.jit(tx.update), functools.partial(ls.apply_gradients, tx)):
            _, kept = update(overflowing(1), state, PARAMS)
            assert bool(kept.skipped)
        # checkify's float checks see every operation inside jit.
        checked = checkify.checkify(jax.jit(tx.update), errors=checkify.float_checks)
        error, _ = checked(overflowing(1), state, PARAMS)
        assert error.get() is None, f"{name}: {error.get()}"


def test_the_checks_see_what_an_unguarded_select_path_computes():
    # The checks above are not vacuous: Adam's update run on a skipped
    # step's inputs as the select path sees them (the old count 0 where the
    # new one would be) divides by zero, and both checks say so.
    def unguarded(count):
        bias_correction = 1.0 - 0.9**count
        return jnp.zeros(3) / bias_correction

    error, _ = checkify.checkify(jax.jit(unguarded), errors=checkify.float_checks)(jnp.float32(0.0))
    assert error.get() is not None
    previous = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        with pytest.raises(FloatingPointError):
            unguarded(jnp.float32(0.0))
    finally:
        jax.config.update("jax_debug_nans", previous)


def test_a_state_leaf_returned_from_the_inputs_is_kept_on_a_skipped_step():
    # The inner update returns its params (and the loss passed as value=)
    # as state: a skipped step keeps the old values there too, eagerly and
    # under jit, in both APIs.
    def update(g, s, params=None, value=None):
        return jax.tree.map(lambda x: -x, g), {"last": params, "loss": value}

    inner = optax.GradientTransformationExtraArgs(lambda p: {"last": p, "loss": jnp.float32(0.0)}, update)
    tx = ls.dynamic(inner, initial_scale=4.0)
    init_params, params = jnp.array([1.0, 2.0]), jnp.array([5.0, 6.0])
    state = tx.init(init_params)
    for step in (tx.update, jax.jit(tx.update), tx.apply_gradients, jax.jit(tx.apply_gradients)):
        _, kept = step(jnp.array([jnp.inf, 1.0]), state, params, value=jnp.float32(3.0))
        assert bool(kept.skipped)
        assert_trees_bitwise(kept.inner_state, state.inner_state)
        _, taken = step(jnp.array([1.0, 1.0]), state, params, value=jnp.float32(3.0))
        assert_trees_bitwise(taken.inner_state, {"last": params, "loss": jnp.float32(3.0)})

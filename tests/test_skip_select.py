"""The skip's select path (``loss_scale/_skip.py``) against its reference,
one ``lax.cond`` around the inner update, where the composition matrix's
optax zoo does not reach:

1. **under ``vmap``** (an ensemble of models, each with its own scaler
   state): ``jax.grad`` through a vmapped step differentiates the select
   path with a batched decision. The reference there is each member's own
   ``lax.cond``, decided in Python per member; values and derivatives
   (with respect to the params, the scaled gradients and Adam's first
   moment) are compared at taken, skipped and mixed steps, vmapped and
   not, eagerly and under ``jit``.
2. **inner updates with operations the select path does not know** (a
   linear solve, a Cholesky factorisation, an eigendecomposition, an SVD,
   a Newton iteration in a ``while_loop``, a custom derivative rule, a
   host callback): on a skipped step such an operation would read zeroed
   gradients and selected-back state that the optimizer's formulas never
   see (a singular matrix). The step takes the ``lax.cond`` form instead,
   so it computes nothing non-finite (``jax_debug_nans``, ``checkify``'s
   float checks) and equals the reference in values and derivatives; the
   optax zoo keeps the select path.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import loss_scale as ls
from loss_scale._low_precision._rounding import random_bits, round_stochastic
from tests._compare import assert_trees_bitwise, assert_trees_close
from tests._jaxprs import primitives
from tests.test_composition_optimizers import (
    OPTIMIZERS,
    PARAMS,
    SCALE,
    SEQUENCES,
    _objective,
    _taken,
    clean,
    overflowing,
    run_oracle,
    run_wrapped_steps,
)

# -- 1. under vmap -------------------------------------------------------------

MEMBERS = 3
ENSEMBLE = {
    "w": jnp.linspace(-1.0, 1.5, MEMBERS * 6).reshape(MEMBERS, 2, 3),
    "b": jnp.linspace(0.5, -0.5, MEMBERS * 3).reshape(MEMBERS, 3),
}
# Which members' gradients overflow, per pattern; unbatched runs use member 0.
PATTERNS = {"taken": (False,) * MEMBERS, "skipped": (True,) * MEMBERS, "mixed": (False, True, False)}
INNER = {"sgd_fused": (lambda: optax.sgd(0.1), "fused"), "adam_update": (lambda: optax.adam(0.1), "update")}


def ensemble_grads(overflow):
    """Unscaled gradients of every member, with an infinity in the members
    that ``overflow`` marks."""
    g = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32) + 0.5).reshape(p.shape), ENSEMBLE)
    w = g["w"]
    for k, bad in enumerate(overflow):
        if bad:
            w = w.at[k, 0, 1].set(jnp.inf)
    return {"w": w, "b": g["b"]}


def member_objective(params, inner_state) -> jax.Array:
    """A scalar of one member's new params and every float leaf of its
    inner state (Adam's moments), so that a derivative through any of them
    is seen."""
    total = sum(
        jnp.sum(jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape) * p) for p in jax.tree.leaves(params)
    )
    for leaf in jax.tree.leaves(inner_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total = total + 1e-3 * jnp.sum(leaf)
    return total


def member(tree, k):
    return jax.tree.map(lambda x: x[k], tree)


def floats_of(state):
    """The floating leaves of ``state`` (the differentiated inputs) and a
    function that puts new ones in their places."""
    leaves, treedef = jax.tree.flatten(state)
    where = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

    def rebuild(floats):
        new = list(leaves)
        for i, x in zip(where, floats, strict=True):
            new[i] = x
        return jax.tree.unflatten(treedef, new)

    return [leaves[i] for i in where], rebuild


def wrapped_step(make, api, params, inner_state, scaled_grads):
    """One member's step through ``ls.dynamic`` (scale ``SCALE``)."""
    tx = ls.dynamic(make(), initial_scale=SCALE)
    state = tx.init(params)._replace(inner_state=inner_state)
    if api == "fused":
        params, state = ls.apply_gradients(tx, scaled_grads, state, params)
    else:
        updates, state = tx.update(scaled_grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state.inner_state


def reference_step(make, params, inner_state, scaled_grads, taken):
    """The ``lax.cond`` of one member, its branch chosen in Python."""
    if taken:
        unscaled = jax.tree.map(lambda g: g / SCALE, scaled_grads)
        updates, inner_state = make().update(unscaled, inner_state, params)
        params = optax.apply_updates(params, updates)
    return params, inner_state


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("vmapped", [False, True], ids=["single", "vmapped"])
@pytest.mark.parametrize("case", list(INNER))
def test_grad_through_a_vmapped_step_equals_the_reference(case, vmapped, jit, pattern):
    make, api = INNER[case]
    overflow = PATTERNS[pattern] if vmapped else PATTERNS[pattern][:1]
    members = range(len(overflow))
    params = ENSEMBLE if vmapped else member(ENSEMBLE, 0)
    grads = ensemble_grads(overflow) if vmapped else member(ensemble_grads(overflow), 0)
    scaled = jax.tree.map(lambda g: g * SCALE, grads)
    init = jax.vmap(make().init)(params) if vmapped else make().init(params)
    # Adam's moments start away from zero, so that the derivative with
    # respect to the first moment meets no square root of a zero.
    init = jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x, init)
    moments, rebuild = floats_of(init)

    def wrapped(params, moments, scaled):
        step = functools.partial(wrapped_step, make, api)
        if vmapped:
            step = jax.vmap(step)
        return step(params, rebuild(moments), scaled)

    def reference(params, moments, scaled):
        inner_state = rebuild(moments)
        if not vmapped:
            return reference_step(make, params, inner_state, scaled, not overflow[0])
        outs = [
            reference_step(make, member(params, k), member(inner_state, k), member(scaled, k), not overflow[k])
            for k in members
        ]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    run = jax.jit(wrapped) if jit else wrapped
    got = run(params, moments, scaled)
    want = reference(params, moments, scaled)
    for k in members:
        pick = (lambda t, k=k: member(t, k)) if vmapped else (lambda t: t)
        if overflow[k]:  # a skipped member keeps its params and state, bit for bit
            assert_trees_bitwise(pick(got), pick((params, rebuild(moments))), f"member {k}")
    assert_trees_close(got, want, rtol=2e-6, atol=1e-7)

    def objective(outs):
        return member_objective(*outs) if not vmapped else sum(member_objective(*member(outs, k)) for k in members)

    grad = jax.grad(lambda *a: objective(wrapped(*a)), argnums=(0, 1, 2))
    grad = jax.jit(grad) if jit else grad
    got = grad(params, moments, scaled)
    # The reference reads no gradient of a skipped member: its derivative
    # there is 0, computed from finite stand-ins.
    safe = ensemble_grads((False,) * len(overflow)) if vmapped else member(ensemble_grads((False,)), 0)
    want = jax.grad(lambda *a: objective(reference(*a)), argnums=(0, 1, 2))(
        params, moments, jax.tree.map(lambda g: g * SCALE, safe)
    )
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(got)), got
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(INNER))
def test_forward_mode_and_vmap_of_grad_through_a_mixed_ensemble(case):
    make, api = INNER[case]
    overflow = PATTERNS["mixed"]
    scaled = jax.tree.map(lambda g: g * SCALE, ensemble_grads(overflow))
    init = jax.vmap(make().init)(ENSEMBLE)
    step = functools.partial(wrapped_step, make, api)

    def objective_of_params(params, k=None):
        state = init if k is None else member(init, k)
        grads = scaled if k is None else member(scaled, k)
        if k is None:
            return jax.vmap(step)(params, state, grads)
        return reference_step(make, params, state, grads, not overflow[k])

    tangent = jax.tree.map(jnp.ones_like, ENSEMBLE)
    _, got = jax.jit(lambda p, t: jax.jvp(objective_of_params, (p,), (t,)))(ENSEMBLE, tangent)
    want = [
        jax.jvp(lambda p, k=k: objective_of_params(p, k), (member(ENSEMBLE, k),), (member(tangent, k),))[1]
        for k in range(MEMBERS)
    ]
    # Tangents of the floating leaves (a count's is a float0, which holds nothing).
    want = [floats_of(w)[0] for w in want]
    assert_trees_close(floats_of(got)[0], [jnp.stack(xs) for xs in zip(*want, strict=True)], rtol=2e-5, atol=1e-6)

    def one(params, state, grads):
        return member_objective(*step(params, state, grads))

    got = jax.jit(jax.vmap(jax.grad(one)))(ENSEMBLE, init, scaled)
    for k in range(MEMBERS):
        ref = jax.grad(lambda p, k=k: member_objective(*objective_of_params(p, k)))(member(ENSEMBLE, k))
        assert_trees_close(member(got, k), ref, rtol=2e-5, atol=1e-6)


# -- 2. operations the select path does not know --------------------------------

LR = 0.1


def preconditioned(direction):
    """A full-matrix preconditioner per 2-D leaf: ``L <- 0.9 L + g g^T +
    0.1 I`` (zero at first, so that a skipped first step would meet a
    singular ``L`` where a taken one never does), the update
    ``-lr * direction(L, g)``; 1-D leaves take SGD."""

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros((p.shape[0],) * 2 if p.ndim == 2 else ()), params)

    def accumulate(s, g):
        return 0.9 * s + g @ g.T + 0.1 * jnp.eye(g.shape[0]) if g.ndim == 2 else s

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(accumulate, state, grads)
        updates = jax.tree.map(lambda s, g: -LR * (direction(s, g) if g.ndim == 2 else g), state, grads)
        return updates, state

    return optax.GradientTransformation(init, update)


def _cholesky(s, g):
    return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(s), True), g)


def _eigh_inverse_root(s, g):
    w, v = jnp.linalg.eigh(s)
    return (v * (w**-0.5)[None, :]) @ v.T @ g


def _svd_inverse_root(s, g):
    # full_matrices=False: the square matrix's decomposition either way,
    # and jax before 0.9 differentiates only the reduced one.
    u, w, vt = jnp.linalg.svd(s, full_matrices=False)
    return (u * (w**-0.5)[None, :]) @ vt @ g


def newton_normalised():
    """Each leaf divided by the square root of a running mean of ``g**2``,
    the inverse square root found by Newton's iteration in a
    ``while_loop`` that stops when it converges."""

    def rsqrt(v):
        def body(carry):
            y, _, i = carry
            return y * (1.5 - 0.5 * v * y * y), y, i + 1

        def more(carry):
            y, previous, i = carry
            return (jnp.abs(y - previous) > 1e-6 * y) & (i < 60)

        y0 = jnp.minimum(1.0, 1.0 / v)
        return jax.lax.while_loop(more, body, (y0, 2 * y0 + 1.0, 0))[0]

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(lambda v, g: 0.9 * v + 0.1 * jnp.mean(g * g) + 1e-3, state, grads)
        return jax.tree.map(lambda v, g: -LR * g * rsqrt(v), state, grads), state

    return optax.GradientTransformation(lambda p: jax.tree.map(lambda x: jnp.zeros(()), p), update)


@jax.custom_jvp
def halved_derivative(x):
    return jnp.tanh(x)


halved_derivative.defjvp(lambda primals, tangents: (halved_derivative(primals[0]), 0.5 * tangents[0]))


def custom_rule():
    """An update through a ``custom_jvp`` function whose rule is not its
    body's derivative: a derivative through a taken step must use the rule."""

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(lambda m, g: 0.5 * m + g, state, grads)
        return jax.tree.map(lambda m: -LR * halved_derivative(m), state), state

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def host_callback():
    """The gradients go through a host function (``pure_callback``)."""

    def host(g):
        return np.asarray(np.clip(g, -1.0, 1.0), g.dtype)

    def update(grads, state, params=None):
        del params
        clipped = jax.tree.map(lambda g: jax.pure_callback(host, jax.ShapeDtypeStruct(g.shape, g.dtype), g), grads)
        return jax.tree.map(lambda g: -LR * g, clipped), state

    return optax.GradientTransformation(optax.sgd(LR).init, update)


def sorted_and_poles():
    """Momentum and a second moment, read by operations the select path
    knows: a sort and a cumulative sum (finite on finite operands), and
    ``tan``, ``cbrt``, ``atan2`` (guarded: a pole, an infinite derivative at
    0, and both at ``(0, 0)``, which a skipped first step meets with a zero
    parameter)."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)

    def direction(m, v, p):
        rank = jnp.cumsum(jnp.sort(jnp.abs(m).ravel()))[-1]
        return jnp.tan(0.5 * m) + jnp.cbrt(v) * jnp.arctan2(m, p) + m / (1.0 + rank)

    def update(grads, state, params):
        m = jax.tree.map(lambda m, g: 0.9 * m + g, state[0], grads)
        v = jax.tree.map(lambda v, g: 0.9 * v + g * g, state[1], grads)
        return jax.tree.map(lambda m, v, p: -LR * direction(m, v, p), m, v, params), (m, v)

    return optax.GradientTransformation(init, update)


def bit_rounded_momentum():
    """Momentum kept on bfloat16's grid by stochastic rounding on its
    float32 bits (``ls.low_precision``'s rounding of stored moments): bit
    casts, which the select path guards."""

    def rounded(m, g):
        new = 0.9 * m + g
        return round_stochastic(new, jnp.bfloat16, random_bits(jnp.array([1, 2], jnp.uint32), new.shape))

    def update(grads, state, params=None):
        del params
        state = jax.tree.map(lambda m, g: rounded(m, g).astype(m.dtype), state, grads)
        return jax.tree.map(lambda m: -LR * m, state), state

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


# Inner updates of the select path beyond the zoo: operations it knows.
KNOWN = {"sort_and_poles": lambda lr: sorted_and_poles(), "bit_rounded_momentum": lambda lr: bit_rounded_momentum()}
UNKNOWN = {
    "solve": lambda lr: preconditioned(jnp.linalg.solve),
    "cholesky": lambda lr: preconditioned(_cholesky),
    "eigh": lambda lr: preconditioned(_eigh_inverse_root),
    "svd": lambda lr: preconditioned(_svd_inverse_root),
    "while_newton": lambda lr: newton_normalised(),
    "custom_jvp": lambda lr: custom_rule(),
    "pure_callback": lambda lr: host_callback(),
}
CUSTOM = {**KNOWN, **UNKNOWN}
# No reverse-mode derivative: a while_loop (JAX differentiates it forward
# only) and a host callback.
NOT_REVERSE = {"while_newton", "pure_callback"}
# The zoo's optimizers whose update has no control flow take the select path.
SELECT_PATH = [name for name in OPTIMIZERS if name not in ("novograd", "multisteps_adam", "muon")]


def branched(make) -> bool:
    tx = ls.static(make(LR), scale=SCALE)
    return "cond" in primitives(functools.partial(tx.update, params=PARAMS), clean(0), tx.init(PARAMS))


@pytest.mark.parametrize("name", SELECT_PATH)
def test_the_optax_zoo_keeps_the_select_path(name):
    assert not branched(OPTIMIZERS[name])


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_an_operation_the_select_path_does_not_know_takes_the_branch(name):
    assert branched(UNKNOWN[name])


@pytest.mark.parametrize("name", list(KNOWN))
def test_operations_the_select_path_knows_keep_it(name):
    assert not branched(KNOWN[name])


@pytest.mark.parametrize("api", ["update", "fused"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CUSTOM))
def test_values_equal_the_reference(name, jit, api):
    make = CUSTOM[name]
    run = functools.partial(run_wrapped_steps, make, api)
    run = jax.jit(run) if jit else run
    for sequence, grads_seq in SEQUENCES.items():
        steps = run(jnp.float32(LR), PARAMS, grads_seq)
        for k, go in enumerate(_taken(grads_seq)):
            if not go:
                assert_trees_bitwise(steps[k + 1], steps[k], f"{name} {sequence} step {k}")
        want = run_oracle(make, _taken(grads_seq), jnp.float32(LR), PARAMS, grads_seq)
        assert_trees_close(steps[-1], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CUSTOM))
def test_derivatives_equal_the_reference(name, jit):
    make = CUSTOM[name]
    for sequence, grads_seq in SEQUENCES.items():
        taken = _taken(grads_seq)
        safe_seq = tuple(g if go else clean(9) for go, g in zip(taken, grads_seq, strict=True))

        def wrapped(params, grads_seq):
            return _objective(*run_wrapped_steps(make, "update", jnp.float32(LR), params, grads_seq)[-1])

        def oracle(params, grads_seq, taken=taken):
            return _objective(*run_oracle(make, taken, jnp.float32(LR), params, grads_seq))

        if name in NOT_REVERSE:
            tangent = jax.tree.map(jnp.ones_like, PARAMS)
            jvp = functools.partial(jax.jvp, functools.partial(lambda s, p: wrapped(p, s), grads_seq))
            got = (jax.jit(jvp) if jit else jvp)((PARAMS,), (tangent,))[1]
            want = jax.jvp(functools.partial(lambda s, p: oracle(p, s), safe_seq), (PARAMS,), (tangent,))[1]
        else:
            grad = jax.grad(wrapped, argnums=(0, 1))
            got = (jax.jit(grad) if jit else grad)(PARAMS, grads_seq)
            want = jax.grad(oracle, argnums=(0, 1))(PARAMS, safe_seq)
            zeroed = tuple(w if go else jax.tree.map(jnp.zeros_like, w) for go, w in zip(taken, want[1], strict=True))
            want = (want[0], zeroed)
        assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(got)), f"{name} {sequence}: {got}"
        assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


@contextlib.contextmanager
def debug_nans():
    previous = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        yield
    finally:
        jax.config.update("jax_debug_nans", previous)


@pytest.mark.parametrize("name", list(CUSTOM))
def test_a_skipped_step_computes_nothing_non_finite(name):
    tx = ls.static(CUSTOM[name](LR), scale=SCALE)
    scaled = jax.tree.map(lambda g: g * SCALE, clean(0))
    for state in (tx.init(PARAMS), tx.update(scaled, tx.init(PARAMS), PARAMS)[1]):
        with debug_nans():
            for update in (tx.update, jax.jit(tx.update), functools.partial(ls.apply_gradients, tx)):
                _, kept = update(overflowing(1), state, PARAMS)
                assert bool(kept.skipped)
        if name != "pure_callback":  # checkify does not see into a host function
            checked = checkify.checkify(jax.jit(tx.update), errors=checkify.float_checks)
            error, _ = checked(overflowing(1), state, PARAMS)
            assert error.get() is None, f"{name}: {error.get()}"


def overwritten():
    """A state leaf overwritten from the gradients alone (its old value is
    never read), read by a square root."""

    def update(grads, state, params=None):
        del state, params
        state = jax.tree.map(jnp.square, grads)
        return jax.tree.map(lambda s: -LR * jnp.sqrt(s), state), state

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def test_a_taken_step_keeps_the_bare_updates_symbolic_zero_tangents():
    # Differentiated with respect to the old state, a bare update's square
    # root reads a value whose tangent is a symbolic zero (the old value is
    # not read); at a zero gradient its derivative is infinite, and an
    # instantiated zero tangent there would give 0 * inf = nan.
    tx = ls.static(overwritten(), scale=SCALE)
    unscaled = {"w": clean(0)["w"].at[0, 0].set(0.0), "b": clean(0)["b"]}
    scaled = jax.tree.map(lambda g: g * SCALE, unscaled)
    state = tx.init(PARAMS)

    def wrapped(inner_state):
        updates, new = tx.update(scaled, state._replace(inner_state=inner_state), PARAMS)
        return updates, new.inner_state

    tangent = jax.tree.map(jnp.ones_like, state.inner_state)
    _, got = jax.jit(lambda s, t: jax.jvp(wrapped, (s,), (t,)))(state.inner_state, tangent)
    _, want = jax.jvp(lambda s: overwritten().update(unscaled, s, PARAMS), (state.inner_state,), (tangent,))
    assert_trees_bitwise(got, want)

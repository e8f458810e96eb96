"""The composition matrix's gradient-function and ``range_report`` cells
(see ``tests/composition.py``): every entry point that differentiates a loss
x every JAX feature, against ``jax.value_and_grad`` of ``loss * scale``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import loss_scale as ls
from tests import composition as c
from tests._compare import assert_trees_close_to_largest


def _sum_of_grads(fn, state, params):
    return lambda x: sum(jnp.sum(g) for g in jax.tree.leaves(fn(state, params, x)[1]))


def _run(feature, fn, state, params):
    """The entry point (or the reference) run the way ``feature`` says;
    returns a pytree of arrays to compare."""
    x = c.X
    if feature in ("eager",):
        return fn(state, params, x)
    if feature == "jit" or feature.startswith("loss_"):
        return jax.jit(fn)(state, params, x)
    if feature == "vmap":  # per-example values and gradients
        return jax.jit(jax.vmap(fn, in_axes=(None, None, 0)))(state, params, x[:, None])
    if feature == "scan":  # gradient accumulation over three microbatches

        @jax.jit
        def accumulate(state, params, batches):
            def body(total, batch):
                value, grads = fn(state, params, batch)
                return jax.tree.map(jnp.add, total, (value, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
            return jax.lax.scan(body, zeros, batches)[0]

        return accumulate(state, params, x.reshape(3, 2, -1))
    if feature == "while_loop":

        @jax.jit
        def accumulate(state, params, batches, n):
            def body(i, total):
                return jax.tree.map(jnp.add, total, fn(state, params, batches[i]))

            zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
            return jax.lax.fori_loop(0, n, body, zeros)

        return accumulate(state, params, x.reshape(3, 2, -1), jnp.int32(3))
    if feature == "cond":
        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
        go = jax.jit(lambda s, p, x, flag: jax.lax.cond(flag, lambda: fn(s, p, x), lambda: zeros))
        return go(state, params, x, True), go(state, params, x, False)
    if feature == "grad":  # second order: the gradients' sum differentiated by the data
        return jax.jit(jax.grad(_sum_of_grads(fn, state, params)))(x)
    if feature == "jvp":
        return jax.jit(lambda x: jax.jvp(lambda x: fn(state, params, x)[1], (x,), (jnp.ones_like(x),)))(x)
    if feature == "remat":
        return jax.jit(jax.grad(jax.checkpoint(_sum_of_grads(fn, state, params))))(x)
    if feature == "shard_map":  # data parallel: the batch split over two devices
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

        def local(state, params, x):
            value, grads = fn(state, params, x)
            return value[None], grads

        run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("x")), out_specs=(P("x"), P()))
        return jax.jit(run)(state, params, jax.device_put(x, NamedSharding(mesh, P("x"))))
    if feature == "pmap":
        return jax.pmap(fn, in_axes=(None, None, 0), devices=jax.devices()[:2])(state, params, x.reshape(2, 3, -1))
    if feature == "eval_shape":
        abstract = jax.eval_shape(fn, state, params, x)
        concrete = jax.jit(fn)(state, params, x)
        assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
        for a, v in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
            assert (a.shape, a.dtype) == (v.shape, v.dtype)
        return concrete
    if feature == "x64":
        with c.enable_x64(True):
            return jax.jit(fn)(state, params, x)
    raise AssertionError(f"no gradient cell for feature {feature!r}")


CELLS = c.run_cells("gradient")


@pytest.mark.parametrize(("entry", "feature"), CELLS, ids=[f"{e}-{f}" for e, f in CELLS])
def test_gradient_cell(entry, feature):
    loss = c.LOSSES.get(feature, c.LOSSES["plain"])
    state = c.opt_state()
    if feature == "x64":
        with c.enable_x64(True):
            state = c.opt_state()
    actual = _run(feature, c.GRADIENTS[entry](loss), state, c.GPARAMS)
    expected = _run(feature, c.reference_value_and_grad(loss), state, c.GPARAMS)
    assert_trees_close_to_largest(actual, expected, **c.FLOAT16_CLOSE, what=f"{entry} x {feature}")
    # Not vacuous: the gradients are those of loss * scale, far from zero.
    assert max(float(np.max(np.abs(np.asarray(v)))) for v in jax.tree.leaves(actual)) > 1.0


def test_value_grad_and_peak_measures_what_the_reference_backward_pass_forms():
    """On a measuring step the peak is at least the largest float16 gradient
    (the cotangent of the parameters' float16 casts) and finite. Not for
    ``loss_cond`` and ``loss_scan``, whose casts are inside the ``cond`` and
    the ``scan``: control flow is measured at its outputs only
    (``value_grad_and_peak``'s docstring)."""
    state = c.opt_state()
    for name, loss in c.LOSSES.items():
        if name in ("loss_cond", "loss_scan"):
            continue
        _, grads, peak = jax.jit(ls.value_grad_and_peak(loss))(state, c.GPARAMS, c.X)
        largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
        assert np.isfinite(float(peak)), name
        assert float(peak) >= largest * (1 - 2.0**-9), name


REPORT_CELLS = c.run_cells("report")


@pytest.mark.parametrize(("entry", "feature"), REPORT_CELLS, ids=[f"{e}-{f}" for e, f in REPORT_CELLS])
def test_range_report_cell(entry, feature):
    """``max_safe_scale`` is the largest power of two at which ``jax.grad``
    of ``loss * scale`` is finite, whatever the loss contains."""
    loss = c.LOSSES.get(feature, c.LOSSES["plain"])

    def brute_force():
        finite_at = jax.jit(
            lambda s: ls.all_finite(jax.grad(lambda p: loss(p, c.X) * s)(c.GPARAMS)),
        )
        exponents = [k for k in range(0, 40) if bool(finite_at(jnp.float32(2.0**k)))]
        assert exponents and exponents == list(range(exponents[-1] + 1))
        return 2.0 ** exponents[-1]

    if feature == "x64":
        with c.enable_x64(True):
            report, expected = ls.range_report(loss, c.GPARAMS, c.X), brute_force()
    else:
        report, expected = ls.range_report(loss, c.GPARAMS, c.X), brute_force()
    assert report.max_safe_scale == expected, (feature, str(report))

"""The composition matrix's stepper cells (see ``tests/composition.py``):
every transformation and training-state entry point x every JAX feature,
against the bare optimizer on the unscaled gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests import composition as c
from tests._compare import assert_trees_close


def _final_params(stepper, grads, step=None):
    carry = stepper.init(c.PARAMS)
    step = step or functools.partial(c.one_step, stepper)
    for g in grads:
        carry = step(carry, g)
    return stepper.params(carry)


def _jitted(stepper):
    if stepper.mutable:
        from flax import nnx

        @nnx.jit
        def step(model, optimizer, grads):
            c.one_step(stepper, (model, optimizer), grads)

        def call(carry, grads):
            step(*carry, grads)
            return carry

        return call
    return jax.jit(functools.partial(c.one_step, stepper))


def _differentiable(stepper, grads, reference):
    """``f(a)``: the sum of squares of the parameters after the steps on
    ``a * grads``, through the entry point or (``reference``) the bare
    optimizer skipping the same steps."""
    skipped = [stepper.skips and not bool(c.ls.all_finite(g)) for g in grads]

    def f(a):
        # a multiplies the finite elements only: an inf that depended on a
        # would give 0 * inf = nan in the user's own product, in reverse mode,
        # whatever the optimizer did with it.
        scaled = [jax.tree.map(lambda x: a * _finite_part(x) + (x - _finite_part(x)), g) for g in grads]
        if reference:
            kept = [g for g, s in zip(scaled, skipped, strict=True) if not s]
            params = c.reference_params(kept, skips=False)
        else:
            carry = stepper.init(c.PARAMS)
            for g in scaled:
                carry = c.one_step(stepper, carry, g)
            params = stepper.params(carry)
        return sum(jnp.sum(x**2) for x in jax.tree.leaves(params))

    return f


_DERIVATIVES: dict[tuple, object] = {}


def _derivative_reference(stepper, grads, feature):
    """The bare optimizer's derivative for a grad/jvp/remat cell, computed
    once per gradient sequence and skipping pattern."""
    kind = "jvp" if feature == "jvp" else "grad"
    key = (kind, stepper.skips, c.digest(grads))
    if key not in _DERIVATIVES:
        ref, a = _differentiable(stepper, grads, True), jnp.float32(0.7)
        _DERIVATIVES[key] = jax.jvp(ref, (a,), (jnp.float32(1.0),)) if kind == "jvp" else jax.grad(ref)(a)
    return _DERIVATIVES[key]


def _finite_part(x):
    return jnp.where(jnp.isfinite(x), x, 0)


def _check_like_reference(stepper, grads, params, what):
    assert_trees_close(params, c.reference_params(grads, stepper.skips), **c.PARAMS_CLOSE, what=what)


# The presets' cells run in test_composition_presets.py, so that the two
# halves of the matrix can run on two test workers.
CELLS = [(e, f) for e, f in c.run_cells("stepper") if not e.startswith("stepper:presets.")]


@pytest.mark.parametrize(("entry", "feature"), CELLS, ids=[f"{e}-{f}" for e, f in CELLS])
def test_stepper_cell(entry, feature, tmp_path):
    check_stepper_cell(entry, feature, tmp_path)


def check_stepper_cell(entry, feature, tmp_path):
    """Runs one cell: ``entry`` driven with ``feature``, against the bare
    optimizer."""
    if feature == "pickle":
        pytest.importorskip("cloudpickle")
    build = c.STEPPERS[entry]
    stepper = build(c.copier(feature)) if feature in ("copy", "deepcopy", "pickle") else build()
    grads = c.unscaled_grads(overflow=stepper.skips)
    what = f"{entry} x {feature}"

    if feature == "eager":
        _check_like_reference(stepper, grads, _final_params(stepper, grads), what)

    elif feature == "jit":
        _check_like_reference(stepper, grads, _final_params(stepper, grads, _jitted(stepper)), what)

    elif feature in ("copy", "deepcopy", "pickle"):
        # The transformation was copied at build; the carry (which for a flax
        # TrainState holds the transformation too) is copied mid-run.
        step = _jitted(stepper)
        carry = step(stepper.init(c.PARAMS), grads[0])
        carry = c.copier(feature)(carry)
        for g in grads[1:]:
            carry = step(carry, g)
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature == "vmap":
        runs = [c.unscaled_grads(run, overflow=stepper.skips and run == 0) for run in range(3)]
        carry = jax.vmap(stepper.init)(c.stack([c.PARAMS] * 3))
        step = jax.jit(jax.vmap(functools.partial(c.one_step, stepper)))
        for t in range(3):
            carry = step(carry, c.stack([run[t] for run in runs]))
        params = stepper.params(carry)
        for i, run in enumerate(runs):
            _check_like_reference(stepper, run, jax.tree.map(lambda x, i=i: x[i], params), f"{what} run {i}")

    elif feature == "scan":

        @jax.jit
        def train(carry, stacked):
            return jax.lax.scan(lambda carry, g: (c.one_step(stepper, carry, g), None), carry, stacked)[0]

        carry = train(stepper.init(c.PARAMS), c.stack(grads))
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature == "while_loop":

        @jax.jit
        def train(carry, stacked, n):
            def body(i, carry):
                return c.one_step(stepper, carry, jax.tree.map(lambda x: x[i], stacked))

            return jax.lax.fori_loop(0, n, body, carry)  # a traced trip count: a while_loop

        carry = train(stepper.init(c.PARAMS), c.stack(grads), jnp.int32(len(grads)))
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature == "cond":

        @jax.jit
        def step(carry, g, go):
            return jax.lax.cond(go, lambda: c.one_step(stepper, carry, g), lambda: carry)

        carry = stepper.init(c.PARAMS)
        for g in grads:
            carry = step(carry, g, True)
            carry = step(carry, g, False)  # the branch not taken changes nothing
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature in ("grad", "jvp", "remat"):
        f = _differentiable(stepper, grads, False)
        a = jnp.float32(0.7)
        if feature == "grad":
            actual = jax.jit(jax.grad(f))(a)
        elif feature == "jvp":
            actual = jax.jit(lambda a: jax.jvp(f, (a,), (jnp.float32(1.0),)))(a)
        else:
            actual = jax.jit(jax.grad(jax.checkpoint(f)))(a)
        expected = _derivative_reference(stepper, grads, feature)
        for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            assert np.isfinite(np.asarray(x)).all(), what
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, err_msg=what)

    elif feature == "shard_map":
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
        replicated = jax.jit(
            jax.shard_map(functools.partial(c.one_step, stepper), mesh=mesh, in_specs=(P(), P()), out_specs=P())
        )
        _check_like_reference(stepper, grads, _final_params(stepper, grads, replicated), what)

    elif feature == "pmap":
        step = jax.pmap(functools.partial(c.one_step, stepper), devices=jax.devices()[:2])
        carry = jax.tree.map(lambda x: jnp.stack([x, x]), stepper.init(c.PARAMS))
        for g in grads:
            carry = step(carry, c.stack([g, g]))
        params = stepper.params(carry)
        for device in range(2):
            _check_like_reference(stepper, grads, jax.tree.map(lambda x, d=device: x[d], params), what)

    elif feature == "donation":
        step = jax.jit(functools.partial(c.one_step, stepper), donate_argnums=0)
        carry = stepper.init(c.PARAMS)
        carry = jax.tree.map(jnp.copy, carry)  # buffers of its own, which the step may take
        for g in grads:
            carry = step(carry, g)
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature == "eval_shape":
        if stepper.mutable:
            pytest.fail("excluded")
        abstract = jax.eval_shape(stepper.init, c.PARAMS)
        carry = stepper.init(c.PARAMS)
        _assert_same_types(abstract, carry, what)
        _assert_same_types(jax.eval_shape(functools.partial(c.one_step, stepper), carry, grads[0]), carry, what)

    elif feature == "checkpoint":
        pytest.importorskip("orbax.checkpoint")
        step = _jitted(stepper)
        carry = stepper.init(c.PARAMS)
        carry = step(step(carry, grads[0]), grads[1])
        carry = _round_trip(stepper, carry, tmp_path)
        carry = step(carry, grads[2])
        _check_like_reference(stepper, grads, stepper.params(carry), what)

    elif feature == "x64":
        dtypes = [_dtype(x) for x in jax.tree.leaves(stepper.init(c.PARAMS))]
        with c.enable_x64(True):
            stepper = build()
            carry = stepper.init(c.PARAMS)
            assert [_dtype(x) for x in jax.tree.leaves(carry)] == dtypes, what
            step = jax.jit(functools.partial(c.one_step, stepper))
            for g in grads:
                carry = step(carry, g)
            assert [_dtype(x) for x in jax.tree.leaves(carry)] == dtypes, what
            _check_like_reference(stepper, grads, stepper.params(carry), what)

    else:
        raise AssertionError(f"no stepper cell for feature {feature!r}")


def _dtype(x):
    # flax's TrainState.create keeps step a Python int until the first step.
    return getattr(x, "dtype", type(x))


def _assert_same_types(abstract, concrete, what):
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete), what
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
        x = jnp.asarray(x)
        assert (a.shape, a.dtype) == (x.shape, x.dtype), what


def _round_trip(stepper, carry, path):
    """Saves the carry's arrays with orbax and restores them into a freshly
    initialised carry, as a training script resuming from a checkpoint."""
    import orbax.checkpoint as ocp

    if stepper.mutable:
        from flax import nnx

        graphdef, state = nnx.split(carry)
        pure = nnx.to_pure_dict(state)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path / "ckpt", pure)
        fresh_graphdef, fresh_state = nnx.split(stepper.init(c.PARAMS))
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(fresh_state))
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / "ckpt", target)
        nnx.replace_by_pure_dict(fresh_state, restored)
        return nnx.merge(fresh_graphdef, fresh_state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "ckpt", carry)
    fresh = stepper.init(c.PARAMS)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path / "ckpt", target)

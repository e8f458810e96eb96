"""Per-segment scaling where it meets the rest of JAX and the frameworks:
boundaries under ``vmap``, ``jax.checkpoint``, ``lax.cond`` and inside
jitted functions; a train step under ``vmap``, inside ``lax.scan`` and under
``shard_map``; flax linen and NNX modules, Equinox modules; checkpoints,
``copy.deepcopy``, callbacks and differentiating through the update. Each is checked
against a float32 oracle of the same model, or a reference run."""

import copy

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import loss_scale as ls
from tests import _segment_models as models

FLOAT16_ROUNDING = 1e-2


def segmented(*names, inner=None, **kwargs):
    return ls.predictive(inner or optax.sgd(0.0), initial_scale=1.0, segments=names, **kwargs)


def measured_grads(tx, loss_fn, params, *args, steps=3):
    """The unscaled gradients after ``steps`` measuring steps (learning rate
    0), and the state."""
    state = tx.init(params)
    step = jax.jit(lambda state, params, *args: ls.value_grad_and_peak(loss_fn, every=1)(state, params, *args))
    for _ in range(steps):
        _, grads, peaks = step(state, params, *args)
        _, state = tx.update(grads, state, params, backward_peak=peaks)
    _, grads, _ = step(state, params, *args)
    return ls.unscale(grads, state), state


def train_step(tx, loss_fn, every=1, axis_name=None):
    """``(params, state, x) -> (params, state)``: one measured step of ``tx``."""
    measure = ls.value_grad_and_peak(loss_fn, every=every, axis_name=axis_name)

    def step(params, state, x):
        _, grads, peaks = measure(state, params, x)
        updates, state = tx.update(grads, state, params, backward_peak=peaks)
        return optax.apply_updates(params, updates), state

    return step


def shrink(h, binades):
    """``h`` forward; its cotangents ``2**-binades`` times smaller."""
    small = h * jnp.asarray(2.0**-binades, h.dtype)
    return small + jax.lax.stop_gradient(h - small)


def two_segment_loss(make_head):
    """A loss whose embedding's cotangents are ~2**-40 of the head's, 20
    binades on either side of the boundary: ``make_head(params, h, dtype)``
    computes the head from the marked embedding output."""

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        h = shrink(jnp.tanh(x.astype(dtype) @ params["embed"].astype(dtype)), 20)
        if marked:
            h = ls.segment(h, "embed")
        return make_head(params, shrink(h, 20), dtype)

    return loss_fn


def dense_head(params, h, dtype):
    return jnp.mean((h @ params["head"].astype(dtype)).astype(jnp.float32) ** 2)


def params_and_batch():
    rng = np.random.default_rng(0)
    params = {
        "embed": jnp.asarray(rng.standard_normal((6, 8)) / 3, jnp.float32),
        "head": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32),
    }
    return params, jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)


def check_against_oracle(loss_fn, params, x, tx=None):
    oracle = jax.grad(lambda p: loss_fn(p, x, jnp.float32, marked=False))(params)
    grads, state = measured_grads(tx or segmented("embed"), loss_fn, params, x)
    for name in params:
        assert models.relative_error(grads[name], oracle[name]) < FLOAT16_ROUNDING, name
    assert int(state.counters.segment_exponents["embed"]) >= 10
    return state


def test_the_two_segment_model_needs_them():
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    oracle = jax.grad(lambda p: loss_fn(p, x, jnp.float32, marked=False))(params)
    grads, _ = measured_grads(ls.predictive(optax.sgd(0.0), initial_scale=1.0), lambda p, x: loss_fn(p, x), params, x)
    assert models.relative_error(grads["embed"], oracle["embed"]) == 1.0  # one scale flushes the embedding
    check_against_oracle(loss_fn, params, x)


def test_a_boundary_under_vmap():
    def head(params, h, dtype):
        return jnp.mean(jax.vmap(lambda row: jnp.sum((row @ params["head"].astype(dtype)).astype(jnp.float32) ** 2))(h))

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        inner = two_segment_loss(lambda p, h, d: h)

        def one(row):
            return inner(params, row[None], dtype, marked)[0]

        return head(params, jax.vmap(one)(x), dtype)

    check_against_oracle(loss_fn, *params_and_batch())


def test_a_boundary_inside_a_jitted_function_and_a_checkpoint():
    base = two_segment_loss(dense_head)

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        return jax.jit(jax.checkpoint(lambda p, x: base(p, x, dtype, marked)))(params, x)

    check_against_oracle(loss_fn, *params_and_batch())


def test_a_boundary_inside_a_cond_branch():
    base = two_segment_loss(dense_head)

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        taken, other = (lambda: base(params, x, dtype, marked)), (lambda: base(params, x, dtype, False))
        return jax.lax.cond(x[0, 0] > -100, taken, other)

    check_against_oracle(loss_fn, *params_and_batch())


def test_a_boundary_inside_a_checkpoint_and_a_cond_branch_that_hold_a_callback():
    # Rebuilt for their boundaries all the same: bound as they are (as an
    # equation with effects is by default), the boundary would do nothing.
    base = two_segment_loss(dense_head)

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        def body(params, x):
            jax.debug.callback(lambda v: None, x[0, 0])
            return base(params, x, dtype, marked)

        taken, other = (lambda: jax.checkpoint(body)(params, x)), (lambda: base(params, x, dtype, False))
        return jax.lax.cond(x[0, 0] > -100, taken, other)

    check_against_oracle(loss_fn, *params_and_batch())


def test_a_train_step_under_vmap_keeps_one_state_per_member():
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    tx = segmented("embed", inner=optax.adam(1e-3))
    step = train_step(tx, loss_fn)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
    states = jax.vmap(tx.init)(stacked)
    xs = jnp.stack([x, x * 0.5])
    for _ in range(3):
        stacked, states = jax.jit(jax.vmap(step))(stacked, states, xs)
    # Each member equals its own unbatched run.
    for member in range(2):
        p, s = params, tx.init(params)
        for _ in range(3):
            p, s = jax.jit(step)(p, s, xs[member])
        # Integer counters agree exactly; measured peaks come from the batched program's
        # own matmuls, so they agree to float32 rounding.
        for a, b in zip(jax.tree.leaves(s.counters), jax.tree.leaves(states.counters), strict=True):
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b[member], rtol=1e-6)
            else:
                np.testing.assert_array_equal(a, b[member])
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(stacked), strict=True):
            np.testing.assert_allclose(a, b[member], rtol=1e-6)


def test_a_train_step_inside_lax_scan_equals_the_python_loop():
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    tx = segmented("embed", inner=optax.adam(1e-3))

    train = train_step(tx, loss_fn, every=2)

    def step(carry, _):
        params, state = train(*carry, x)
        return (params, state), state.scale

    four_steps = jax.jit(lambda carry: jax.lax.scan(step, carry, None, length=4))
    (scanned, scanned_state), scales = four_steps((params, tx.init(params)))
    carry = (params, tx.init(params))
    looped = []
    for _ in range(4):
        carry, scale = jax.jit(step)(carry, None)
        looped.append(float(scale))
    assert [float(s) for s in scales] == looped
    np.testing.assert_array_equal(scanned_state.counters.segments.exponent, carry[1].counters.segments.exponent)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(carry[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_shard_map_data_parallel_equals_one_device():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets 8 virtual CPU devices)")
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    x = jnp.concatenate([x, x[::-1] * 0.5])  # 10 rows, 5 per device
    tx = segmented("embed", inner=optax.sgd(0.1), axis_name="data")
    reference_tx = segmented("embed", inner=optax.sgd(0.1))
    mesh = jax.make_mesh((2,), ("data",))
    spec = jax.sharding.PartitionSpec
    local_step = train_step(tx, loss_fn, axis_name="data")
    sharded = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(spec(), spec(), spec("data")), out_specs=(spec(), spec()))
    )
    reference_step = jax.jit(train_step(reference_tx, loss_fn))
    p, s = params, tx.init(params)
    rp, rs = params, reference_tx.init(params)
    x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec("data")))
    for _ in range(3):
        p, s = sharded(p, s, x_sharded)
        rp, rs = reference_step(rp, rs, x)
    assert float(s.scale) == float(rs.scale)
    np.testing.assert_array_equal(s.counters.segments.exponent, rs.counters.segments.exponent)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


class LinenModel(nn.Module):
    marked: bool = True
    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, x):
        h = shrink(jnp.tanh(nn.Dense(8, dtype=self.dtype)(x)), 20)
        if self.marked:
            h = ls.segment(h, "embed")
        return nn.Dense(3, dtype=self.dtype)(shrink(h, 20))


def test_a_boundary_in_a_flax_linen_module():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 6)), jnp.float32)
    params = LinenModel().init(jax.random.key(0), x)["params"]

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        out = LinenModel(marked=marked, dtype=dtype).apply({"params": params}, x)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    oracle = jax.grad(lambda p: loss_fn(p, x, jnp.float32, False))(params)
    grads, state = measured_grads(segmented("embed"), loss_fn, params, x)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(oracle), strict=True):
        assert models.relative_error(a, b) < FLOAT16_ROUNDING
    assert int(state.counters.segment_exponents["embed"]) >= 10


class NnxModel(nnx.Module):
    def __init__(self, rngs, marked=True):
        self.embed = nnx.Linear(6, 8, dtype=jnp.float16, rngs=rngs)
        self.norm = nnx.BatchNorm(8, dtype=jnp.float16, rngs=rngs)
        self.head = nnx.Linear(8, 3, dtype=jnp.float16, rngs=rngs)
        self.marked = marked

    def __call__(self, x):
        h = shrink(jnp.tanh(self.norm(self.embed(x))), 20)
        if self.marked:
            h = ls.segment(h, "embed")
        return self.head(shrink(h, 20))


def test_a_boundary_in_an_nnx_module_with_batch_statistics():
    from loss_scale.flax import nnx_value_and_grad

    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 6)), jnp.float32)

    def loss_fn(model, x):
        return jnp.mean(model(x).astype(jnp.float32) ** 2)

    model = NnxModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, segmented("embed"), wrt=nnx.Param)
    reference = NnxModel(nnx.Rngs(0), marked=False)
    _, oracle = nnx.value_and_grad(loss_fn)(reference, x)  # also updates the reference's batch statistics
    state = models.with_exponents(optimizer.opt_state, scale=2.0**14, embed=20)
    _, grads = nnx_value_and_grad(loss_fn)(state, model, x)
    unscaled = ls.unscale(grads, state)
    # The batch statistics moved as nnx.grad moves them (to float32 rounding: the two
    # programs are traced differently, and XLA may order the mean's sum differently).
    np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...], rtol=1e-6, atol=1e-9)
    assert not np.allclose(model.norm.mean[...], 0.0)
    # The embedding's gradient: the unmarked float16 run flushes it, this one keeps it.
    assert float(jnp.max(jnp.abs(oracle["embed"]["kernel"][...]))) == 0.0
    assert float(jnp.max(jnp.abs(unscaled["embed"]["kernel"][...]))) > 0.0
    np.testing.assert_allclose(unscaled["head"]["kernel"][...], oracle["head"]["kernel"][...], rtol=1e-2)


class EqxModel(eqx.Module):
    embed: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x, dtype=jnp.float16, marked=True):
        model = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, self)
        h = shrink(jnp.tanh(model.embed(x.astype(dtype))), 20)
        if marked:
            h = ls.segment(h, "embed")
        return model.head(shrink(h, 20))


def test_a_boundary_in_an_equinox_module():
    from loss_scale import equinox as lsq

    keys = jax.random.split(jax.random.key(0))
    model = EqxModel(eqx.nn.Linear(6, 8, key=keys[0]), eqx.nn.Linear(8, 3, key=keys[1]))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 6)), jnp.float32)

    def loss_fn(model, x, dtype=jnp.float16, marked=True):
        return jnp.mean(jax.vmap(lambda r: model(r, dtype, marked))(x).astype(jnp.float32) ** 2)

    tx = segmented("embed")
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    state = models.with_exponents(state, scale=2.0**14, embed=20)
    _, grads = lsq.filter_value_and_grad(loss_fn)(state, model, x)
    oracle = eqx.filter_grad(lambda m: loss_fn(m, x, jnp.float32, False))(model)
    for a, b in zip(jax.tree.leaves(ls.unscale(grads, state)), jax.tree.leaves(oracle), strict=True):
        assert models.relative_error(a, b) < FLOAT16_ROUNDING


def test_the_state_survives_an_orbax_checkpoint_and_resumes_bit_identically(tmp_path):
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    tx = segmented("embed", inner=optax.adam(1e-3))
    step = jax.jit(train_step(tx, loss_fn, every=2))
    state = tx.init(params)
    for _ in range(3):
        params, state = step(params, state, x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"state": state, "params": params})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", {"state": state, "params": params})
    a, b = (params, state), (restored["params"], restored["state"])
    for _ in range(3):
        a, b = step(*a, x), step(*b, x)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


def test_a_callback_in_the_loss_fires_once_a_step_with_the_forward_value():
    seen = []

    def loss_fn(params, x, dtype=jnp.float16, marked=True):
        h = jnp.tanh(x.astype(dtype) @ params["embed"].astype(dtype))
        jax.debug.callback(lambda v: seen.append(float(v)), jnp.max(h).astype(jnp.float32))
        if marked:
            h = ls.segment(h, "embed")
        return dense_head(params, h, dtype)

    params, x = params_and_batch()
    tx = segmented("embed", inner=optax.sgd(0.1))
    step = jax.jit(train_step(tx, loss_fn, every=2))  # measuring and plain steps in turn
    state, expected = tx.init(params), []
    for _ in range(3):
        expected.append(float(jnp.max(jnp.tanh(x.astype(jnp.float16) @ params["embed"].astype(jnp.float16)))))
        params, state = step(params, state, x)
    jax.effects_barrier()
    # Once a step; the value to float16 rounding (the step is another program).
    assert len(seen) == 3
    np.testing.assert_allclose(seen, expected, rtol=2**-10)


def test_the_transformation_deep_copies_and_its_update_differentiates():
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    tx = copy.deepcopy(segmented("embed", inner=optax.sgd(0.1)))
    state = tx.init(params)
    _, grads, peaks = ls.value_grad_and_peak(loss_fn, every=1)(state, params, x)

    def after_one_step(lr):
        updates, _ = tx.update(jax.tree.map(lambda g: g * lr, grads), state, params, backward_peak=peaks)
        return jnp.sum(optax.apply_updates(params, updates)["head"])

    derivative = jax.grad(after_one_step)(1.0)
    expected = -0.1 * jnp.sum(ls.unscale(grads, state)["head"])
    np.testing.assert_allclose(derivative, expected, rtol=1e-5)


def test_pmap_data_parallel_equals_one_device():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets 8 virtual CPU devices)")
    loss_fn = two_segment_loss(dense_head)
    params, x = params_and_batch()
    x = jnp.concatenate([x, x[::-1] * 0.5])  # 10 rows, 5 per device
    tx = segmented("embed", inner=optax.sgd(0.1), axis_name="data")
    reference_tx = segmented("embed", inner=optax.sgd(0.1))
    local_step = jax.pmap(train_step(tx, loss_fn, axis_name="data"), axis_name="data")
    reference_step = jax.jit(train_step(reference_tx, loss_fn))
    replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([a, a]), tree)  # noqa: E731
    p, s = replicate(params), replicate(tx.init(params))
    rp, rs = params, reference_tx.init(params)
    for _ in range(3):
        p, s = local_step(p, s, x.reshape(2, 5, -1))
        rp, rs = reference_step(rp, rs, x)
    # Every replica alike. Under pmap each device differentiates its own
    # batch's mean loss, whose cotangents are twice the whole batch's: the
    # measured peaks, and so the global scale, differ by that factor; the
    # boundaries' factors (relative) and the updates do not.
    assert float(s.scale[0]) == float(s.scale[1]) in (float(rs.scale), float(rs.scale) / 2)
    np.testing.assert_array_equal(s.counters.segments.exponent[0], s.counters.segments.exponent[1])
    np.testing.assert_array_equal(s.counters.segments.exponent[0], rs.counters.segments.exponent)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp), strict=True):
        np.testing.assert_allclose(a[0], b, rtol=1e-3, atol=1e-6)

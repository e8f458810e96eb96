"""``ls.low_precision`` with the rest of the stack: loss scaling and its
skipped steps, ``jit``/``vmap``/``scan``, many devices, orbax checkpoints,
flax's ``TrainState``, this library's NNX ``Optimizer`` and the Equinox
helpers.

The tests run on 8 virtual CPU devices (tests/conftest.py sets XLA_FLAGS).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import loss_scale as ls
from tests._compare import assert_trees_bitwise, assert_trees_close
from tests._jaxprs import primitives

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
N = 4


def make_params(dtype=BF16):
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(16, 4)) * 0.5, dtype), "ln": jnp.ones(4, F32)}


def grads_for(step, params, scale=1.0):
    rng = np.random.default_rng(1000 + step)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 1e-2 * scale, p.dtype), params)


def make_tx(rounding, wrapper=ls.dynamic, **kwargs):
    inner = ls.low_precision(optax.adamw(1e-3), rounding, state_dtype=jnp.bfloat16, seed=1)
    return wrapper(inner, initial_scale=2.0**4, **kwargs)


# ---------------------------------------------------------------------------
# Skipped steps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", [ls.dynamic, ls.predictive], ids=["dynamic", "predictive"])
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_keeps_params_compensation_key_and_inner_state(rounding, fused, wrapper, jit):
    tx = make_tx(rounding, wrapper)
    params = make_params()

    def step(params, state, grads):
        if fused:
            return ls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jit(step)
    state = tx.init(params)
    for i in range(3):  # a few taken steps: a compensation, moments and a key that moved
        params, state = step(params, state, grads_for(i, params, scale=16.0))
    inner = state.inner_state
    assert not bool(ls.find_state(state).skipped)
    overflow = grads_for(3, params, scale=16.0)
    overflow["w"] = overflow["w"].at[2, 1].set(jnp.inf)  # an overflow in the float16/bfloat16 backward pass
    new_params, new_state = step(params, state, overflow)
    assert bool(new_state.skipped) and float(new_state.scale) < float(state.scale)
    assert_trees_bitwise(new_params, params)
    assert_trees_bitwise(new_state.inner_state, inner)  # compensation, key, moments, count
    # The next taken step moves everything again, the key included.
    after_params, after = step(new_params, new_state, grads_for(4, params, scale=8.0))
    assert not bool(after.skipped)
    assert not np.array_equal(np.asarray(after.inner_state.key), np.asarray(inner.key))
    assert not np.array_equal(np.asarray(after_params["w"], np.float32), np.asarray(params["w"], np.float32))


@pytest.mark.parametrize("rounding", ["kahan", "stochastic", "nearest"])
def test_loss_scaling_skips_without_a_branch_and_without_a_nan(rounding):
    # Every operation of the rounding is finite on finite operands or, as
    # its bit casts, guarded, so ls.dynamic's select path keeps the update
    # (no lax.cond, which would make XLA materialize every operand), and a
    # skipped step, which runs it on zeroed gradients, computes nothing
    # non-finite (jax_debug_nans).
    tx = make_tx(rounding)
    params = make_params(F16)
    state = tx.init(params)
    names = primitives(lambda p, s, g: ls.apply_gradients(tx, g, s, p), params, state, params)
    assert "cond" not in names and "custom_jvp_call" in names
    step = jax.jit(lambda p, s, g: ls.apply_gradients(tx, g, s, p))
    overflow = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads_for(0, params, scale=16.0))
    with jax.debug_nans(True):
        new_params, new_state = step(params, state, overflow)
        jax.block_until_ready(new_params)
    assert bool(new_state.skipped)
    assert_trees_bitwise((new_params, new_state.inner_state), (params, state.inner_state))


def test_extra_arguments_reach_the_inner_optimizer():
    # value= (the loss) passes through ls.dynamic and low_precision to optax's reduce_on_plateau.
    inner = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
    tx = ls.dynamic(ls.low_precision(inner, "kahan"), initial_scale=16.0)
    params = make_params()
    state = tx.init(params)
    for i in range(4):
        updates, state = tx.update(grads_for(i, params, scale=16.0), state, params, value=jnp.float32(1.0))
        params = optax.apply_updates(params, updates)
    plateau = optax.tree_utils.tree_get(state.inner_state, "scale")
    assert float(plateau) < 1.0  # the plateau was seen: the loss arrived


def test_fused_and_two_step_updates_agree():
    tx = make_tx("stochastic")
    params = make_params()
    fused = two_step = (params, tx.init(params))

    @jax.jit
    def step_fused(params, state, grads):
        return ls.apply_gradients(tx, grads, state, params)

    @jax.jit
    def step_two(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(10):
        grads = grads_for(i, params, scale=16.0)
        if i == 4:
            grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
        fused, two_step = step_fused(*fused, grads), step_two(*two_step, grads)
    assert int(fused[1].skipped_steps) == 1
    assert_trees_bitwise(fused, two_step)


# ---------------------------------------------------------------------------
# jit, vmap, scan
# ---------------------------------------------------------------------------


def test_vmap_over_an_ensemble_equals_each_model_alone():
    tx = ls.low_precision(optax.adam(1e-2), "stochastic", state_dtype=jnp.bfloat16)
    models = [jax.tree.map(lambda x, k=k: x * (k + 1), make_params()) for k in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *models)
    states = jax.vmap(tx.init)(stacked)
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *[grads_for(k, m) for k, m in enumerate(models)])

    @jax.jit
    @jax.vmap
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    batched = step(stacked, states, grads)
    for k, model in enumerate(models):
        alone = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))(
            model, tx.init(model), grads_for(k, model)
        )
        assert_trees_bitwise(jax.tree.map(lambda x, k=k: x[k], batched), alone, what=f"model {k}")


@pytest.mark.parametrize("rounding", ["kahan", "stochastic", "nearest"])
def test_scan_over_steps_equals_a_loop_of_jitted_steps(rounding):
    tx = make_tx(rounding)
    params = make_params()
    grads = [grads_for(i, params, scale=16.0) for i in range(12)]
    grads[5]["w"] = grads[5]["w"].at[3, 3].set(jnp.inf)

    def step(carry, grads):
        params, state = carry
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    scanned, _ = jax.jit(lambda c, g: jax.lax.scan(step, c, g))((params, tx.init(params)), stacked)
    looped = (params, tx.init(params))
    jitted = jax.jit(step)
    for g in grads:
        looped, _ = jitted(looped, g)
    assert int(scanned[1].skipped_steps) == 1
    # Two programs: XLA:CPU contracts a product and a sum into one fused
    # multiply-add (one rounding instead of two) where its fusion allows, so
    # the inner update's float32 arithmetic can differ in the last bit between
    # them. Rounded to bfloat16 that is almost always absorbed (it was for
    # stochastic and nearest here); the Kahan compensation keeps it, and what
    # it feeds back moves a moment or a parameter by one unit in the last place.
    if rounding == "kahan":

        def without_compensation(run):
            params, state = run
            return params, state._replace(inner_state=state.inner_state._replace(compensation=None))

        assert_trees_close(without_compensation(scanned), without_compensation(looped), rtol=_eps, atol=0)
        c_scan, c_loop = (np.asarray(run[1].inner_state.compensation["w"], np.float64) for run in (scanned, looped))
        p = np.asarray(looped[0]["w"], np.float64)
        assert np.all(np.abs(c_scan - c_loop) <= 2.0**-8 * np.abs(p))  # well below half the parameter's resolution
    else:
        assert_trees_bitwise(scanned, looped)


def _eps(dtype):
    """One unit in the last place at 1 for a floating dtype; 0 (exact) for the rest."""
    return float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0


# ---------------------------------------------------------------------------
# Many devices
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count>=4 (tests/conftest.py sets it)")
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def regression_loss(params, x, y):
    w = params["w"].astype(jnp.float32)
    return jnp.mean((x @ w - y) ** 2)


def regression_batch(step, n):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    return x, (x @ np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)).astype(np.float32)


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_replicas_on_four_devices_stay_identical(mesh, rounding):
    # Data parallel under shard_map: each device keeps its own copy of the
    # bfloat16 params and the state (stacked along the device axis, so any
    # disagreement would show), sees its own batch, and averages gradients.
    tx = ls.dynamic(ls.low_precision(optax.adam(1e-2), rounding, state_dtype=jnp.bfloat16), axis_name="data")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    def step(params, state, x, y):
        params, state = jax.tree.map(lambda a: a[0], (params, state))
        _, grads = ls.value_and_grad(regression_loss, axis_name="data")(state, params, x, y)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda a: a[None], (optax.apply_updates(params, updates), state))

    step = jax.jit(step)
    params = {"w": jnp.zeros((16, 4), BF16)}
    stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)  # noqa: E731
    params, state = stack(params), stack(tx.init(params))
    for i in range(30):
        params, state = step(params, state, *regression_batch(i, N * 8))
    for leaf in jax.tree.leaves((params, state)):
        leaf = np.asarray(leaf).reshape(N, -1)
        for d in range(1, N):
            np.testing.assert_array_equal(leaf[d].view(np.uint8), leaf[0].view(np.uint8))
    start = regression_loss({"w": jnp.zeros((16, 4), BF16)}, *regression_batch(99, 64))
    assert float(regression_loss(jax.tree.map(lambda a: a[0], params), *regression_batch(99, 64))) < 0.5 * start


def test_pmap_replicas_stay_identical(mesh):
    del mesh
    tx = ls.dynamic(ls.low_precision(optax.adam(1e-2), "stochastic", state_dtype=jnp.bfloat16), axis_name="batch")

    def step(params, state, x, y):
        _, grads = ls.value_and_grad(regression_loss, axis_name="batch")(state, params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:N])
    params = {"w": jnp.zeros((16, 4), BF16)}
    replicate = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)  # noqa: E731
    params, state = replicate(params), replicate(tx.init(params))
    for i in range(10):
        x, y = regression_batch(i, N * 8)
        params, state = pstep(params, state, x.reshape(N, 8, 16), y.reshape(N, 8, 4))
    for leaf in jax.tree.leaves((params, state)):
        leaf = np.asarray(leaf).reshape(N, -1)
        for d in range(1, N):
            np.testing.assert_array_equal(leaf[d].view(np.uint8), leaf[0].view(np.uint8))
    assert np.any(np.asarray(params["w"], np.float32) != 0)


def test_a_sharded_run_equals_a_single_device_run(mesh):
    # The random bits number each element of a leaf, whatever the sharding:
    # the params split by rows over four devices round as on one device.
    tx = ls.low_precision(optax.adam(1e-2), "stochastic", state_dtype=jnp.bfloat16)
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 8)), BF16)}
    grads = [{"w": jnp.asarray(np.random.default_rng(i).normal(size=(64, 8)), F32)} for i in range(5)]

    def run(params, place):
        state = tx.init(params)
        step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
        for g in grads:
            params, state = step(params, state, place(g))
        return params, state

    by_rows = NamedSharding(mesh, P("data"))
    sharded = run(jax.device_put(params, by_rows), lambda g: jax.device_put(g, by_rows))
    assert sharded[0]["w"].sharding == by_rows
    single = run(jax.device_put(params, jax.devices()[0]), lambda g: g)
    assert_trees_bitwise(jax.device_get(sharded), jax.device_get(single))


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_orbax_restore_continues_bit_for_bit(tmp_path, rounding):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = make_tx(rounding)

    @jax.jit
    def step(params, state, grads):
        return ls.apply_gradients(tx, grads, state, params)

    def train(params, state, start, stop):
        for i in range(start, stop):
            params, state = step(params, state, grads_for(i, params, scale=16.0))
        return params, state

    params = make_params()
    uninterrupted = train(params, tx.init(params), 0, 20)
    params, state = train(params, tx.init(params), 0, 9)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    fresh = make_params()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": fresh, "opt_state": tx.init(fresh)})
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"].inner_state, ls.LowPrecisionState)
    assert restored["opt_state"].inner_state.key.dtype == jnp.uint32
    assert_trees_bitwise(restored, {"params": params, "opt_state": state})
    assert_trees_bitwise(train(restored["params"], restored["opt_state"], 9, 20), uninterrupted)


# ---------------------------------------------------------------------------
# Frameworks
# ---------------------------------------------------------------------------


def manual_steps(tx, params, steps):
    """The reference: tx.update and optax.apply_updates, jitted."""
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for i in range(steps):
        params, state = step(params, state, grads_for(i, params, scale=16.0))
    return params, state


@pytest.mark.parametrize("flavour", ["flax", "loss_scale.flax"])
def test_flax_train_state_apply_gradients(flavour):
    from flax.training import train_state

    import loss_scale.flax as lsf

    cls = train_state.TrainState if flavour == "flax" else lsf.TrainState
    tx = make_tx("kahan")
    params = make_params()
    state = cls.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
    for i in range(5):
        state = step(state, grads_for(i, state.params, scale=16.0))
    assert state.params["w"].dtype == BF16 and int(state.step) == 5
    assert_trees_bitwise((state.params, state.opt_state), manual_steps(tx, params, 5))


def test_nnx_optimizer_updates_bfloat16_params():
    from flax import nnx

    import loss_scale.flax as lsf

    model = nnx.Linear(8, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tx = ls.dynamic(ls.low_precision(optax.adam(1e-2), "stochastic", state_dtype=jnp.bfloat16))
    optimizer = lsf.Optimizer(model, tx, wrt=nnx.Param)
    reference_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), F32)

    def loss_fn(model, x):
        return jnp.mean(model(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x):
        _, grads = lsf.nnx_value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads)

    for _ in range(5):
        train_step(model, optimizer, x)
    assert model.kernel[...].dtype == BF16 and int(optimizer.step[...]) == 5
    assert not bool(lsf.find_state(optimizer).skipped)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert not np.array_equal(
        np.asarray(state["kernel"], np.float32), np.asarray(reference_params["kernel"], np.float32)
    )
    assert float(loss_fn(model, x)) < float(loss_fn(nnx.merge(nnx.graphdef(model), reference_params), x))


def test_equinox_apply_gradients():
    eqx = pytest.importorskip("equinox")
    from loss_scale import equinox as lsq

    model = eqx.nn.MLP(4, 2, width_size=8, depth=1, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(BF16) if eqx.is_inexact_array(x) else x, model)
    tx = make_tx("kahan")
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 4)), BF16)

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)

    @eqx.filter_jit
    def train_step(model, opt_state, x):
        loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x)
        model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)
        return model, opt_state, loss

    losses = []
    for _ in range(20):
        model, opt_state, loss = train_step(model, opt_state, x)
        losses.append(float(loss))
    assert model.layers[0].weight.dtype == BF16 and losses[-1] < losses[0]
    assert ls.find_state(opt_state).inner_state.compensation.layers[0].weight.dtype == BF16

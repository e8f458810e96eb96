"""Many devices: sharded jit, shard_map and pmap agree on every skip.

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
from tests._compare import assert_trees_bitwise

N = 4


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count>=4 (tests/conftest.py sets it)")
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def make_batch(step, n=32):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ np.arange(8.0, dtype=np.float32)[:, None]).astype(np.float32)
    return x, y


def init_params():
    return {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1, 1))}


def test_sharded_jit_skips_globally_when_one_shard_overflows(mesh):
    tx = ls.dynamic(optax.adam(1e-2), initial_scale=2.0**8)
    replicated, by_row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put({"w": jnp.zeros((N * 4, 1)), "b": jnp.zeros((1, 1))}, {"w": by_row, "b": replicated})
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y, poison_row):
        def loss(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        _, grads = ls.value_and_grad(loss)(state, params)
        # An inf in the rows that one device holds.
        rows = jnp.arange(grads["w"].shape[0])[:, None]
        grads["w"] = jnp.where(rows == poison_row, jnp.inf, grads["w"])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x, y = jnp.ones((16, N * 4)), jnp.ones((16, 1))
    params, state = step(params, state, x, y, -1)  # no row -1: a clean step
    before = jax.device_get(params)
    for row in [0, 5, N * 4 - 1]:
        params, state = step(params, state, x, y, row)
        assert bool(state.skipped)
        assert_trees_bitwise(jax.device_get(params), before)
    assert params["w"].sharding.is_equivalent_to(by_row, 2)
    assert int(state.skipped_steps) == 3 and float(state.scale) == 2.0**5


RULES = {
    "dynamic": lambda axis_name: ls.dynamic(
        optax.adam(0.1), initial_scale=2.0**10, growth_interval=5, axis_name=axis_name
    ),
    # The predictive rule reads grad_max, which the replicas must agree on too.
    "predictive": lambda axis_name: ls.predictive(optax.adam(0.1), axis_name=axis_name),
}


def run_shard_map(mesh, axis_name, steps, poison_device_steps, rule="dynamic"):
    """Data-parallel training under shard_map; each device keeps its own copy
    of the params and state (stacked along the device axis) so that any
    disagreement between replicas shows. With check_vma=True JAX would type
    those copies as distinct per-device params (varying), whose gradient is
    that of their own slice of the loss; check_vma=False treats them as
    pmap does, as replicas whose gradients are averaged."""
    tx = RULES[rule](axis_name)

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("data"), P("data"), P("data"), P("data"), P()),
        out_specs=P("data"),
        check_vma=False,
    )
    def step(params, state, x, y, poison_device):
        params, state = jax.tree.map(lambda a: a[0], (params, state))
        _, grads = ls.value_and_grad(loss_fn, axis_name=axis_name)(state, params, x, y)
        device = jax.lax.axis_index("data")
        grads = jax.tree.map(lambda g: jnp.where(device == poison_device, g * jnp.inf, g), grads)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda a: a[None], (params, state))

    step = jax.jit(step)
    params = init_params()
    stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)  # noqa: E731
    params, state = stack(params), stack(tx.init(params))
    for i in range(steps):
        x, y = make_batch(i, n=N * 8)
        poison = poison_device_steps.get(i, -1)
        params, state = step(params, state, x, y, jnp.int32(poison))
    return params, state


@pytest.mark.parametrize("rule", sorted(RULES))
def test_shard_map_replicas_stay_identical_with_axis_name(mesh, rule):
    # One device overflows now and then; with axis_name every replica skips.
    poisons = {i: i % N for i in range(3, 300, 7)}
    params, state = run_shard_map(mesh, "data", 300, poisons, rule)
    for leaf in jax.tree.leaves((params, state)):
        leaf = np.asarray(leaf).reshape(N, -1)
        for d in range(1, N):
            np.testing.assert_array_equal(leaf[d].view(np.uint8), leaf[0].view(np.uint8))
    assert int(state.skipped_steps[0]) == len(poisons)
    assert int(state.backoffs[0]) > 0
    # The predictive rule's headroom grows with every overflow (one in 7
    # steps here), so only the dynamic rule is sure to grow in between.
    assert rule != "dynamic" or int(state.growths[0]) > 0
    assert (
        bool(jnp.all(jnp.isfinite(params["w"])))
        and float(loss_fn(jax.tree.map(lambda a: a[0], params), *make_batch(999))) < 1.0
    )


def test_shard_map_replicas_diverge_without_axis_name(mesh):
    # The same run without axis_name: the poisoned device alone skips, so
    # the replicas' scales part ways. This is what axis_name prevents.
    _, state = run_shard_map(mesh, None, 20, {3: 1})
    scales = np.asarray(state.scale)
    assert scales[1] != scales[0] and len(set(scales.tolist())) == 2


def test_pmap_with_axis_name(mesh):
    del mesh
    tx = ls.dynamic(optax.sgd(0.1), initial_scale=2.0**6, axis_name="batch")

    def step(params, state, x, y, poison):
        _, grads = ls.value_and_grad(loss_fn, axis_name="batch")(state, params, x, y)
        grads = jax.tree.map(lambda g: g * poison, grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:N])
    params = init_params()
    replicate = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)  # noqa: E731
    params, state = replicate(params), replicate(tx.init(params))
    for i in range(6):
        x, y = make_batch(i, n=N * 8)
        poison = np.ones(N, np.float32)
        if i == 2:
            poison[3] = np.nan
        params, state = pstep(params, state, x.reshape(N, 8, 8), y.reshape(N, 8, 1), poison)
    np.testing.assert_array_equal(state.skipped_steps, [1] * N)
    np.testing.assert_array_equal(state.scale, [2.0**5] * N)
    np.testing.assert_array_equal(
        np.asarray(params["w"])[1:], np.broadcast_to(np.asarray(params["w"])[0], (N - 1, 8, 1))
    )

"""Every documented distributed pattern against a single-device run.

Data-parallel training of the same model on the same global batches, with
the same overflows, under ``pmap``, ``shard_map`` (``check_vma`` on and off,
replicated and sharded parameters, a user-averaged loss) and a sharded
``jit``, must give the single-device reference's gradients, parameters,
scales and skipped steps. (Two processes: ``tests/test_multihost.py``.)

The tests run on virtual CPU devices (tests/conftest.py sets XLA_FLAGS).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import loss_scale as ls
from tests._compare import assert_trees_close

N = 4
STEPS = 10
POISONED = {3: 5, 6: 21, 7: 30}  # step -> row of the global batch that holds an inf
# A leaf larger than the check's small-leaf bound (loss_scale._check.SMALL_LEAF)
# even when sliced over N devices: large leaves are checked one by one, and
# their norm and underflow counts must be added up over the axis exactly when
# they are sharded.
BIG = 2**17


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count>=4 (tests/conftest.py sets it)")
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def batch(step, n=N * 8):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8, dtype=np.float32)[:, None] + 0.5).astype(np.float32)
    if step in POISONED:
        x[POISONED[step], 2] = np.inf
    return x, y


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2) + 256 * jnp.mean(x[:, 0]) * jnp.mean(params["v"])


STATISTICS = {"max_grad_norm": 0.5, "track_grad_norm": True, "track_underflow": True}


def make_tx(axis_name=None, **options):
    return ls.dynamic(optax.adam(0.05), initial_scale=2.0**8, growth_interval=2, axis_name=axis_name, **options)


def init_params():
    return {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1, 1)), "v": jnp.zeros((BIG,))}


def record(trace, params, state, grads, state_before):
    """One step's params, unscaled gradients (by the scale they were taken
    at), scale and skip."""
    trace["params"].append(jax.device_get(params))
    trace["grads"].append(jax.device_get(ls.unscale(grads, state_before)))
    trace["scale"].append(float(np.asarray(state.scale).reshape(-1)[0]))
    trace["metrics"].append({k: float(np.asarray(v).reshape(-1)[0]) for k, v in ls.metrics(state).items()})
    trace["skipped"].append(bool(np.asarray(state.skipped).reshape(-1)[0]))


def new_trace():
    return {"params": [], "grads": [], "scale": [], "skipped": [], "metrics": []}


def one_device_run(**options):
    tx = make_tx(**options)

    @jax.jit
    def step(params, state, x, y):
        _, grads = ls.value_and_grad(loss_fn)(state, params, x, y)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    params = init_params()
    state = tx.init(params)
    trace = new_trace()
    for i in range(STEPS):
        before = state
        params, state, grads = step(params, state, *batch(i))
        record(trace, params, state, grads, before)
    assert trace["skipped"] == [i in POISONED for i in range(STEPS)]
    assert len(set(trace["scale"])) > 2  # it grew and backed off
    return trace


@pytest.fixture(scope="module")
def reference():
    return one_device_run()


def assert_matches(trace, reference):
    assert trace["skipped"] == reference["skipped"]
    assert trace["scale"] == reference["scale"]
    for i, (got, want) in enumerate(zip(trace["grads"], reference["grads"], strict=True)):
        if not reference["skipped"][i]:
            assert_trees_close(got, want, rtol=2e-5, atol=1e-6, what=f"grads {i}")
    for got, want in zip(trace["params"], reference["params"], strict=True):
        assert_trees_close(got, want, rtol=2e-5, atol=1e-6, what="params")
    for got, want in zip(trace["metrics"], reference["metrics"], strict=True):
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, err_msg=key)


def run_shard_map(mesh, check_vma, average_inside=False, **options):
    """The README's recipe: replicated params and state, the batch split."""
    tx = make_tx("data", **options)

    def loss(params, x, y):
        value = loss_fn(params, x, y)
        return jax.lax.pmean(value, "data") if average_inside else value

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
        check_vma=check_vma,
    )
    def step(params, state, x, y):
        _, grads = ls.value_and_grad(loss, axis_name="data")(state, params, x, y)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    params = init_params()
    state = tx.init(params)
    trace = new_trace()
    sharding = NamedSharding(mesh, P("data"))
    for i in range(STEPS):
        before = state
        x, y = (jax.device_put(a, sharding) for a in batch(i))
        params, state, grads = step(params, state, x, y)
        record(trace, params, state, grads, before)
    return trace


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_with_replicated_params_equals_one_device(mesh, reference, check_vma):
    assert_matches(run_shard_map(mesh, check_vma), reference)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_clip_and_statistics_equal_one_device(mesh, check_vma):
    assert_matches(run_shard_map(mesh, check_vma, **STATISTICS), one_device_run(**STATISTICS))


def test_shard_map_with_a_user_averaged_loss_equals_one_device(mesh, reference):
    # The loss is averaged (invariant) already: nothing more to average.
    assert_matches(run_shard_map(mesh, True, average_inside=True), reference)


@pytest.mark.parametrize("options", [{}, STATISTICS], ids=["plain", "clip_and_statistics"])
def test_shard_map_with_sharded_params_equals_one_device(mesh, reference, options):
    # FSDP-style: each device holds a slice of w and gathers it for the
    # forward pass; JAX's transpose of the gather sums the slices' gradients.
    # The norm (for clipping) and the underflow counts add up the slices.
    if options:
        reference = one_device_run(**options)
    tx = make_tx("data", **options)

    def loss(params, x, y):
        full = {name: jax.lax.all_gather(params[name], "data", tiled=True) for name in ("w", "v")}
        full["b"] = params["b"]
        return loss_fn(full, x, y)

    specs = {"w": P("data"), "b": P(), "v": P("data")}
    params = jax.device_put(init_params(), {k: NamedSharding(mesh, v) for k, v in specs.items()})
    # Adam's moments of w are sliced like w, everything else is replicated
    # (the loss-scale state's packed values are a 1-D array on one device).
    state = tx.init(params)
    state_specs = jax.tree.map(lambda a: a.sharding.spec if isinstance(a.sharding, NamedSharding) else P(), state)
    state = jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), state, state_specs)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(specs, state_specs, P("data"), P("data")),
        out_specs=(specs, state_specs, specs),
    )
    def step(params, state, x, y):
        _, grads = ls.value_and_grad(loss, axis_name="data")(state, params, x, y)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    trace = new_trace()
    for i in range(STEPS):
        before = state
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch(i))
        params, state, grads = step(params, state, x, y)
        record(trace, params, state, grads, before)
    assert_matches(trace, reference)


def test_pmap_equals_one_device(mesh, reference):
    del mesh
    tx = make_tx("batch")

    def step(params, state, x, y):
        _, grads = ls.value_and_grad(loss_fn, axis_name="batch")(state, params, x, y)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    pstep = jax.pmap(step, axis_name="batch", devices=jax.devices()[:N])
    replicate = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)  # noqa: E731
    params = replicate(init_params())
    state = replicate(tx.init(init_params()))
    trace = new_trace()
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    for i in range(STEPS):
        before = first(state)
        x, y = batch(i)
        params, state, grads = pstep(params, state, x.reshape(N, -1, 8), y.reshape(N, -1, 1))
        # Every replica holds the same params and state.
        for leaf in jax.tree.leaves((params, state)):
            assert (np.asarray(leaf) == np.asarray(leaf)[:1]).all() or np.isnan(np.asarray(leaf)).any()
        record(trace, first(params), first(state), first(grads), before)
    assert_matches(trace, reference)


def test_sharded_jit_equals_one_device(mesh, reference):
    # No axis_name: under jit with sharded arrays the loss is a global mean
    # and the check a global reduction.
    tx = make_tx()

    @jax.jit
    def step(params, state, x, y):
        _, grads = ls.value_and_grad(loss_fn)(state, params, x, y)
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state, grads

    replicated = NamedSharding(mesh, P())
    params = jax.device_put(init_params(), replicated)
    state = jax.jit(tx.init, out_shardings=replicated)(params)
    trace = new_trace()
    for i in range(STEPS):
        before = state
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch(i))
        params, state, grads = step(params, state, x, y)
        record(trace, params, state, grads, before)
    assert_matches(trace, reference)

"""Loss scaling with flax: NNX (``nnx.Optimizer``, ``loss_scale.flax``) and linen (``TrainState``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")

from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import loss_scale as ls  # noqa: E402
import loss_scale.flax as lsf  # noqa: E402
from tests._compare import assert_trees_bitwise, assert_trees_close  # noqa: E402

POLICY = ls.Policy.from_string("params=float32,compute=float16,output=float32")


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.hidden = nnx.Linear(4, 16, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.BatchNorm(16, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(16, 3, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def cross_entropy(model, x, y):
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch(n=32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (n, 4))
    return x, (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 1).astype(jnp.int32)


def pure(tree):
    return jax.tree.map(np.asarray, nnx.as_pure(tree))


# One transformation shared by the tests, so that nnx.jit compiles the train
# step once (the optimizer's tx is part of the traced graph's static data).
TX = ls.dynamic(optax.adamw(1e-2), initial_scale=2.0**10, growth_interval=3)


def make(dtype=jnp.float16, tx=TX):
    model = MLP(nnx.Rngs(0), dtype=dtype)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = lsf.nnx_value_and_grad(cross_entropy)(optimizer, model, x, y)
    optimizer.update(model, grads)
    return loss


# NNX.


def test_nnx_optimizer_trains_under_jit_in_float16():
    model, optimizer = make()
    x, y = batch()
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(10)]
    assert losses[-1] < losses[0]
    state = lsf.find_state(optimizer)
    assert int(state.skipped_steps) == 0
    assert float(lsf.get_scale(optimizer)) == 2.0**13  # grew after steps 3, 6 and 9
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 10


def test_nnx_forced_overflow_is_skipped():
    model, optimizer = make()
    x, y = batch()
    train_step(model, optimizer, x, y)
    params_before = pure(nnx.state(model, nnx.Param))
    opt_before = pure(optimizer.opt_state.inner_state)
    scale_before = float(lsf.get_scale(optimizer))

    loss = train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)

    assert not np.isfinite(float(loss))
    assert_trees_bitwise(pure(nnx.state(model, nnx.Param)), params_before)
    assert_trees_bitwise(pure(optimizer.opt_state.inner_state), opt_before)
    state = lsf.find_state(optimizer)
    assert bool(state.skipped) and int(state.skipped_steps) == 1
    assert float(state.scale) == scale_before / 2
    # nnx.Optimizer counts every call; the inner optimizer counts applied steps.
    assert int(optimizer.step[...]) == 2
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 1

    # The next clean step trains again.
    train_step(model, optimizer, x, y)
    assert not bool(lsf.find_state(optimizer).skipped)
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 2


def test_nnx_float16_overflow_from_a_too_large_scale_backs_off():
    # 2**24 times a gradient of order one overflows float16 (max 65504): the
    # step is skipped and the scale halves until it fits.
    model, optimizer = make()
    # The state's values are one packed Variable: write a value into it in place.
    state = optimizer.opt_state
    state.packed.data[...] = state._replace(scale=jnp.float32(2.0**24)).packed.data
    assert float(lsf.get_scale(optimizer)) == 2.0**24
    x, y = batch()
    params_before = pure(nnx.state(model, nnx.Param))
    train_step(model, optimizer, x, y)
    state = lsf.find_state(optimizer)
    assert bool(state.skipped) and float(state.scale) == 2.0**23
    assert_trees_bitwise(pure(nnx.state(model, nnx.Param)), params_before)
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(10)]
    assert 1 <= int(lsf.find_state(optimizer).skipped_steps) < 11
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0]


def test_nnx_value_and_grad_is_the_gradient_of_the_scaled_loss():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ls.static(optax.sgd(0.1), 8.0), wrt=nnx.Param)
    x, y = batch()
    loss, grads = lsf.nnx_value_and_grad(cross_entropy)(optimizer, model, x, y)
    expected_loss, expected = nnx.value_and_grad(lambda m: 8.0 * cross_entropy(m, x, y))(model)
    np.testing.assert_allclose(loss * 8.0, expected_loss, rtol=1e-6)
    assert isinstance(grads, nnx.State)
    assert_trees_bitwise(pure(grads), pure(expected))


def test_nnx_value_and_grad_differentiates_the_optimizers_wrt_only():
    model, optimizer = make(dtype=jnp.float32, tx=ls.static(optax.sgd(0.1), 4.0))
    x, y = batch()
    _, grads = lsf.nnx_value_and_grad(cross_entropy)(optimizer, model, x, y)
    # Params only: BatchNorm's running statistics get no gradient.
    assert jax.tree.structure(pure(grads)) == jax.tree.structure(pure(nnx.state(model, nnx.Param)))


def test_nnx_value_and_grad_keeps_state_updates_and_aux():
    model, optimizer = make(dtype=jnp.float32)
    x, y = batch()
    mean_before = np.asarray(model.norm.mean[...])

    def loss_with_aux(model, x, y):
        logits = model(x)
        return cross_entropy(model, x, y), {"logits": logits}

    (loss, aux), _ = lsf.nnx_value_and_grad(loss_with_aux, has_aux=True)(optimizer, model, x, y)
    assert aux["logits"].shape == (32, 3) and loss.shape == ()
    assert not np.array_equal(np.asarray(model.norm.mean[...]), mean_before)


def test_nnx_value_and_grad_accepts_an_opt_state_and_a_wrt_filter():
    model, optimizer = make(dtype=jnp.float32, tx=ls.static(optax.sgd(0.1), 4.0))
    x, y = batch()
    _, from_optimizer = lsf.nnx_value_and_grad(cross_entropy)(optimizer, model, x, y)
    _, from_state = lsf.nnx_value_and_grad(cross_entropy)(optimizer.opt_state, model, x, y)
    assert_trees_bitwise(pure(from_optimizer), pure(from_state))
    hidden_only = nnx.All(nnx.Param, nnx.PathContains("hidden"))
    _, partial = lsf.nnx_value_and_grad(cross_entropy, wrt=hidden_only)(optimizer, model, x, y)
    assert set(pure(partial).keys()) == {"hidden"}


def test_nnx_loss_scaling_recovers_gradients_that_float16_flushes_to_zero():
    # Each output's cotangent is 1e-7 / 24 ~ 4e-9, below half of float16's
    # smallest subnormal (3e-8): a float16 layer flushes it to zero unless the
    # loss is scaled.
    x = jax.random.normal(jax.random.key(1), (8, 4))

    def tiny_loss(model, x):
        return 1e-7 * jnp.mean(model(x).astype(jnp.float32))

    def kernel_grad(dtype, tx):
        model = nnx.Linear(4, 3, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        _, grads = nnx.jit(lsf.nnx_value_and_grad(tiny_loss))(optimizer, model, x)
        return np.asarray(lsf.find_state(optimizer).scale), np.asarray(nnx.as_pure(grads)["kernel"])

    _, exact = kernel_grad(jnp.float32, ls.no_op(optax.sgd(0.1)))
    _, unscaled = kernel_grad(jnp.float16, ls.no_op(optax.sgd(0.1)))
    scale, scaled = kernel_grad(jnp.float16, ls.dynamic(optax.sgd(0.1)))
    assert np.all(exact != 0) and np.all(unscaled == 0)
    np.testing.assert_allclose(scaled / scale, exact, rtol=1e-2)


def test_find_state_get_scale_and_metrics_return_plain_arrays():
    _, optimizer = make(tx=ls.dynamic(optax.sgd(0.1), initial_scale=64.0))
    # The core lookup finds the state but leaves nnx's Variable wrappers on it;
    # the scale, unpacked from the packed Variable, is an array.
    assert isinstance(ls.find_state(optimizer.opt_state).packed.data, nnx.Variable)
    assert isinstance(ls.get_scale(optimizer.opt_state), jax.Array)
    for obj in (optimizer, optimizer.opt_state):
        assert isinstance(lsf.get_scale(obj), jax.Array) and float(lsf.get_scale(obj)) == 64.0
        state = lsf.find_state(obj)
        assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
        logged = lsf.metrics(obj)
        assert float(logged["loss_scale/scale"]) == 64.0
        assert all(isinstance(v, jax.Array) and v.shape == () for v in logged.values())


def test_policy_casts_nnx_state_and_keeps_variable_types():
    model = MLP(nnx.Rngs(0))
    cast = POLICY.cast_to_compute(nnx.state(model))
    assert isinstance(cast["hidden"]["kernel"], nnx.Param)
    assert cast["hidden"]["kernel"][...].dtype == jnp.float16
    assert cast["norm"]["mean"][...].dtype == jnp.float16


# NNX with measured backward peaks (ls.predictive).


def split_loss(loss_fn, graphdef):
    """``loss_fn`` of a model split into its params and the rest, as the
    functional form takes it: ``(params, rest, *args) -> (loss, rest after)``."""

    def of_split(params, rest, *args):
        model = nnx.merge(graphdef, params, rest)
        return loss_fn(model, *args), nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param)))

    return of_split


def largest_unscaled(grads, opt_state):
    return jax.tree.map(lambda g: jnp.max(jnp.abs(g)), ls.unscale(grads, opt_state))


def measured_runs(make_model, tx, loss_fn, batches, every):
    """The same steps taken twice, with ``nnx_value_grad_and_peak`` on an
    ``nnx.Optimizer`` and with ``ls.value_grad_and_peak`` on the split model:
    for each, the per-step ``(loss, loss-scale state without the inner
    state, peak, largest unscaled gradient of each param)`` and the model's
    final params and other variables."""
    model = make_model()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        loss, grads, peak = lsf.nnx_value_grad_and_peak(loss_fn, every)(optimizer, model, *batch)
        assert isinstance(grads, nnx.State)
        largest = largest_unscaled(nnx.as_pure(grads), lsf.find_state(optimizer))
        optimizer.update(model, grads, backward_peak=peak)
        return loss, peak, largest

    graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    opt_state = tx.init(params)

    @jax.jit
    def functional_step(params, rest, opt_state, batch):
        measure = ls.value_grad_and_peak(split_loss(loss_fn, graphdef), every, has_aux=True)
        (loss, rest), grads, peak = measure(opt_state, params, rest, *batch)
        largest = largest_unscaled(grads, opt_state)
        updates, opt_state = tx.update(grads, opt_state, params, backward_peak=peak)
        return optax.apply_updates(params, updates), rest, opt_state, loss, peak, largest

    nnx_steps, functional_steps = [], []
    for batch in batches:
        loss, peak, largest = nnx_step(model, optimizer, batch)
        nnx_steps.append((loss, lsf.find_state(optimizer)._replace(inner_state=None), peak, largest))
        params, rest, opt_state, loss, peak, largest = functional_step(params, rest, opt_state, batch)
        functional_steps.append((loss, ls.find_state(opt_state)._replace(inner_state=None), peak, largest))
    nnx_model = (nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param))))
    return (nnx_steps, nnx_model), (functional_steps, (params, rest))


# Two programs traced apart: float16 bits may differ between them (AVX512-FP16 CPUs).
FLOAT16_ROUNDING = 2e-3


def assert_same_training(nnx_run, functional_run):
    (nnx_steps, nnx_model), (functional_steps, functional_model) = nnx_run, functional_run
    for step, (ours, theirs) in enumerate(zip(nnx_steps, functional_steps, strict=True)):
        assert float(ours[1].scale) == float(theirs[1].scale), f"step {step}"
        assert_trees_close(ours, theirs, rtol=FLOAT16_ROUNDING, atol=1e-6, what=f"step {step}")
    assert_trees_close(nnx_model, functional_model, rtol=FLOAT16_ROUNDING, atol=1e-6)


def test_nnx_value_grad_and_peak_trains_as_the_functional_form_on_the_split_model():
    # float16 compute and BatchNorm statistics (written back to the model);
    # measuring on steps 0, 2 and 4, the scale set from the first measurement.
    tx = ls.predictive(optax.adam(1e-2), initial_scale=1.0)
    batches = [batch(seed=seed) for seed in range(6)]
    nnx_run, functional_run = measured_runs(lambda: MLP(nnx.Rngs(0), jnp.float16), tx, cross_entropy, batches, 2)
    assert_same_training(nnx_run, functional_run)
    steps = nnx_run[0]
    assert [bool(peak > 0) for _, _, peak, _ in steps] == [True, False, True, False, True, False]
    assert bool(steps[0][1].counters.measured) and float(steps[0][1].scale) > 2.0**10
    assert not np.array_equal(nnx_run[1][1]["norm"]["mean"], np.zeros(16))


def shrink(h, binades):
    """``h`` forward; its cotangents ``2**-binades`` times smaller."""
    small = h * jnp.asarray(2.0**-binades, h.dtype)
    return small + jax.lax.stop_gradient(h - small)


class Deep(nnx.Module):
    """Cotangents 40 binades smaller below the "embed" boundary than above
    it: more than one float16 scale holds."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(6, 8, dtype=jnp.float16, rngs=rngs)
        self.norm = nnx.BatchNorm(8, dtype=jnp.float16, rngs=rngs)
        self.head = nnx.Linear(8, 3, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        h = shrink(jnp.tanh(self.norm(self.embed(x))), 20)
        return self.head(shrink(ls.segment(h, "embed"), 20))


def squared(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def test_nnx_value_grad_and_peak_with_a_scale_per_segment():
    tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0, segments=("embed",))
    batches = [(jax.random.normal(jax.random.key(seed), (5, 6)),) for seed in range(4)]
    nnx_run, functional_run = measured_runs(lambda: Deep(nnx.Rngs(0)), tx, squared, batches, 1)
    assert_same_training(nnx_run, functional_run)
    steps = nnx_run[0]
    assert all(isinstance(peak, ls.SegmentPeaks) and peak.names == ("embed",) for _, _, peak, _ in steps)
    # The boundary's own scale, many binades above the loss's.
    assert int(steps[-1][1].counters.segment_exponents["embed"]) >= 10
    # The embedding's gradient is kept; with one scale its float16 gradient is flushed to zero.
    assert float(steps[-1][3]["embed"]["kernel"]) > 0
    model = Deep(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ls.predictive(optax.sgd(0.1), initial_scale=2.0**10), wrt=nnx.Param)
    _, grads, _ = lsf.nnx_value_grad_and_peak(squared)(optimizer, model, *batches[0])
    assert float(jnp.max(jnp.abs(grads["embed"]["kernel"][...]))) == 0.0


def test_nnx_value_grad_and_peak_misuse_says_what_is_wrong():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    fun = lambda model, x: jnp.sum(model(x))  # noqa: E731
    optimizer = nnx.Optimizer(model, ls.predictive(optax.sgd(0.1)), wrt=nnx.Param)
    call = r"nnx_value_grad_and_peak\(loss_fn\)\(optimizer, model, \*args"
    with pytest.raises(TypeError, match=call):
        lsf.nnx_value_grad_and_peak(fun)(model)
    with pytest.raises(ValueError, match=call + r".*first argument must be the nnx.Optimizer \(or its opt_state\)"):
        lsf.nnx_value_grad_and_peak(fun)(model, jnp.ones(2))
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="has no loss-scale state"):
        lsf.nnx_value_grad_and_peak(fun)(plain, model, jnp.ones(2))
    # Checked when wrapped, as ls.value_grad_and_peak checks them.
    with pytest.raises(ValueError, match="every must be >= 1"):
        lsf.nnx_value_grad_and_peak(fun, every=0)
    with pytest.raises(TypeError, match="fun must be callable"):
        lsf.nnx_value_grad_and_peak(None)
    with pytest.raises(TypeError, match="expected function with aux output to return a two-element tuple"):
        lsf.nnx_value_grad_and_peak(fun, has_aux=True)(optimizer, model, jnp.ones(2))


# linen.


class LinenMLP(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, dtype=self.dtype, param_dtype=jnp.float32)(x))
        return nn.Dense(3, dtype=self.dtype, param_dtype=jnp.float32)(x)


@jax.jit
def linen_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, POLICY.cast_to_compute(x))
        return optax.softmax_cross_entropy_with_integer_labels(POLICY.cast_to_output(logits), y).mean()

    loss, grads = ls.value_and_grad(loss_fn)(state.opt_state, state.params)
    return state.apply_gradients(grads=grads), loss


def linen_state(**kwargs):
    model = LinenMLP(dtype=POLICY.compute_dtype)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    tx = POLICY.loss_scaling(optax.adam(1e-2), **kwargs)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def test_linen_train_state_trains_and_skips_a_forced_overflow():
    state = linen_state(initial_scale=2.0**10, growth_interval=4)
    x, y = batch()
    losses = []
    for _ in range(8):
        state, loss = linen_step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert float(ls.get_scale(state)) == float(lsf.get_scale(state)) == 2.0**12
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32

    before = pure((state.params, state.opt_state))
    state, loss = linen_step(state, x.at[3, 1].set(jnp.nan), y)
    assert not np.isfinite(float(loss))
    params_after, opt_after = pure((state.params, state.opt_state))
    assert_trees_bitwise(params_after, before[0])
    assert_trees_bitwise(lsf.find_state(opt_after).inner_state, lsf.find_state(before[1]).inner_state)
    assert float(ls.get_scale(state)) == 2.0**11
    assert int(ls.find_state(state).skipped_steps) == 1
    assert int(state.step) == 9  # TrainState.step counts the skipped step too
    assert float(lsf.metrics(state)["loss_scale/skipped_steps"]) == 1


def test_linen_fused_apply_gradients_equals_train_state_apply_gradients():
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
    state = train_state.TrainState.create(
        apply_fn=None, params=params, tx=ls.dynamic(optax.adam(0.1), initial_scale=8.0)
    )
    for poison in [1.0, jnp.inf, 1.0]:
        grads = {"w": jnp.full((2, 3), 8.0 * poison), "b": jnp.arange(3.0) * 8.0}
        fused = jax.jit(lsf.apply_gradients)(state, grads)
        plain = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
        assert_trees_close(fused.params, plain.params, rtol=1e-6, atol=1e-7)
        assert int(fused.step) == int(plain.step)
        assert float(ls.get_scale(fused)) == float(ls.get_scale(plain))
        state = fused
    assert int(ls.find_state(state).skipped_steps) == 1

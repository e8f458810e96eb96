"""The fused flax paths (``loss_scale.flax.TrainState`` and
``loss_scale.flax.Optimizer``) against flax's own over real float16 training
with overflows.

From the same state and the same gradients, one step of each gives the
same optimizer state and step bit for bit, and params within one float32
rounding: the fused step adds the update to a param inside one kernel, where
XLA:CPU contracts ``p + (-lr * m)`` into a fused multiply-add (one rounding),
while flax's rounds the materialized update first. A skipped step is bit for
bit.

The float16 gradients are computed once per step, by one compiled program,
and given to both: the forward and backward passes inside two differently
built programs may round differently (XLA fuses each program's float16 ops
its own way, and a CPU with float16 arithmetic contracts a multiply and an
add into one rounding where they share a kernel), which would make the
optimizer states differ for reasons that are not the optimizer step's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import loss_scale as ls
import loss_scale.flax as lsf
from tests._compare import assert_trees_bitwise


def assert_params_within_one_rounding(ours, theirs, before):
    """``p + u`` rounded once against ``p + round(u)``: they differ by at most
    the rounding of ``u``, ``eps * |u| <= eps * (|p| + |p + u|)``."""
    eps = float(np.finfo(np.float32).eps)
    for x, y, p in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), jax.tree.leaves(before), strict=True):
        assert x.dtype == y.dtype
        x, y, p = (np.asarray(a, np.float64) for a in (x, y, p))
        assert np.all(np.abs(x - y) <= eps * (np.abs(p) + np.abs(y))), float(np.max(np.abs(x - y)))


def batches(steps, poisoned):
    rng = np.random.default_rng(0)
    for i in range(steps):
        x = rng.normal(size=(32, 16)).astype(np.float32)
        y = rng.integers(0, 4, size=32)
        if i in poisoned:
            x[3, 5] = np.inf
        yield jnp.asarray(x), jnp.asarray(y)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=jnp.float16)(x.astype(jnp.float16)))
        return nn.Dense(4, dtype=jnp.float16)(x).astype(jnp.float32)


INNERS = {"adamw": lambda: optax.adamw(1e-2), "sgd_clip": lambda: optax.chain(optax.clip(1.0), optax.sgd(0.1, 0.9))}


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_linen_train_state_is_flax_train_state_fused(inner):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    tx = ls.dynamic(INNERS[inner](), initial_scale=2.0**12, growth_interval=3)
    ours = lsf.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    theirs = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # The gradients of both steps, from one program (see the module docstring).
    grads_of = jax.jit(lambda opt_state, params, x, y: ls.value_and_grad(loss_fn)(opt_state, params, x, y)[1])

    def make_step():
        return jax.jit(lambda state, grads: state.apply_gradients(grads=grads))

    # One jitted function per class: jaxlib's treedef equality ignores which
    # dataclass a node is (the two states' treedefs compare equal, their
    # hashes differ), so one jit cache fed both could hand back the other
    # class's trace on a hash collision.
    step_ours, step_theirs = make_step(), make_step()
    poisoned = {4, 5, 9}
    for i, (x, y) in enumerate(batches(12, poisoned)):
        # Both from the same state (ours), so that one step is compared at a time.
        before = ours.params
        grads = grads_of(ours.opt_state, ours.params, x, y)
        theirs = step_theirs(theirs.replace(params=ours.params, opt_state=ours.opt_state, step=ours.step), grads)
        ours = step_ours(ours, grads)
        assert type(ours) is lsf.TrainState and type(theirs) is train_state.TrainState
        assert_trees_bitwise((ours.opt_state, ours.step), (theirs.opt_state, theirs.step))
        if i in poisoned:
            assert_trees_bitwise(ours.params, before)
            assert_trees_bitwise(theirs.params, before)
        else:
            assert_params_within_one_rounding(ours.params, theirs.params, before)
    assert int(ls.find_state(ours).skipped_steps) == 3 and isinstance(ours, lsf.TrainState)
    # The function form takes the same fused step.
    x, y = next(batches(1, set()))
    _, grads = ls.value_and_grad(loss_fn)(ours.opt_state, ours.params, x, y)
    assert_trees_bitwise(
        jax.jit(lambda s: s.apply_gradients(grads=grads))(ours), jax.jit(lsf.apply_gradients)(ours, grads)
    )


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 64, dtype=jnp.float16, rngs=rngs)
        self.head = nnx.Linear(64, 4, dtype=jnp.float16, rngs=rngs)
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.head(nnx.relu(self.hidden(x.astype(jnp.float16)))).astype(jnp.float32)


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_nnx_optimizer_is_nnx_optimizer_fused(inner):
    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    # The gradients of both steps from one program (see the module docstring):
    # the optimizers' states have one structure, so both calls share one trace.
    @nnx.jit
    def grads_of(model, opt_state, x, y):
        return lsf.nnx_value_and_grad(loss_fn)(opt_state, model, x, y)[1]

    @nnx.jit
    def step(model, optimizer, grads):
        optimizer.update(model, grads)

    poisoned = {2, 3, 8}
    make_tx = lambda: ls.dynamic(INNERS[inner](), initial_scale=2.0**12, growth_interval=3)  # noqa: E731
    model = NNXModel(nnx.Rngs(0))
    optimizer = lsf.Optimizer(model, make_tx(), wrt=nnx.Param)
    their_model = nnx.clone(model)
    theirs = nnx.Optimizer(their_model, make_tx(), wrt=nnx.Param)
    for i, (x, y) in enumerate(batches(12, poisoned)):
        # nnx.Optimizer from the same model and state, one step at a time.
        nnx.update(their_model, nnx.state(model))
        nnx.update(theirs, nnx.state(optimizer))
        before = nnx.as_pure(nnx.state(model, nnx.Param))
        grads = grads_of(model, optimizer.opt_state, x, y)
        assert_trees_bitwise(nnx.as_pure(grads), nnx.as_pure(grads_of(their_model, theirs.opt_state, x, y)))
        step(model, optimizer, grads)
        step(their_model, theirs, grads)
        assert_trees_bitwise(
            nnx.as_pure((optimizer.opt_state, optimizer.step)), nnx.as_pure((theirs.opt_state, theirs.step))
        )
        assert_trees_bitwise(
            nnx.as_pure(nnx.state(model, nnx.Not(nnx.Param))), nnx.as_pure(nnx.state(their_model, nnx.Not(nnx.Param)))
        )
        ours_params = nnx.as_pure(nnx.state(model, nnx.Param))
        their_params = nnx.as_pure(nnx.state(their_model, nnx.Param))
        if i in poisoned:
            assert_trees_bitwise(ours_params, before)
            assert_trees_bitwise(their_params, before)
        else:
            assert_params_within_one_rounding(ours_params, their_params, before)
    assert int(lsf.find_state(optimizer).skipped_steps) == 3


def test_fused_nnx_update_returns_nothing_and_skips_write_nothing():
    model = NNXModel(nnx.Rngs(0))
    optimizer = lsf.Optimizer(model, ls.dynamic(optax.adam(1e-2)), wrt=nnx.Param)
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), nnx.state(model, nnx.Param))
    assert optimizer.update(model, grads) is None
    assert_trees_bitwise(nnx.as_pure(nnx.state(model, nnx.Param)), before)
    assert bool(lsf.find_state(optimizer).skipped) and int(optimizer.step[...]) == 1

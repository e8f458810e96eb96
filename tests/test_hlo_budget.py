"""A guard on memory traffic, read from the compiled HLO rather than timed.

Three steps are guarded: ``tx.update`` followed by ``optax.apply_updates``
(the optax API), ``ls.apply_gradients``, and a whole mixed-precision train
step (float32 params, float16 forward and backward pass), each against the
same step with the bare inner optimizer.

The update skips without a branch where the inner optimizer allows it
(``loss_scale/_skip.py``): XLA then fuses the gradients' producers and the
updates' consumers as it does for the bare step. The budget, per
parameter-sized gradient leaf, on top of the bare step (state donated):

* one read of the gradient by the finite check (``max|g|``);
* for a 16-bit gradient, one write and one read of its unscaled copy: XLA:CPU
  does not duplicate the float32-to-16-bit convert into each consumer;
* for an inner optimizer that reduces over the gradients (global-norm
  clipping), one write and one read of the unscaled gradient, which XLA:CPU's
  reduction kernels take as a materialized operand; a 16-bit gradient's
  unscaled copy then has one more reader (the norm and the clip);
* for an inner optimizer with control flow (``optax.clip_by_global_norm``
  has none, ``optax.MultiSteps`` has a ``lax.cond``) the update keeps its
  ``lax.cond``, and pays what the budget of ``CONDITIONAL`` says;
* no copies of parameter-sized buffers, and no more temporary memory than
  the bare step plus the gradients (all of which the check reads before any
  update may run);
* in the mixed step, no read of a transposed weight gradient reshaped to
  other dimensions (``hlo_traffic.flattened_transposed_reads``): XLA:CPU
  keeps a float16 weight gradient transposed in memory, and a check that
  flattens it reads it a row apart per element, which made the mixed MLP
  step of ``benchmarks/overhead.py`` 1.5 times as slow as bare Adam.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import loss_scale as ls
from tests import hlo_traffic

BIG = 2**15  # elements: larger than any bias, smaller than any weight below
PARAMS = {
    "w1": jnp.zeros((1024, 512)),
    "b1": jnp.zeros((512,)),
    "w2": jnp.zeros((512, 640)),
    "w3": jnp.zeros((640, 128), jnp.bfloat16),
}
N_BIG, N_BIG_16BIT = 3, 1
PER_LEAF = 1  # the check's read
PER_16BIT_LEAF = 2
PER_LEAF_FOR_REDUCING_INNER = 2
PER_16BIT_LEAF_FOR_REDUCING_INNER = 1
REDUCES_OVER_GRADIENTS = {"adamw_chain"}


def compiled_step(tx, fused=False):
    def step(params, opt_state, grads):
        if fused:
            return ls.apply_gradients(tx, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(PARAMS, tx.init(PARAMS), PARAMS).compile()
    return compiled.as_text(), compiled.memory_analysis()


INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adamw_chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}


def grad_reads(hlo: str) -> dict[str, int]:
    """How many kernels read each parameter-sized gradient argument."""
    computations, entry = hlo_traffic.parse(hlo)
    names = [i.name for i in computations[entry] if i.opcode == "parameter" and i.name.startswith("grads")]
    big = [n for n in names if any(i.name == n and (i.elements or 0) >= BIG for i in computations[entry])]
    reads = hlo_traffic.traffic(hlo, BIG).reads_of
    return {n: reads.get(n, 0) for n in big}


def big_copies(hlo: str) -> list[str]:
    computations, entry = hlo_traffic.parse(hlo)
    return [i.name for i in computations[entry] if i.opcode == "copy" and (i.elements or 0) >= BIG]


@pytest.mark.parametrize("fused", [False, True], ids=["optax", "fused"])
@pytest.mark.parametrize("name", list(INNERS))
def test_update_stays_within_its_traffic_budget(name, fused):
    bare_hlo, bare_mem = compiled_step(INNERS[name]())
    bare = hlo_traffic.traffic(bare_hlo, BIG)
    hlo, mem = compiled_step(ls.dynamic(INNERS[name]()), fused=fused)
    assert " conditional(" not in hlo, "the update of an inner optimizer without control flow has no branch"
    wrapped = hlo_traffic.traffic(hlo, BIG)

    budget = bare.passes + N_BIG * PER_LEAF + N_BIG_16BIT * PER_16BIT_LEAF
    if name in REDUCES_OVER_GRADIENTS:
        budget += N_BIG * PER_LEAF_FOR_REDUCING_INNER + N_BIG_16BIT * PER_16BIT_LEAF_FOR_REDUCING_INNER
    assert wrapped.passes <= budget, f"{name}: {wrapped.passes} passes over large buffers, budget {budget}"
    reads, bare_reads = grad_reads(hlo), grad_reads(bare_hlo)
    assert len(reads) == N_BIG
    if name not in REDUCES_OVER_GRADIENTS:
        # Each large gradient is read once more than by the bare step: the check.
        assert all(reads[n] <= bare_reads[n] + 1 for n in reads), (reads, bare_reads)
    assert big_copies(hlo) == []
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(PARAMS))
    assert mem.temp_size_in_bytes <= bare_mem.temp_size_in_bytes + grad_bytes + 1024


def with_a_branch(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with a ``lax.cond`` in its update (as ``optax.MultiSteps``
    has), which makes the loss-scaling update keep its own ``lax.cond``."""

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return jax.lax.cond(True, lambda u: u, lambda u: u, updates), state

    return optax.GradientTransformation(inner.init, update)


# The conditional's extra passes over each large leaf: one write of the
# updates by the taken branch and one read by apply_updates (optax path).
CONDITIONAL = 2


def test_an_inner_update_with_control_flow_keeps_the_conditional():
    bare = hlo_traffic.traffic(compiled_step(with_a_branch(optax.adam(1e-3)))[0], BIG)
    hlo, _ = compiled_step(ls.dynamic(with_a_branch(optax.adam(1e-3))))
    skip_branch, apply_branch = hlo_traffic.branches(hlo)
    taken = hlo_traffic.traffic(hlo, BIG, apply_branch)
    skipped = hlo_traffic.traffic(hlo, BIG, skip_branch)
    budget = bare.passes + N_BIG * (PER_LEAF + CONDITIONAL) + N_BIG_16BIT * PER_16BIT_LEAF
    assert taken.passes <= budget, f"{taken.passes} passes, budget {budget}"
    assert skipped.passes <= bare.passes, f"a skipped step makes {skipped.passes} passes, bare {bare.passes}"
    # Outside the conditional, each large gradient is read once: the check.
    assert set(grad_reads(hlo).values()) == {1}


def test_traffic_counter_sees_an_extra_pass():
    # The guard can fail: a second finite check over the unscaled gradients
    # shows up as more passes than the budget allows.
    tx = ls.dynamic(optax.adam(1e-3))

    def noisy_update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return jax.tree.map(lambda u: u * ls.all_finite(updates).astype(u.dtype), updates), state

    noisy = optax.GradientTransformation(tx.init, noisy_update)
    bare = hlo_traffic.traffic(compiled_step(optax.adam(1e-3))[0], BIG)
    wrapped = hlo_traffic.traffic(compiled_step(noisy)[0], BIG)
    assert wrapped.passes > bare.passes + N_BIG * PER_LEAF + N_BIG_16BIT * PER_16BIT_LEAF


# A mixed-precision MLP: float32 params, cast to float16 inside the loss.
MIXED_SIZES = (256, 512, 512, 512, 10)
N_MIXED_WEIGHTS = 3  # the weights of at least BIG elements


def mixed_params():
    keys = jax.random.split(jax.random.key(0), len(MIXED_SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, MIXED_SIZES[:-1], MIXED_SIZES[1:], strict=True)
    ]


def mixed_loss(params, batch):
    x = batch["x"].astype(jnp.float16)
    for i, layer in enumerate(params):
        x = x @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)[None, :]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    logits = x.astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))


def compiled_mixed_step(tx, scaled, fused=False, grads_hook=None):
    params = mixed_params()
    batch = {"x": jnp.ones((32, MIXED_SIZES[0])), "y": jnp.zeros((32,), jnp.int32)}

    def step(params, opt_state, batch):
        if scaled:
            loss, grads = ls.value_and_grad(mixed_loss)(opt_state, params, batch)
        else:
            loss, grads = jax.value_and_grad(mixed_loss)(params, batch)
        if grads_hook is not None:
            grads = grads_hook(grads)
        if fused:
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, loss
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), batch).compile()
    return compiled.as_text(), compiled.memory_analysis()


# The mixed step's budget over the bare mixed step, per large weight: the
# check's read of its float32 gradient. (With the update inside a lax.cond,
# XLA:CPU writes every gradient in float32, transposed to the branch's
# layout, and reads it back: three more passes per weight, and the
# gradients' bytes in temporary memory.)
MIXED_PER_WEIGHT = 1


@pytest.mark.parametrize("fused", [False, True], ids=["optax", "fused"])
def test_the_mixed_precision_step_stays_within_its_budget(fused):
    bare_hlo, bare_mem = compiled_mixed_step(optax.adam(1e-3), scaled=False)
    bare = hlo_traffic.traffic(bare_hlo, BIG)
    hlo, mem = compiled_mixed_step(ls.dynamic(optax.adam(1e-3)), scaled=True, fused=fused)
    wrapped = hlo_traffic.traffic(hlo, BIG)
    budget = bare.passes + N_MIXED_WEIGHTS * MIXED_PER_WEIGHT
    assert wrapped.passes <= budget, f"{wrapped.passes} passes over large buffers, budget {budget}"
    assert big_copies(hlo) == []
    # XLA:CPU keeps the float16 weight gradients transposed in memory; the
    # check reads them in that order, as bare Adam's fusions do.
    assert hlo_traffic.flattened_transposed_reads(bare_hlo, BIG) == []
    assert hlo_traffic.flattened_transposed_reads(hlo, BIG) == []
    weight_bytes = sum(a * b * 4 for a, b in zip(MIXED_SIZES[:-1], MIXED_SIZES[1:], strict=True))
    assert mem.temp_size_in_bytes <= bare_mem.temp_size_in_bytes + weight_bytes // 4


def test_the_mixed_budget_sees_a_conditional_around_the_update():
    # The guard can fail: the same mixed step with the update inside a
    # lax.cond (an inner optimizer with control flow) exceeds it.
    bare = hlo_traffic.traffic(compiled_mixed_step(with_a_branch(optax.adam(1e-3)), scaled=False)[0], BIG)
    hlo, _ = compiled_mixed_step(ls.dynamic(with_a_branch(optax.adam(1e-3))), scaled=True)
    skip_branch, apply_branch = hlo_traffic.branches(hlo)
    taken = hlo_traffic.traffic(hlo, BIG, apply_branch)
    assert taken.passes > bare.passes + N_MIXED_WEIGHTS * MIXED_PER_WEIGHT


def test_the_mixed_budget_sees_a_check_of_flattened_gradients():
    # The guard can fail: a finite check that flattens each gradient first
    # (what the check did before it reduced each leaf over its own axes)
    # reads every transposed weight gradient a row apart per element.
    def check_flattened(grads):
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g.reshape(-1))) for g in jax.tree.leaves(grads)]))
        return jax.tree.map(lambda g: jnp.where(finite, g, 0), grads)

    hlo, _ = compiled_mixed_step(optax.adam(1e-3), scaled=False, grads_hook=check_flattened)
    assert len(hlo_traffic.flattened_transposed_reads(hlo, BIG)) == N_MIXED_WEIGHTS

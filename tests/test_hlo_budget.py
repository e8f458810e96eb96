"""A guard on memory traffic, read from the compiled HLO rather than timed.

Two paths are guarded: ``tx.update`` followed by ``optax.apply_updates``
(the optax API), and ``ls.apply_gradients``, which adds the updates to the
params inside the taken branch.

The budget, per parameter-sized gradient leaf, on top of the bare inner
optimizer step (update + apply_updates, state donated):

* one read of the gradient for the finite check (``max|g|``), outside the
  conditional; no other op outside it touches the gradient;
* one write of the updates by the taken branch and one read by
  ``apply_updates``, which sits outside the ``lax.cond`` under the optax API;
* for a 16-bit gradient, one write and one read of its unscaled copy: XLA:CPU
  does not duplicate the float32-to-16-bit convert into each consumer;
* for an inner optimizer that reduces over the gradients (global-norm
  clipping), one write and one read of the unscaled gradient, which XLA:CPU's
  reduction kernels take as a materialized operand; a 16-bit gradient's
  unscaled copy then has one more reader (the norm and the clip);
* no copies of the parameters or of the inner state through the conditional;
* a skipped step moves no more than a bare step.
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
PER_LEAF = 3  # the check, the updates' write and read
PER_16BIT_LEAF = 2
PER_LEAF_FOR_REDUCING_INNER = 2
PER_16BIT_LEAF_FOR_REDUCING_INNER = 1


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
REDUCES_OVER_GRADIENTS = {"adamw_chain"}


@pytest.mark.parametrize("name", list(INNERS))
def test_update_stays_within_its_traffic_budget(name):
    bare_hlo, bare_mem = compiled_step(INNERS[name]())
    bare = hlo_traffic.traffic(bare_hlo, BIG)

    wrapped_hlo, wrapped_mem = compiled_step(ls.dynamic(INNERS[name]()))
    skip_branch, apply_branch = hlo_traffic.branches(wrapped_hlo)
    taken = hlo_traffic.traffic(wrapped_hlo, BIG, apply_branch)
    skipped = hlo_traffic.traffic(wrapped_hlo, BIG, skip_branch)

    budget = bare.passes + N_BIG * PER_LEAF + N_BIG_16BIT * PER_16BIT_LEAF
    if name in REDUCES_OVER_GRADIENTS:
        budget += N_BIG * PER_LEAF_FOR_REDUCING_INNER + N_BIG_16BIT * PER_16BIT_LEAF_FOR_REDUCING_INNER
    assert taken.passes <= budget, f"{name}: {taken.passes} passes over large buffers, budget {budget}"
    assert skipped.passes <= bare.passes, f"{name}: a skipped step makes {skipped.passes} passes, bare {bare.passes}"

    # Outside the conditional, each large gradient is read exactly once: the check.
    computations, entry = hlo_traffic.parse(wrapped_hlo)
    grad_params = [i.name for i in computations[entry] if i.opcode == "parameter" and i.name.startswith("grads")]
    big_grads = [n for n in grad_params if any(i.name == n and i.elements >= BIG for i in computations[entry])]
    assert len(big_grads) == N_BIG
    assert {n: taken.reads_of.get(n, 0) for n in big_grads} == dict.fromkeys(big_grads, 1)

    # No copies of parameter-sized buffers around the conditional.
    big_copies = [i.name for i in computations[entry] if i.opcode == "copy" and (i.elements or 0) >= BIG]
    assert big_copies == []

    # Peak temporary memory: at most one gradient-sized buffer above bare
    # (plus a few scalars).
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(PARAMS))
    assert wrapped_mem.temp_size_in_bytes <= bare_mem.temp_size_in_bytes + grad_bytes + 1024


def test_traffic_counter_sees_an_extra_pass():
    # The guard can fail: a second finite check over the unscaled gradients
    # shows up as more reads than the budget allows.
    tx = ls.dynamic(optax.adam(1e-3))

    def noisy_update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return jax.tree.map(lambda u: u * ls.all_finite(updates).astype(u.dtype), updates), state

    noisy = optax.GradientTransformation(tx.init, noisy_update)
    bare = hlo_traffic.traffic(compiled_step(optax.adam(1e-3))[0], BIG)
    hlo, _ = compiled_step(noisy)
    taken = hlo_traffic.traffic(hlo, BIG, hlo_traffic.branches(hlo)[1])
    assert taken.passes > bare.passes + N_BIG * PER_LEAF + N_BIG_16BIT * PER_16BIT_LEAF


@pytest.mark.parametrize("name", list(INNERS))
def test_apply_gradients_reaches_the_floor(name):
    # With the addition inside the branch, the only extra traffic is the
    # check's read of each gradient (and the 16-bit and reducing-inner
    # materializations described above); a skipped step reads the gradients
    # once and writes nothing.
    bare_hlo, bare_mem = compiled_step(INNERS[name]())
    bare = hlo_traffic.traffic(bare_hlo, BIG)
    hlo, mem = compiled_step(ls.dynamic(INNERS[name]()), fused=True)
    skip_branch, apply_branch = hlo_traffic.branches(hlo)
    taken = hlo_traffic.traffic(hlo, BIG, apply_branch)
    skipped = hlo_traffic.traffic(hlo, BIG, skip_branch)
    budget = bare.passes + N_BIG * 1 + N_BIG_16BIT * PER_16BIT_LEAF
    if name in REDUCES_OVER_GRADIENTS:
        budget += N_BIG * PER_LEAF_FOR_REDUCING_INNER + N_BIG_16BIT * PER_16BIT_LEAF_FOR_REDUCING_INNER
    assert taken.passes <= budget, f"{name}: {taken.passes} passes, budget {budget}"
    assert skipped.passes <= N_BIG, f"{name}: a skipped step makes {skipped.passes} passes"
    computations, entry = hlo_traffic.parse(hlo)
    assert [i.name for i in computations[entry] if i.opcode == "copy" and (i.elements or 0) >= BIG] == []
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(PARAMS))
    assert mem.temp_size_in_bytes <= bare_mem.temp_size_in_bytes + grad_bytes // 4

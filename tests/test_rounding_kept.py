"""Roundings the compiler keeps: no result that depends on a value being
rounded to bfloat16 or float16 is written as a cast round trip.

XLA may compute in more precision than a program asks for
(``xla_allow_excess_precision``, on by default), and XLA:GPU deletes a
float32 -> half -> float32 convert pair. XLA:CPU keeps it, so a rounding
written that way passes every CPU test and does nothing on a GPU (Kahan's
compensation was always 0 there). Two checks that run on the CPU:

* ``test_no_rounding_is_a_convert_pair``: the traced programs of every
  path that rounds (``ls.low_precision``'s three roundings, its moments, with
  and without ``ls.dynamic``, a whole training step, autocast and per-segment
  scaling) hold no such pair, directly or through data movement;
* ``run_as_xla_gpu``: a program evaluated with every pair deleted, as
  XLA:GPU compiles it, still rounds (Kahan's thousand small updates add up,
  ``apply_updates`` lands on the rounded parameter).

``benchmarks/gpu.sh`` runs tests/test_low_precision.py on the hardware.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import source_info_util

import loss_scale as ls
from loss_scale._grid import nearest_on_grid
from loss_scale._jaxpr import TABLE, Equation, Frame, Hooks, Interpreter, Mode, is_literal, sub_jaxprs
from loss_scale._low_precision._rounding import stochastic_on_grid
from tests import _segment_models as segment_models
from tests._compare import assert_trees_bitwise

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
HALF = (BF16, F16)
ROUNDINGS = ("kahan", "stochastic", "nearest")

# Operations that move a value without changing it: a pair of converts
# around them is still a round trip to XLA (it fuses them into one loop).
MOVEMENT = frozenset(
    ["broadcast_in_dim", "reshape", "squeeze", "transpose", "slice", "dynamic_slice", "concatenate", "select_n"]
    + ["copy", "rev", "pad"]
)


# ---------------------------------------------------------------------------
# Finding the pairs
# ---------------------------------------------------------------------------


def _dtype(var: Any) -> np.dtype:
    return np.dtype(var.aval.dtype)


def _is_float(dtype: np.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _narrowing(eqn: Any) -> bool:
    """A convert from a wider float to bfloat16 or float16."""
    if eqn.primitive.name != "convert_element_type":
        return False
    source, target = _dtype(eqn.invars[0]), _dtype(eqn.outvars[0])
    return target in HALF and _is_float(source) and source.itemsize > target.itemsize


def _widening(eqn: Any) -> bool:
    """A convert from bfloat16 or float16 to a wider float."""
    if eqn.primitive.name != "convert_element_type" or is_literal(eqn.invars[0]):
        return False
    source, target = _dtype(eqn.invars[0]), _dtype(eqn.outvars[0])
    return source in HALF and _is_float(target) and target.itemsize > source.itemsize


def _jaxprs(jaxpr: Any) -> Iterator[Any]:
    """``jaxpr`` and every jaxpr its equations hold, at any depth."""
    stack = [jaxpr]
    while stack:
        current = stack.pop()
        yield current
        for eqn in current.eqns:
            stack.extend(sub_jaxprs(eqn.params))


def _from_narrowing(var: Any, made_by: dict[Any, Any], depth: int = 0) -> bool:
    """Whether ``var`` is a narrowing convert's result, possibly moved."""
    eqn = made_by.get(var)
    if eqn is None or depth > 20:
        return False
    if _narrowing(eqn):
        return True
    if eqn.primitive.name in MOVEMENT:
        return any(not is_literal(v) and _from_narrowing(v, made_by, depth + 1) for v in eqn.invars)
    return False


def convert_pairs(jaxpr: Any) -> list[str]:
    """Every float -> half -> float convert pair in ``jaxpr`` and its bodies,
    the half value possibly moved (broadcast, reshaped, selected) between
    the two converts; each as the source line of the widening convert."""
    found = []
    for body in _jaxprs(jaxpr):
        made_by = {v: eqn for eqn in body.eqns for v in eqn.outvars}
        for eqn in body.eqns:
            if _widening(eqn) and _from_narrowing(eqn.invars[0], made_by):
                where = source_info_util.summarize(eqn.source_info)
                found.append(f"{_dtype(eqn.invars[0])} -> {_dtype(eqn.outvars[0])} at {where}")
    return found


def traced(fn: Callable, *args: Any) -> Any:
    """The jaxpr of ``fn`` with its jitted calls inlined (XLA inlines them:
    a pair across a call boundary is still a pair)."""
    with jax.disable_jit():
        return jax.make_jaxpr(fn)(*args).jaxpr


# ---------------------------------------------------------------------------
# Running a program as XLA:GPU compiles it
# ---------------------------------------------------------------------------


class _AsXlaGpu(Hooks):
    """Every equation evaluated as it is, except a widening convert of a
    narrowing convert's result, which reads the wider value instead; calls
    entered, control flow and custom rules rebuilt, so that the pairs in
    their bodies go too."""

    def __init__(self, delete: bool):
        self.delete = delete
        self.wider: dict[Any, Any] = {}  # half var made by a narrowing convert -> the value it narrowed

    def mode(self, eqn: Any, labels: Any, frame: Frame) -> Mode:
        del labels, frame
        return Mode.ENTER if Mode.ENTER in TABLE[eqn.primitive.name].modes else Mode.REBUILD

    def equation(self, equation: Equation, invals: list[Any], bind: Callable) -> list[Any]:
        eqn = equation.eqn
        if self.delete and _widening(eqn) and eqn.invars[0] in self.wider:
            return [jnp.asarray(self.wider[eqn.invars[0]]).astype(_dtype(eqn.outvars[0]))]
        if _narrowing(eqn):
            self.wider[eqn.outvars[0]] = invals[0]
        return bind(invals)


def run_as_xla_gpu(fn: Callable, *args: Any, delete: bool = True) -> Any:
    """``fn(*args)`` evaluated equation by equation with every float ->
    half -> float convert pair deleted (the wider value read where the
    pair's result was), as XLA:GPU's simplification deletes them; with
    ``delete=False``, the same evaluation with the pairs kept."""
    flat, treedef = jax.tree.flatten(args)
    with jax.disable_jit():  # calls inlined, as XLA inlines them: a pair across a call is a pair
        closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(treedef, xs)))(*flat)
    out = Interpreter(_AsXlaGpu(delete)).run(closed, flat)
    return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *args)), out)


def test_the_emulation_deletes_a_pair_as_xla_gpu_does():
    # A test of the test: a rounding written as a round trip does nothing.
    x = jnp.full(4, 1.0 + 2.0**-12, F32)
    np.testing.assert_array_equal(run_as_xla_gpu(lambda v: v.astype(BF16).astype(F32), x), x)
    np.testing.assert_array_equal(run_as_xla_gpu(lambda v: v.astype(BF16).astype(F32) - v, x), 0.0)
    assert convert_pairs(traced(lambda v: v.astype(BF16).astype(F32), x))
    assert convert_pairs(traced(lambda v: jnp.where(v > 1, v.astype(F16), 0).astype(F32), x))
    # Rounded on the grid in float32, it is still a rounding.
    np.testing.assert_array_equal(run_as_xla_gpu(lambda v: nearest_on_grid(v, BF16), x), 1.0)
    assert not convert_pairs(traced(lambda v: nearest_on_grid(v, BF16), x))


# ---------------------------------------------------------------------------
# The programs that round
# ---------------------------------------------------------------------------


def _params(dtype: np.dtype) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 4)), dtype),
        "b": jnp.asarray(rng.normal(size=(4,)), dtype),
        "f32": jnp.asarray(rng.normal(size=(3,)) * 1e-3, F32),  # the half leaves hold the largest gradient
    }


def _loss(params: dict, x: jax.Array) -> jax.Array:
    h = x.astype(params["w"].dtype) @ params["w"] + params["b"][None, :]
    return jnp.mean(h.astype(F32) ** 2) + jnp.sum(params["f32"] ** 2)


def _update_program(tx: Any, dtype: np.dtype) -> tuple[Callable, tuple]:
    params = _params(dtype)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    return (lambda g, s, p: tx.update(g, s, p)), (grads, tx.init(params), params)


def _step_program(tx: Any, dtype: np.dtype) -> tuple[Callable, tuple]:
    params = _params(dtype)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 8)), F32)

    def step(params, state, x):
        _, grads = ls.value_and_grad(_loss)(state, params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, (params, tx.init(params), x)


def programs() -> Iterator[tuple[str, Callable, tuple]]:
    for dtype in HALF:
        for rounding in ROUNDINGS:
            for state_dtype in (None, dtype):
                name = f"low_precision[{rounding}, {dtype}, state_dtype={state_dtype}]"
                tx = ls.low_precision(optax.adamw(1e-3), rounding, state_dtype=state_dtype)
                yield (name, *_update_program(tx, dtype))
            scaled = ls.dynamic(ls.low_precision(optax.adam(1e-3), rounding, state_dtype=dtype))
            yield (f"dynamic(low_precision[{rounding}, {dtype}]) step", *_step_program(scaled, dtype))
    # The loss-scaling paths alone: the unscale, the check and the skip. A
    # scale that is not a power of two rounds the unscaled half gradients,
    # which low_precision's inner optimizer reads in float32.
    for dtype in HALF:
        scaled = ls.static(ls.low_precision(optax.adam(1e-3), "kahan", state_dtype=BF16), scale=1000.0)
        yield (f"static(low_precision[kahan, {dtype}], scale=1000) step", *_step_program(scaled, dtype))
        yield (f"dynamic(adam) step, {dtype} params", *_step_program(ls.dynamic(optax.adam(1e-3)), dtype))
    # Automatic mixed precision: its casts change dtypes, not values that
    # are read back in float32.
    x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 8)), F32)
    for dtype in HALF:
        f = ls.autocast(_loss, dtype=dtype)
        yield (f"autocast({dtype}) value and grad", jax.value_and_grad(f), (_params(F32), x))
    # Per-segment scaling: the rescaled cotangents.
    tx = ls.predictive(optax.adam(1e-3), segments=segment_models.CHAIN_SEGMENTS)
    state = tx.init(segment_models.chain_params())
    segmented = lambda params, x: ls.value_and_grad(segment_models.chain_loss)(state, params, x)  # noqa: E731
    yield ("per-segment scaling", segmented, (segment_models.chain_params(), segment_models.chain_batch()))


with warnings.catch_warnings():  # float16 Adam moments: the warning is not what is tested
    warnings.simplefilter("ignore", ls.Float16StateWarning)
    PROGRAMS = {name: (fn, args) for name, fn, args in programs()}


UPDATES = [name for name in PROGRAMS if name.startswith("low_precision[")]


@pytest.mark.parametrize("name", UPDATES)
def test_no_rounding_is_a_convert_pair(name):
    # ls.low_precision's update rounds only on the grid in float32, and
    # casts to a half dtype only what it stores: no pair at all.
    fn, args = PROGRAMS[name]
    assert convert_pairs(traced(fn, *args)) == []


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_deleting_the_convert_pairs_changes_nothing(name):
    # Where a pair remains (a half value rounded on its grid, then cast and
    # widened again by the optimizer), it rounds nothing: the program gives
    # the same bits with every pair deleted, as XLA:GPU compiles it.
    fn, args = PROGRAMS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = run_as_xla_gpu(fn, *args, delete=False)
        deleted = run_as_xla_gpu(fn, *args)
    assert_trees_bitwise(deleted, kept)


# ---------------------------------------------------------------------------
# What the roundings give with every pair deleted
# ---------------------------------------------------------------------------


def test_kahan_adds_small_updates_up_as_xla_gpu_compiles_it():
    # 1.0 in bfloat16 plus 1e-4 a step: Kahan lands on bfloat16's 1.1 after
    # a thousand steps, where nearest rounding stays at 1.0.
    tx = ls.low_precision(optax.sgd(1.0), "kahan")
    params = jnp.ones(8, BF16)
    state = tx.init(params)
    grads = jnp.full(8, -1e-4, F32)

    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(1000):
        params, state = run_as_xla_gpu(step, params, state)
    np.testing.assert_array_equal(np.asarray(params, np.float32), float(jnp.bfloat16(1.1)))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rounding", ["kahan", "nearest"])
def test_the_update_lands_on_the_rounded_parameter_as_xla_gpu_compiles_it(rounding, dtype):
    rng = np.random.default_rng(3)
    p = jnp.asarray(rng.uniform(0.5, 2, 4096) * 2.0 ** rng.integers(-10, 10, 4096), dtype)
    delta = jnp.asarray(np.asarray(p, np.float32) * 2.0 ** rng.uniform(-12, 0, 4096) * rng.choice([-1, 1], 4096), F32)
    tx = ls.low_precision(optax.sgd(1.0), rounding)
    updates, state = run_as_xla_gpu(tx.update, -delta, tx.init(p), p)
    p32 = np.asarray(p, np.float32)
    nearest = np.asarray(jnp.asarray(p32 + np.asarray(delta)).astype(dtype), np.float32)
    np.testing.assert_array_equal(p32 + np.asarray(updates), nearest)
    if rounding == "kahan":  # what the rounding lost is kept, rounded to the compensation's dtype
        lost = np.asarray(delta) - (nearest - p32)
        want = np.asarray(jnp.asarray(lost).astype(dtype), np.float32)
        np.testing.assert_array_equal(np.asarray(state.compensation, np.float32), want)
        assert np.count_nonzero(want) > 3000


# ---------------------------------------------------------------------------
# The grids themselves
# ---------------------------------------------------------------------------


def _every_kind_of_float32() -> np.ndarray:
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    magnitudes = (rng.standard_normal(400_000) * np.exp2(rng.integers(-30, 20, 400_000))).astype(np.float32)
    subnormal_grid = (np.arange(-(2**12), 2**12) * 2.0**-26).astype(np.float32)  # float16's ties included
    specials = np.float32([0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 65536, 2.0**-24, 2.0**-25])
    return np.concatenate([bits, magnitudes, subnormal_grid, specials, -specials])


@pytest.mark.parametrize("dtype", HALF)
def test_nearest_on_the_grid_is_the_cast_round_trip_bit_for_bit(dtype):
    x = _every_kind_of_float32()
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.asarray(x.astype(dtype).astype(np.float32))
    for got in (nearest_on_grid(jnp.asarray(x), dtype), jax.jit(nearest_on_grid, static_argnums=1)(x, dtype)):
        got = np.asarray(got)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), x[~same][:8]


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_on_the_grid_casts_exactly_and_overflows_as_nearest_does(dtype):
    x = _every_kind_of_float32()
    bits = jax.random.bits(jax.random.key(5), x.shape, jnp.uint32)
    got = np.asarray(stochastic_on_grid(jnp.asarray(x), dtype, bits))
    with np.errstate(over="ignore", invalid="ignore"):
        cast = np.asarray(got.astype(dtype).astype(np.float32))
    assert ((got.view(np.uint32) == cast.view(np.uint32)) | (np.isnan(got) & np.isnan(x))).all()
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = x.astype(dtype).astype(np.float32)
    # Wherever nearest rounding gives an infinity from a finite value beyond
    # the largest plus half a gap, so does stochastic rounding.
    with np.errstate(invalid="ignore"):  # the signalling NaNs among x
        beyond = np.isfinite(x) & (np.abs(x) / 2 >= float(jnp.finfo(dtype).max))
    assert np.array_equal(got[beyond], nearest[beyond])

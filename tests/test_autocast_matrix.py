"""``ls.autocast`` against its reference over the layers people run: flax
linen, flax NNX and Equinox layers (dense, conv, embedding, attention with
an additive -1e9 bias, a boolean mask and a fully masked row, dropout,
LayerNorm, RMSNorm, BatchNorm in training and evaluation, GroupNorm) and
plain-JAX norms and losses, each written in float32, at input magnitudes 1
to 10000, called eagerly, under ``jit`` and under ``grad``.

The reference (tests/_autocast_reference.py) is the same model in its
framework's own half-precision mode, or cast by hand the way those modules
cast. Each test is one cell, ``layer-framework-mode``; it checks every
magnitude and names the failing ones. At each magnitude:

- outputs, gradients and module state have the float32 model's dtypes;
- they are finite wherever the reference is finite;
- wherever the reference is correct (within tolerance of float32), they
  are within tolerance of the reference and of float32;
- module state evolves as in float32: linen's ``batch_stats`` collection,
  Equinox's ``eqx.nn.State``, NNX's module mutated in place (BatchNorm's
  running statistics, Dropout's RNG counter: two calls in a row draw two
  masks, those float32 draws) after an eager call, an ``nnx.jit`` call and
  ``nnx.value_and_grad``;
- under ``jit``, the result is the eager one, within tolerance.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loss_scale as ls

pytest.importorskip("flax")
pytest.importorskip("equinox")

from flax import nnx  # noqa: E402

from tests import _autocast_reference as reference  # noqa: E402

MAGNITUDES = (1.0, 100.0, 300.0, 1000.0, 10000.0)
# Tolerances, relative to the reference's largest magnitude: max|a - ref|
# <= tol * max|ref| over the entries where the reference is finite. Autocast
# and the reference both round to the half dtype, but not at exactly the
# same operations (autocast keeps in float32 what follows a float32
# statistic, flax rounds a norm's output to half), so they differ by a few
# units in the last place of the largest values: float16 keeps 11
# significant bits (2**-11 ~ 4.9e-4 per rounding), bfloat16 8 (3.9e-3).
# Measured on the cells that pass: at most 1.2e-3 (float16) and 4.5e-3
# (bfloat16) for outputs and state, 2.6e-3 and 1.5e-2 for gradients, which
# go through one more half-precision product (the cotangent's) and through
# float16's subnormals where a norm divides by 10000. 1e-2 and 4e-2, 3x that
# for gradients, leave a margin of 8x and stay far below a wrong result
# (a norm that outputs zeros is off by 1).
TOL = {np.dtype(jnp.float16): 1e-2, np.dtype(jnp.bfloat16): 4e-2}
GRAD_TOL_FACTOR = 3.0
TINY = 1e-30
# Float32's and the reference's programs (not autocast's) compile without
# LLVM's optimisations: half the compile time, and the same IEEE arithmetic
# (XLA's CPU backend uses no fast-math either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0}

FUNCTIONAL = {"linen": reference.linen_cell, "equinox": reference.equinox_cell, "jax": reference.jax_cell}
LAYERS = {
    "linen": ("dense", "conv", "embedding", "attention_bias", "attention_mask", "dropout", *reference.NORMS),
    "nnx": ("dense", "conv", "embedding", "attention_bias", "attention_mask", "dropout", *reference.NORMS),
    "equinox": ("dense", "conv", "embedding", "attention_mask", "dropout", *reference.NORMS),
    "jax": ("rms_pow", "rms_mul", "var_norm", "linalg_norm", "cross_entropy", "mse", "attention_bias"),
}
BF16 = {"linen": ("layernorm_bf16",), "nnx": ("batchnorm_train_bf16",), "equinox": ("rmsnorm_bf16",)}
BF16["jax"] = ("rms_pow_bf16", "mse_bf16")
CELLS = [
    pytest.param(layer, framework, mode, id=f"{layer}-{framework}-{mode}")
    for framework in LAYERS
    for layer in (*LAYERS[framework], *BF16[framework])
    for mode in ("eager", "jit", "grad")
]


def half_of(layer: str) -> Any:
    return jnp.bfloat16 if layer.endswith("_bf16") else jnp.float16


def plain(a: Any) -> np.ndarray:
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def error(a: np.ndarray, b: np.ndarray) -> float:
    """``max|a - b| / max|b|`` over the entries where ``b`` is finite."""
    finite = np.isfinite(b)
    if not finite.any():
        return 0.0
    return float(np.abs(a - b)[finite].max() / (np.abs(b[finite]).max() + TINY))


def compare(what: str, got: Any, ref: Any, f32: Any, tol: float) -> list[str]:
    """What is wrong with ``got`` against the reference and float32."""
    problems = []
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f32)]
    got, ref, f32 = jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(f32)
    if len(got) != len(f32):
        return [f"{what}: {len(got)} leaves, float32 gives {len(f32)}"]
    for path, g, r, w in zip(paths, got, ref, f32, strict=True):
        name, g, r, w = what + path, plain(g), plain(r), plain(w)
        if g.dtype != w.dtype:
            problems.append(f"{name} is {g.dtype}, float32 gives {w.dtype}")
        elif not np.issubdtype(w.dtype, np.inexact):
            if not np.array_equal(g, w):
                problems.append(f"{name} = {g.ravel()[:4]}, float32 gives {w.ravel()[:4]}")
        else:
            g, r, w = (np.asarray(a, np.float64) for a in (g, r, w))
            bad = np.isfinite(r) & ~np.isfinite(g)
            if bad.any():
                problems.append(f"{name}: {bad.sum()} non-finite values ({g[bad][0]}) where the reference is finite")
            elif np.isfinite(w).all() and error(r, w) <= tol:
                off_ref, off_f32 = error(g, r), error(g, w)
                if max(off_ref, off_f32) > tol:
                    problems.append(f"{name}: off the reference by {off_ref:.2g}, float32 by {off_f32:.2g} (tol {tol})")
    return problems


def agree(what: str, jitted: Any, eager: Any, tol: float) -> list[str]:
    """The jitted result equals the eager one within the half tolerance."""
    problems = []
    for j, e in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager), strict=True):
        j, e = plain(j).astype(np.float64), plain(e).astype(np.float64)
        if not np.array_equal(np.isfinite(j), np.isfinite(e)):
            problems.append(
                f"{what}: jit gives {(~np.isfinite(j)).sum()} non-finite values, eager {(~np.isfinite(e)).sum()}"
            )
        elif error(j, e) > tol:
            problems.append(f"{what}: jit differs from eager by {error(j, e):.2g} (tol {tol})")
    return problems


def probes_for(out: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(np.shape(leaf)).astype(np.float32) for leaf in jax.tree.leaves(out)]


def scalar(out: Any, probes: list[np.ndarray]) -> jax.Array:
    """The loss the gradients are taken of: a fixed projection of the outputs."""
    return sum(jnp.sum(leaf * p) for leaf, p in zip(jax.tree.leaves(out), probes, strict=True))


def eager_results(results: Any, *cell: str) -> Any:
    """The cell's eager results to compare the jitted ones with, or None
    where the eager call raises (its own test reports that)."""
    try:
        return results(*cell, "eager")
    except Exception:
        return None


# ------------------------------------------------- linen, Equinox, plain JAX


@functools.cache
def functional(layer: str, framework: str) -> tuple[Any, list[np.ndarray]]:
    cell = FUNCTIONAL[framework](layer, half_of(layer))
    probes = probes_for(jax.eval_shape(cell.fn, *cell.args(1.0))[0])
    return cell, probes


def with_loss(fn: Any, probes: list[np.ndarray]) -> Any:
    def loss(params, state, inputs):
        out, new_state = fn(params, state, inputs)
        return scalar(out, probes), (out, new_state)

    return loss


@functools.cache
def functional_expected(layer: str, framework: str) -> dict[float, dict[str, Any]]:
    """Float32's and the reference's gradients, outputs and states (the
    gradients' auxiliary values), from one compile."""
    cell, probes = functional(layer, framework)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def expected(*args):
        return {
            name: jax.grad(with_loss(fn, probes), has_aux=True)(*args)
            for name, fn in (("f32", cell.fn), ("ref", cell.ref))
        }

    return {m: expected(*cell.args(m)) for m in MAGNITUDES}


@functools.cache
def functional_autocast(layer: str, framework: str, mode: str) -> dict[float, Any]:
    cell, probes = functional(layer, framework)
    half = half_of(layer)
    fn = {
        "eager": ls.autocast(cell.fn, half),
        "jit": jax.jit(ls.autocast(cell.fn, half)),
        "grad": jax.jit(jax.grad(ls.autocast(with_loss(cell.fn, probes), half), has_aux=True)),
    }[mode]
    return {m: fn(*cell.args(m)) for m in MAGNITUDES}


def functional_problems(layer: str, framework: str, mode: str, tol: float) -> dict[float, list[str]]:
    expected, got = functional_expected(layer, framework), functional_autocast(layer, framework, mode)
    found = {}
    for m in MAGNITUDES:
        e, g = expected[m], got[m]
        (r_grads, (r, r_state)), (w_grads, (w, w_state)) = e["ref"], e["f32"]
        if mode == "grad":
            grads, (out, state) = g
            problems = compare("grad", grads, r_grads, w_grads, GRAD_TOL_FACTOR * tol)
        else:
            out, state = g
            problems = []
        problems += compare("out", out, r, w, tol)
        problems += compare("state", state, r_state, w_state, tol)
        if mode == "jit" and (eager := eager_results(functional_autocast, layer, framework)) is not None:
            problems += agree("out", out, eager[m][0], tol)
        found[m] = problems
    return found


# ------------------------------------------------------------------ flax NNX


def nnx_call(model: nnx.Module, inputs: dict[str, Any]) -> Any:
    return model(**inputs)


def model_state(model: nnx.Module) -> Any:
    """What a call may change: BatchNorm's statistics, the RNG streams."""
    return nnx.state(model, nnx.Not(nnx.Param))


@functools.cache
def nnx_cell(layer: str) -> tuple[Any, nnx.Module, nnx.Module, list[np.ndarray]]:
    cell = reference.nnx_cell(layer, half_of(layer))
    model, ref = cell.make(None), cell.make(half_of(layer))  # the same parameters, statistics and RNG streams
    probes = probes_for(nnx.eval_shape(lambda m: m(**nnx_inputs(layer, 1.0)), model))
    return cell, model, ref, probes


def nnx_inputs(layer: str, magnitude: float) -> dict[str, Any]:
    inputs = reference.inputs_for(layer, magnitude)
    inputs.pop("key", None)  # NNX's Dropout draws from its own RNG stream
    return inputs


def nnx_loss(probes: list[np.ndarray]) -> Any:
    def loss(model, inputs):
        out = model(**inputs)
        return scalar(out, probes), out

    return loss


def nnx_calls(fn: Any, base: nnx.Module, cell: Any, layer: str, magnitude: float) -> list[Any]:
    """``(result, module state after)`` for ``cell.calls`` calls in a row of
    ``fn(module, inputs)`` on a fresh copy of ``base``."""
    model = nnx.clone(base)
    cell.prepare(model, magnitude)
    inputs = nnx_inputs(layer, magnitude)
    return [(fn(model, inputs), jax.tree.map(jnp.copy, model_state(model))) for _ in range(cell.calls)]


@functools.cache
def nnx_expected(layer: str) -> dict[float, list[dict[str, Any]]]:
    """Float32's and the reference's outputs, gradients and module states
    after each call, from one compile (each module on its own copy)."""
    cell, model, ref, probes = nnx_cell(layer)
    value_and_grad = nnx.value_and_grad(nnx_loss(probes), has_aux=True)
    graphdefs = nnx.graphdef(model), nnx.graphdef(ref)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def expected(states, inputs):
        modules = [nnx.merge(g, s) for g, s in zip(graphdefs, states, strict=True)]
        return [value_and_grad(m, inputs) for m in modules], [nnx.state(m) for m in modules]

    found = {}
    for m in MAGNITUDES:
        modules, inputs, found[m] = [nnx.clone(model), nnx.clone(ref)], nnx_inputs(layer, m), []
        for module in modules:
            cell.prepare(module, m)
        for _ in range(cell.calls):
            results, states = expected([nnx.state(module) for module in modules], inputs)
            for module, state in zip(modules, states, strict=True):
                nnx.update(module, state)
            after = [jax.tree.map(jnp.copy, model_state(module)) for module in modules]
            found[m].append({name: (r, s) for name, r, s in zip(("f32", "ref"), results, after, strict=True)})
    return found


@functools.cache
def nnx_autocast(layer: str, mode: str) -> dict[float, Any]:
    cell, model, _, probes = nnx_cell(layer)
    half = half_of(layer)
    fn = {
        "eager": ls.autocast(nnx_call, half),
        "jit": nnx.jit(ls.autocast(nnx_call, half)),
        "grad": nnx.value_and_grad(ls.autocast(nnx_loss(probes), half), has_aux=True),
    }[mode]
    return {m: nnx_calls(fn, model, cell, layer, m) for m in MAGNITUDES}


def nnx_problems(layer: str, mode: str, tol: float) -> dict[float, list[str]]:
    expected, got = nnx_expected(layer), nnx_autocast(layer, mode)
    found = {}
    for m in MAGNITUDES:
        problems, outs = [], []
        for i, ((result, state), e) in enumerate(zip(got[m], expected[m], strict=True)):
            (((_, r), r_grads), r_state), (((_, w), w_grads), w_state) = e["ref"], e["f32"]
            at = f"call {i + 1}: " if len(got[m]) > 1 else ""
            if mode == "grad":
                (_, out), grads = result
                grads, r_grads, w_grads = (nnx.to_pure_dict(g) for g in (grads, r_grads, w_grads))
                problems += compare(at + "grad", grads, r_grads, w_grads, GRAD_TOL_FACTOR * tol)
            else:
                out = result
            outs.append(out)
            problems += compare(at + "out", out, r, w, tol)
            state, r_state, w_state = (nnx.to_pure_dict(s) for s in (state, r_state, w_state))
            problems += compare(at + "module state", state, r_state, w_state, tol)
            if mode == "jit" and (eager := eager_results(nnx_autocast, layer)) is not None:
                problems += agree(at + "out", out, eager[m][i][0], tol)
        if layer.startswith("dropout") and np.array_equal(np.asarray(outs[0][0]) == 0, np.asarray(outs[1][0]) == 0):
            problems.append("two calls in a row drew the same dropout mask")
        found[m] = problems
    return found


# ------------------------------------------------------------------ the test


@pytest.mark.parametrize("layer, framework, mode", CELLS)
def test_autocast_equals_its_reference(layer: str, framework: str, mode: str) -> None:
    tol = TOL[np.dtype(half_of(layer))]
    found = nnx_problems(layer, mode, tol) if framework == "nnx" else functional_problems(layer, framework, mode, tol)
    failing = {m: p for m, p in found.items() if p}
    assert not failing, f"{layer}-{framework}-{mode} fails at magnitudes {sorted(failing)}:\n" + "\n".join(
        f"  {m:g}: " + "; ".join(p[:3]) + (f" (+{len(p) - 3} more)" if len(p) > 3 else "") for m, p in failing.items()
    )

#!/usr/bin/env python
"""Per-step overhead of loss scaling: ``loss_scale.dynamic`` against the peers.

For a ~21M-parameter MLP and a ~10M-parameter causal transformer LM, each in
float32 and in "mixed" precision (float32 params, float16 compute, float32
loss), this times with ``optax.adam``:

* ``adam (bare)``: the unscaled loss, no finite check: the baseline;
* ``ls.dynamic``: a normal (finite) step of ``loss_scale.dynamic(adam)``;
* ``ls.dynamic overflow``: the same executable, fed so that every step
  overflows and is skipped;
* ``optax.apply_if_finite``: optax's finite check, no scaling;
* ``jmp``: ``jmp.DynamicLossScale`` + ``jmp.select_tree`` as jmp's README does;
* ``flax DynamicScale``: ``DynamicScale.value_and_grad`` + ``jnp.where`` over
  params and optimizer state as flax's examples do;

each as a full jitted train step (forward, backward, update, apply_updates)
and as the optimizer update alone (given precomputed gradients), with params
and optimizer state donated. Variants run interleaved round-robin, so every
round holds one sample of each under the same machine conditions, and each is
reported as the median [p25, p75] of its per-round ratio to the bare step.
Compile time (``lower`` + ``compile``) and the memory that XLA plans
(``compiled.memory_analysis()``) are reported next to it.

XLA:CPU timings depend heavily on glibc malloc (the temp buffer is
page-faulted in again on every step unless malloc keeps it):
``--tuned-malloc`` re-runs the benchmark in a subprocess with malloc tuned to
reuse memory, as accelerator allocators do; ``--both`` prints both.

Usage::

    python benchmarks/overhead.py                   # full run, current malloc
    python benchmarks/overhead.py --both --json out.json
    python benchmarks/overhead.py --quick           # tiny models: a smoke test

From Python, ``main(["--quick"])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls

PyTree = Any

LEARNING_RATE = 1e-3
# The same power of two for every scaler: dividing by it is exact, so the
# scaled variants must reproduce bare Adam's update to float32 rounding.
LOSS_SCALE = 2.0**15
# optax.apply_if_finite's limit; it only matters after that many consecutive
# non-finite steps, which the benchmark never reaches.
MAX_CONSECUTIVE_ERRORS = 5

# glibc settings that make malloc keep and reuse freed memory (no mmap for
# large blocks, no trimming, one arena), the way accelerator allocators do.
# They only take effect when set before the process starts.
TUNED_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
}
# Environment variables that change the allocator, printed in the header.
MALLOC_ENV_VARS = (*TUNED_MALLOC, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")

# --quick is a smoke test whose wall time is mostly XLA:CPU compiling ~50
# executables: optimizing less and using XLA:CPU's older loop emitters
# (measured 3-6x faster to compile) keeps it well under a minute.
QUICK_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}

BARE = "adam (bare)"
LS = "ls.dynamic"
LS_OVERFLOW = "ls.dynamic overflow"
LS_FUSED = "ls.dynamic + ls.apply_gradients"
LS_FUSED_OVERFLOW = "ls.dynamic + ls.apply_gradients overflow"


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class Model(NamedTuple):
    """A model ready to benchmark: float32 params, a batch and its loss."""

    name: str
    precision: str
    description: str
    params: PyTree
    batch: PyTree
    loss_fn: Callable[[PyTree, PyTree], jax.Array]


def _compute_dtype(precision: str) -> jnp.dtype:
    return {"f32": jnp.float32, "mixed": jnp.float16}[precision]


def _cast(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    """Casts the floating leaves of ``tree``; in mixed precision the float32
    master params are cast to float16 inside the loss, so gradients arrive
    in float32 (the transpose of the cast)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _row(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` of shape ``[d]`` reshaped to broadcast against a rank-``ndim``
    array explicitly (the test suite runs with rank promotion disabled)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> jax.Array:
    """Random float32 params drawn with NumPy: ``jax.random`` would compile
    one XLA executable per shape, which dominates ``--quick``'s wall time."""
    return jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(std))


def _n_params(params: PyTree) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def _fmt_count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def make_mlp(precision: str, sizes: Sequence[int], batch_size: int, seed: int = 0) -> Model:
    """A ReLU MLP classifier with softmax cross-entropy.

    Args:
      precision: "f32" or "mixed" (float16 compute, float32 loss).
      sizes: layer widths, input first, number of classes last.
      batch_size: examples per batch.
      seed: PRNG seed for params and data.
    """
    rng = np.random.default_rng(seed)
    params = [
        {"w": _normal(rng, (n_in, n_out), math.sqrt(2.0 / n_in)), "b": jnp.zeros((n_out,), jnp.float32)}
        for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    batch = {
        "x": _normal(rng, (batch_size, sizes[0]), 1.0),
        "y": jnp.asarray(rng.integers(0, sizes[-1], (batch_size,)), jnp.int32),
    }
    dtype = _compute_dtype(precision)

    def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
        params = _cast(params, dtype)
        h = batch["x"].astype(dtype)
        for i, layer in enumerate(params):
            h = h @ layer["w"] + _row(layer["b"], h.ndim)
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        logits = h.astype(jnp.float32)  # the loss in float32
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))

    widths = "→".join(str(s) for s in sizes)
    return Model("mlp", precision, f"MLP {widths}, batch {batch_size}, {_fmt_count(_n_params(params))} params",
                 params, batch, loss_fn)  # fmt: skip


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Layer norm with float32 statistics (float16 variance is unsafe)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * _row(scale, y.ndim) + _row(bias, y.ndim)).astype(x.dtype)


def make_transformer(
    precision: str,
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
) -> Model:
    """A pre-LN causal transformer LM (learned positions, GELU MLP, untied
    head) with next-token cross-entropy, in plain ``jax.numpy``.

    Matmuls run in the compute dtype; layer-norm statistics, the attention
    softmax and the loss run in float32, as mixed-precision recipes do.
    """
    d_ff = 4 * d_model
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> jax.Array:
        return _normal(rng, (n_in, n_out), 0.02)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)}

    params = {
        "embed": dense(vocab, d_model),
        "pos": dense(seq_len, d_model),
        "layers": [
            {
                "ln1": norm(),
                "qkv": dense(d_model, 3 * d_model),
                "out": dense(d_model, d_model),
                "ln2": norm(),
                "w1": dense(d_model, d_ff),
                "b1": jnp.zeros((d_ff,), jnp.float32),
                "w2": dense(d_ff, d_model),
                "b2": jnp.zeros((d_model,), jnp.float32),
            }
            for _ in range(n_layers)
        ],
        "ln_f": norm(),
        "head": dense(d_model, vocab),
    }
    tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len + 1)), jnp.int32)
    dtype = _compute_dtype(precision)
    head_dim = d_model // n_heads
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))[None, None]

    def attention(x: jax.Array, layer: PyTree) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, n_heads, head_dim) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d_model) @ layer["out"]

    def loss_fn(params: PyTree, tokens: jax.Array) -> jax.Array:
        params = _cast(params, dtype)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"][inputs] + params["pos"][None]
        for layer in params["layers"]:
            x = x + attention(_layer_norm(x, **layer["ln1"]), layer)
            h = jax.nn.gelu(_layer_norm(x, **layer["ln2"]) @ layer["w1"] + _row(layer["b1"], x.ndim))
            x = x + h @ layer["w2"] + _row(layer["b2"], x.ndim)
        logits = (_layer_norm(x, **params["ln_f"]) @ params["head"]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    description = (
        f"transformer LM d={d_model} L={n_layers} H={n_heads} vocab={vocab} seq={seq_len}, "
        f"batch {batch_size}, {_fmt_count(_n_params(params))} params"
    )
    return Model("transformer", precision, description, params, tokens, loss_fn)


def build_model(name: str, precision: str, quick: bool, large: bool = False) -> Model:
    """The benchmark's model configurations; ``quick`` shrinks them to a
    smoke test that compiles and runs in seconds, ``large`` grows them to a
    size that keeps a GPU busy for milliseconds per step (~240M and ~200M
    parameters), so that kernel launches do not dominate the timings."""
    if name == "mlp":
        if quick:
            return make_mlp(precision, (64, 128, 10), batch_size=8)
        if large:
            return make_mlp(precision, (4096, 8192, 8192, 8192, 8192, 1000), batch_size=1024)
        return make_mlp(precision, (1024, 2048, 2048, 2048, 2048, 2048, 1000), batch_size=64)
    if name == "transformer":
        if quick:
            return make_transformer(precision, vocab=128, d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2)
        if large:
            return make_transformer(
                precision, vocab=32768, d_model=1024, n_layers=12, n_heads=16, seq_len=512, batch_size=16
            )
        return make_transformer(precision, vocab=8192, d_model=256, n_layers=8, n_heads=4, seq_len=64, batch_size=4)
    raise ValueError(f"unknown model {name!r}; choose from mlp, transformer")


# ---------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------

# (params, opt_state, extra, batch) -> (params, opt_state, extra, loss)
TrainStep = Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree, PyTree, jax.Array]]
# (params, opt_state, extra, grads) -> (params, opt_state, extra)
UpdateStep = Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree, PyTree]]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of training, as a full train step and as the update alone.

    The state threaded through both functions is ``(params, opt_state,
    extra)``, where ``extra`` holds a peer's loss-scale object (``None``
    when the scale lives in the optimizer state).

    Attributes:
      name: the row label.
      init: params -> (opt_state, extra).
      train_step: forward, backward, update and apply_updates.
      update: the update and apply_updates alone, given gradients of the
        loss multiplied by ``grad_scale``.
      applied: (opt_state, extra) -> whether the last step applied its
        update; checked after warm-up so that no variant is timed on the
        wrong branch.
      grad_scale: the scale of the gradients ``update`` expects.
      same_as: the variant whose executables this one reuses (the overflow
        row runs the ``ls.dynamic`` executables on overflowing data).
      overflow: every step of this variant must be skipped.
    """

    name: str
    init: Callable[[PyTree], tuple[PyTree, PyTree]]
    train_step: TrainStep
    update: UpdateStep
    applied: Callable[[PyTree, PyTree], jax.Array]
    grad_scale: float = 1.0
    same_as: str | None = None
    overflow: bool = False


def _adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def _optax_variant(
    name: str, tx: optax.GradientTransformation, loss_fn: Callable, scaled: bool, fused: bool = False
) -> Variant:
    """A variant whose whole logic is an optax transformation: bare Adam,
    ``ls.dynamic`` (``scaled``: gradients of the scaled loss via
    ``ls.value_and_grad``; ``fused``: ``ls.apply_gradients`` instead of
    ``tx.update`` + ``optax.apply_updates``) and ``optax.apply_if_finite``."""

    def init(params):
        return tx.init(params), None

    def update(params, opt_state, extra, grads):
        if fused:
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, extra
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, extra

    def train_step(params, opt_state, extra, batch):
        if scaled:
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, batch)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return *update(params, opt_state, extra, grads), loss

    def applied(opt_state, extra):
        if isinstance(opt_state, ls.LossScaleState):
            return jnp.logical_not(opt_state.skipped)
        if isinstance(opt_state, optax.ApplyIfFiniteState):
            return opt_state.last_finite
        return jnp.array(True)

    return Variant(name, init, train_step, update, applied, grad_scale=LOSS_SCALE if scaled else 1.0)


def _jmp_variant(loss_fn: Callable) -> Variant | str:
    """jmp's README recipe: scale the loss, unscale the grads, check them
    with ``all_finite``, adjust the scale, and ``select_tree`` between the
    new and the old (params, opt_state).

    The step takes the scale's arrays ``(loss_scale, counter)`` and rebuilds
    the ``jmp.DynamicLossScale`` inside: jmp 0.0.4 validates its fields in
    ``__post_init__``, which breaks when ``jit(...).lower`` unflattens it
    around placeholder leaves; its default ``min_loss_scale`` of 1 is what its
    own unflatten would restore anyway.
    """
    try:
        import jmp
    except ImportError:
        return "jmp: skipped (not installed; pip install jmp)"
    tx = _adam()

    def init(params):
        return tx.init(params), (jnp.asarray(LOSS_SCALE, jnp.float32), jnp.zeros((), jnp.int32))

    def update(params, opt_state, scale_arrays, grads):
        loss_scale = jmp.DynamicLossScale(*scale_arrays)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, (loss_scale.loss_scale, loss_scale.counter)

    def train_step(params, opt_state, scale_arrays, batch):
        loss_scale = jmp.DynamicLossScale(*scale_arrays)
        loss, grads = jax.value_and_grad(lambda p, b: loss_scale.scale(loss_fn(p, b)))(params, batch)
        return *update(params, opt_state, scale_arrays, grads), loss_scale.unscale(loss)

    def applied(opt_state, scale_arrays):
        # The counter counts clean steps modulo the period and resets on overflow.
        return scale_arrays[1] > 0

    return Variant("jmp DynamicLossScale", init, train_step, update, applied, grad_scale=LOSS_SCALE)


@jax.custom_vjp
def _inject_grads(params: PyTree, grads: PyTree) -> jax.Array:
    """A zero "loss" whose gradient w.r.t. ``params`` is ``grads``.

    Lets the update-only benchmark run flax's own ``DynamicScale.value_and_grad``
    (which unscales, checks and adjusts inside it) on precomputed gradients
    without re-deriving flax's logic here. The cotangent is ignored, so the
    gradients pass through untouched and XLA sees no extra arithmetic.
    """
    del params, grads
    return jnp.zeros((), jnp.float32)


def _inject_fwd(params: PyTree, grads: PyTree) -> tuple[jax.Array, PyTree]:
    del params
    return jnp.zeros((), jnp.float32), grads


def _inject_bwd(grads: PyTree, cotangent: jax.Array) -> tuple[PyTree, PyTree]:
    del cotangent
    return grads, jax.tree.map(jnp.zeros_like, grads)


_inject_grads.defvjp(_inject_fwd, _inject_bwd)


def _flax_variant(loss_fn: Callable) -> Variant | str:
    """flax's recipe: ``DynamicScale.value_and_grad`` (scaled loss; returns
    unscaled grads, an ``is_fin`` flag and the adjusted scale), the update,
    then ``jnp.where(is_fin, new, old)`` over params and optimizer state, as
    in flax's ImageNet example."""
    try:
        from flax.training.dynamic_scale import DynamicScale
    except ImportError:
        return "flax DynamicScale: skipped (flax not installed)"
    tx = _adam()

    def init(params):
        # Explicit dtypes, so that the state that comes out of a step has the
        # avals of the state that went in (no weak types).
        return tx.init(params), DynamicScale(
            fin_steps=jnp.zeros((), jnp.int32), scale=jnp.asarray(LOSS_SCALE, jnp.float32)
        )

    def finish(params, opt_state, dynamic_scale, is_fin, grads):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(select, new_params, params)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return params, opt_state, dynamic_scale

    def update(params, opt_state, dynamic_scale, grads):
        new_scale, is_fin, _, grads = dynamic_scale.value_and_grad(_inject_grads)(params, grads)
        return finish(params, opt_state, new_scale, is_fin, grads)

    def train_step(params, opt_state, dynamic_scale, batch):
        new_scale, is_fin, loss, grads = dynamic_scale.value_and_grad(loss_fn)(params, batch)
        return *finish(params, opt_state, new_scale, is_fin, grads), loss

    def applied(opt_state, dynamic_scale):
        return dynamic_scale.fin_steps > 0

    return Variant("flax DynamicScale", init, train_step, update, applied, grad_scale=LOSS_SCALE)


def build_variants(loss_fn: Callable) -> tuple[list[Variant], list[str]]:
    """The variants in table order, and notes about any that were skipped."""
    ls_variant = _optax_variant(LS, ls.dynamic(_adam(), initial_scale=LOSS_SCALE), loss_fn, scaled=True)
    fused_variant = _optax_variant(
        LS_FUSED, ls.dynamic(_adam(), initial_scale=LOSS_SCALE), loss_fn, scaled=True, fused=True
    )
    variants = [
        _optax_variant(BARE, _adam(), loss_fn, scaled=False),
        ls_variant,
        dataclasses.replace(ls_variant, name=LS_OVERFLOW, same_as=LS, overflow=True),
        fused_variant,
        dataclasses.replace(fused_variant, name=LS_FUSED_OVERFLOW, same_as=LS_FUSED, overflow=True),
        _optax_variant(
            "optax.apply_if_finite",
            optax.apply_if_finite(_adam(), max_consecutive_errors=MAX_CONSECUTIVE_ERRORS),
            loss_fn,
            scaled=False,
        ),
    ]
    notes = []
    for peer in (_jmp_variant(loss_fn), _flax_variant(loss_fn)):
        if isinstance(peer, str):
            notes.append(peer)
        else:
            variants.append(peer)
    return variants, notes


def _overflow_full_state(opt_state: ls.LossScaleState) -> ls.LossScaleState:
    """The state that makes every full ``ls.dynamic`` step overflow.

    A scale of inf turns the backward pass into inf/nan (the way a too-large
    scale overflows float16, only certain), and it is a fixed point of the
    backoff (``max(inf * backoff, min_scale) = inf``), so every timed round
    sees the same state while running the very executable of the normal
    step: only the data differ.
    """
    return opt_state._replace(scale=jnp.asarray(jnp.inf, jnp.float32))


def _poison(grads: PyTree) -> PyTree:
    """``grads`` with one inf, in the first element of the first leaf."""
    leaves, treedef = jax.tree.flatten(grads)
    first = leaves[0]
    leaves[0] = first.reshape(-1).at[0].set(jnp.inf).reshape(first.shape)
    return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _copy(tree: PyTree) -> PyTree:
    """Fresh buffers, one per leaf: donation deletes the arrays a step is
    given, and refuses a buffer that two donated leaves share (an optimizer's
    ``init`` may put one array, say a zero counter, in several leaves)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def _memory(compiled: jax.stages.Compiled) -> dict[str, float] | None:
    """XLA's planned memory in MiB: temp, and peak = arguments + outputs +
    temp - the outputs that alias (donated) arguments."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    if ma is None:
        return None
    mib = 2.0**20
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    return {
        "temp_mib": ma.temp_size_in_bytes / mib,
        "peak_mib": peak / mib,
        "argument_mib": ma.argument_size_in_bytes / mib,
        "output_mib": ma.output_size_in_bytes / mib,
        "alias_mib": ma.alias_size_in_bytes / mib,
    }


def _compile(
    fn: Callable, args: tuple, hlo_path: str | None, compiler_options: dict[str, Any] | None
) -> tuple[jax.stages.Compiled, float]:
    """Jits ``fn`` with the state (the first three arguments) donated, and
    returns the executable with the seconds that tracing, lowering and
    compiling took.

    ``fn`` is wrapped in a fresh function so that JAX's tracing cache, which
    is keyed on the function object, cannot serve an earlier trace of it.
    """
    fresh = functools.wraps(fn)(lambda *a: fn(*a))
    start = time.perf_counter()
    compiled = jax.jit(fresh, donate_argnums=(0, 1, 2)).lower(*args).compile(compiler_options)
    seconds = time.perf_counter() - start
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(compiled.as_text())
    return compiled, seconds


def _round_robin(
    executables: dict[str, jax.stages.Compiled],
    states: dict[str, tuple],
    feeds: dict[str, PyTree],
    rounds: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Seconds per call of each executable, interleaved A B C .. A B C ..

    The starting variant rotates every round, so no variant always runs
    right after the same neighbour (whose freed memory it may inherit).
    Python's garbage collector is paused while timing.
    """
    names = list(executables)

    def call(name: str) -> None:
        out = executables[name](*states[name], feeds[name])
        jax.block_until_ready(out)
        states[name] = tuple(out[:3])

    for _ in range(warmup):
        for name in names:
            call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                call(name)
                times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return times


def _ratio_stats(times: list[float], bare: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-round ratios to the bare step."""
    ratios = np.asarray(times) / np.asarray(bare)
    p25, median, p75 = np.percentile(ratios, [25, 50, 75])
    return {
        "median": float(median),
        "p25": float(p25),
        "p75": float(p75),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "median_ms": float(np.median(times) * 1e3),
    }


def _check_updates(
    variants: list[Variant],
    executables: dict[str, jax.stages.Compiled],
    params: PyTree,
    feeds: dict[str, PyTree],
) -> None:
    """One update of each variant from the same params and fresh state.

    Scaled variants receive ``LOSS_SCALE * g`` and must reproduce bare
    Adam's parameters to float32 rounding (the scale is a power of two, so
    unscaling is exact); the overflow variant must leave them bit-for-bit
    unchanged and report the step as skipped.
    """
    results = {}
    for v in variants:
        opt_state, extra = _copy(v.init(params))
        new_params, new_opt_state, new_extra = executables[v.name](_copy(params), opt_state, extra, feeds[v.name])
        results[v.name] = new_params
        applied = bool(v.applied(new_opt_state, new_extra))
        if v.overflow:
            if applied:
                raise AssertionError(f"{v.name}: the overflow step was not skipped")
            for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
                np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=f"{v.name} moved params")
        elif not applied:
            raise AssertionError(f"{v.name}: a finite step was skipped")
    reference = jax.tree.leaves(results[BARE])
    for v in variants:
        if v.overflow or v.name == BARE:
            continue
        for ref, got in zip(reference, jax.tree.leaves(results[v.name]), strict=True):
            np.testing.assert_allclose(
                np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-9, err_msg=f"{v.name} differs from bare Adam"
            )


def _check_applied(variants: list[Variant], states: dict[str, tuple]) -> None:
    """After warm-up: normal variants applied their last step, the overflow
    variant skipped it (else its row would time the other branch)."""
    for v in variants:
        _, opt_state, extra = states[v.name]
        applied = bool(v.applied(opt_state, extra))
        if applied == v.overflow:
            what = "applied an update" if applied else "skipped its step (the gradients overflowed)"
            raise AssertionError(f"{v.name} {what} during the full-step warm-up; its timing would be meaningless")


def benchmark_model(
    model: Model,
    rounds: int,
    warmup: int,
    hlo_dir: str | None = None,
    compiler_options: dict[str, Any] | None = None,
    warm_tracing: bool = True,
) -> dict[str, Any]:
    """Compiles, checks and times every variant on one model/precision.

    Args:
      model: the model, its batch and loss.
      rounds: timed round-robin rounds.
      warmup: untimed rounds before them.
      hlo_dir: if given, the optimized HLO of every executable is written there.
      compiler_options: XLA options for every compile (``--quick`` lowers the
        optimization level to compile faster).
      warm_tracing: trace every variant once, untimed, before timing the
        compiles, so that helpers JAX caches across traces (jitted
        ``jax.numpy`` internals) are not charged to whichever variant is
        compiled first.
    """
    variants, notes = build_variants(model.loss_fn)
    params = model.params

    grads = jax.jit(jax.grad(model.loss_fn)).lower(params, model.batch).compile(compiler_options)(params, model.batch)
    scaled_grads = jax.tree.map(lambda g: g * LOSS_SCALE, grads)
    update_feeds = {
        v.name: _poison(scaled_grads) if v.overflow else (scaled_grads if v.grad_scale != 1.0 else grads)
        for v in variants
    }

    # Compile each distinct variant twice: the full step and the update.
    compiled: dict[str, dict[str, jax.stages.Compiled]] = {"step": {}, "update": {}}
    compile_s: dict[str, dict[str, float]] = {"step": {}, "update": {}}
    memory: dict[str, dict[str, Any]] = {"step": {}, "update": {}}
    if warm_tracing:
        for v in variants:
            if v.same_as is None:
                opt_state, extra = v.init(params)
                jax.jit(v.train_step).trace(params, opt_state, extra, model.batch)
                jax.jit(v.update).trace(params, opt_state, extra, update_feeds[v.name])
    for v in variants:
        if v.same_as is not None:
            continue
        opt_state, extra = v.init(params)
        tag = f"{model.name}_{model.precision}_{v.name}".replace(" ", "_").replace(".", "_")
        for kind, fn, feed in (("step", v.train_step, model.batch), ("update", v.update, update_feeds[v.name])):
            hlo_path = os.path.join(hlo_dir, f"{tag}_{kind}.hlo.txt") if hlo_dir else None
            exe, seconds = _compile(fn, (params, opt_state, extra, feed), hlo_path, compiler_options)
            compiled[kind][v.name], compile_s[kind][v.name], memory[kind][v.name] = exe, seconds, _memory(exe)
    for v in variants:
        if v.same_as is not None:
            for kind in compiled:
                compiled[kind][v.name] = compiled[kind][v.same_as]
                compile_s[kind][v.name] = compile_s[kind][v.same_as]
                memory[kind][v.name] = memory[kind][v.same_as]

    _check_updates(variants, compiled["update"], params, update_feeds)

    times: dict[str, dict[str, list[float]]] = {}
    for kind in ("update", "step"):
        states = {}
        for v in variants:
            opt_state, extra = _copy(v.init(params))
            if v.overflow and kind == "step":
                opt_state = _overflow_full_state(opt_state)
            states[v.name] = (_copy(params), opt_state, extra)
        feeds = {v.name: model.batch if kind == "step" else update_feeds[v.name] for v in variants}
        if kind == "step":
            # One step, then check every variant is on the branch it claims.
            for v in variants:
                out = compiled[kind][v.name](*states[v.name], feeds[v.name])
                states[v.name] = tuple(out[:3])
            _check_applied(variants, states)
        times[kind] = _round_robin(compiled[kind], states, feeds, rounds, warmup)
        del states

    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v.name, "same_executable_as": v.same_as}
        for kind in ("step", "update"):
            row[kind] = _ratio_stats(times[kind][v.name], times[kind][BARE])
            row[f"{kind}_compile_s"] = compile_s[kind][v.name]
            row[f"{kind}_compile_ratio"] = compile_s[kind][v.name] / compile_s[kind][BARE]
            row[f"{kind}_memory"] = memory[kind][v.name]
        rows.append(row)
    return {
        "model": model.name,
        "precision": model.precision,
        "description": model.description,
        "n_params": _n_params(params),
        "backend": jax.default_backend(),
        "rounds": rounds,
        "warmup": warmup,
        "notes": notes,
        "rows": rows,
        "raw_seconds": times,
    }


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    return getattr(jaxlib, "__version__", None)


def _source_digest() -> str:
    """A short hash of loss_scale's sources: ties a result to the code that
    produced it while the package is still changing."""
    package = os.path.dirname(ls.__file__)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, device, CPUs, allocator."""
    device = jax.devices()[0]
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    return {
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "optax": optax.__version__,
        "loss_scale": f"{ls.__version__} (sources {_source_digest()})",
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device": str(device),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "machine": platform.machine(),
        "malloc_env": {k: os.environ[k] for k in MALLOC_ENV_VARS if k in os.environ},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def header_line(env: dict[str, Any]) -> str:
    malloc = " ".join(f"{k}={v}" for k, v in env["malloc_env"].items()) or "glibc defaults"
    return (
        f"jax {env['jax']} | optax {env['optax']} | loss_scale {env['loss_scale']} | "
        f"backend {env['backend']} | device {env['device']} "
        f"({env['device_kind']}) | CPUs {env['usable_cpus']}/{env['cpu_count']} | malloc: {malloc}"
        + (f" | XLA_FLAGS={env['xla_flags']}" if env["xla_flags"] else "")
    )


def _fmt_ratio(stats: dict[str, float]) -> str:
    return f"{stats['median']:.2f} [{stats['p25']:.2f}, {stats['p75']:.2f}]"


def _fmt_mib(memory: dict[str, float] | None, base: dict[str, float] | None, key: str) -> str:
    if memory is None:
        return "n/a"
    text = f"{memory[key]:.1f}"
    if base is not None:
        text += f" ({memory[key] - base[key]:+.1f})"
    return text


def format_table(result: dict[str, Any]) -> str:
    """A markdown table of one model/precision."""
    bare = next(r for r in result["rows"] if r["variant"] == BARE)
    lines = [
        f"### {result['model']} {result['precision']}: {result['description']}",
        "",
        f"bare adam: step {bare['step']['median_ms']:.2f} ms, update-only {bare['update']['median_ms']:.2f} ms "
        f"(medians); compile step {bare['step_compile_s']:.2f} s; {result['rounds']} rounds, "
        f"{result['warmup']} warm-up"
        + (
            " (--quick: tiny model, XLA optimizations reduced; a smoke test, not a measurement)"
            if result.get("quick")
            else ""
        ),
        "",
        "| variant | step ×bare median [p25, p75] | update-only ×bare | compile ×bare (step / update) "
        "| step temp MiB (Δ bare) | step peak MiB (Δ bare) | update temp MiB (Δ bare) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        compile_text = f"{row['step_compile_ratio']:.2f} / {row['update_compile_ratio']:.2f}"
        if row["same_executable_as"]:
            compile_text = f"= {row['same_executable_as']}"
        lines.append(
            f"| {row['variant']} | {_fmt_ratio(row['step'])} | {_fmt_ratio(row['update'])} | {compile_text} "
            f"| {_fmt_mib(row['step_memory'], bare['step_memory'], 'temp_mib')} "
            f"| {_fmt_mib(row['step_memory'], bare['step_memory'], 'peak_mib')} "
            f"| {_fmt_mib(row['update_memory'], bare['update_memory'], 'temp_mib')} |"
        )
    lines += [f"note: {note}" for note in result["notes"]]
    if result["model"] == "mlp" and result["precision"] == "mixed" and result.get("backend") == "cpu":
        lines.append(
            "note: on XLA:CPU the float16 MLP's weight gradients leave the dot transposed; bare Adam's fusions read "
            "them strided while the checked variants copy them to row-major once, so the checked variants can look "
            "faster than bare here (an XLA:CPU layout artifact, not a property of the scalers)."
        )
    return "\n".join(lines)


FOOTNOTES = """\
Ratios: per round, variant time / bare time in that round; median [p25, p75] over rounds.
Overflow row: the ls.dynamic executables, fed so that every step is skipped (full step: scale = inf,
a fixed point of the backoff; update-only: one inf in the gradients); compile and memory are ls.dynamic's.
Peak = arguments + outputs + temp - aliased (donated) outputs, from compiled.memory_analysis().
optax.apply_if_finite only checks (no loss scale); jmp and flax scale the loss by the same 2^15."""


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20, --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2, --quick 1)")
    parser.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp,transformer")
    parser.add_argument("--precisions", default="f32,mixed", help="comma-separated: f32,mixed")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny models and few rounds: a smoke test")
    size.add_argument("--large", action="store_true", help="~200M-parameter models, for a GPU")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH as JSON")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write each executable's optimized HLO to DIR")
    malloc = parser.add_mutually_exclusive_group()
    malloc.add_argument(
        "--tuned-malloc",
        action="store_true",
        help="run in a subprocess with " + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()),
    )
    malloc.add_argument("--both", action="store_true", help="run with default malloc, then tuned; print both")
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = [p for p in args.precisions.split(",") if p]
    for m in args.models:
        if m not in ("mlp", "transformer"):
            parser.error(f"unknown model {m!r}")
    for p in args.precisions:
        if p not in ("f32", "mixed"):
            parser.error(f"unknown precision {p!r}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def _tuned_in_effect() -> bool:
    return all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items())


def _run_in_subprocess(args: argparse.Namespace, tuned: bool) -> dict[str, Any]:
    """Runs the benchmark in a fresh interpreter, with malloc tuned or at
    glibc's defaults (glibc reads these variables once, at process start),
    and returns that run's results. Its tables print as it goes."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC}
    if tuned:
        env.update(TUNED_MALLOC)
    child_argv = [
        "--rounds", str(args.rounds), "--warmup", str(args.warmup),
        "--models", ",".join(args.models), "--precisions", ",".join(args.precisions),
    ]  # fmt: skip
    if args.quick:
        child_argv.append("--quick")
    if args.large:
        child_argv.append("--large")
    if args.dump_hlo:
        child_argv += ["--dump-hlo", os.path.join(args.dump_hlo, "tuned" if tuned else "default")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        sys.stdout.flush()
        subprocess.run([sys.executable, os.path.abspath(__file__), *child_argv, "--json", path], env=env, check=True)
        with open(path) as f:
            return json.load(f)["runs"][0]


def _run_here(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark in this process, printing each table when it is done."""
    env = environment()
    print(header_line(env), flush=True)
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
    tables = []
    run_start = time.perf_counter()
    for name in args.models:
        for precision in args.precisions:
            start = time.perf_counter()
            result = benchmark_model(
                build_model(name, precision, args.quick, args.large),
                args.rounds,
                args.warmup,
                hlo_dir=args.dump_hlo,
                compiler_options=QUICK_COMPILER_OPTIONS if args.quick else None,
                warm_tracing=not args.quick,
            )
            result["quick"] = args.quick
            result["wall_s"] = time.perf_counter() - start
            tables.append(result)
            print("\n" + format_table(result) + f"\n({result['wall_s']:.0f} s)", flush=True)
    wall_s = time.perf_counter() - run_start
    print(f"\n{FOOTNOTES}\nwall time {wall_s:.0f} s", flush=True)
    return {"environment": env, "header": header_line(env), "tables": tables, "wall_s": wall_s}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"runs": [run, ...]}``, one run per
    malloc setting, each with its environment and one table per
    model/precision (rows of ratio statistics, compile times and memory)."""
    args = parse_args(argv)
    if args.both:
        runs = []
        for tuned in (False, True):
            print(f"\n## malloc: {'tuned' if tuned else 'glibc defaults'}\n", flush=True)
            runs.append(_run_in_subprocess(args, tuned))
    elif args.tuned_malloc and not _tuned_in_effect():
        runs = [_run_in_subprocess(args, tuned=True)]
    else:
        runs = [_run_here(args)]
    results = {"argv": list(argv) if argv is not None else sys.argv[1:], "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

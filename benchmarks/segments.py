#!/usr/bin/env python
"""Per-segment loss scaling against one global scale, on three float16
workloads whose backward pass spans more binades than float16 holds.

Workloads (float32 params, float16 forward and backward, float32 loss;
boundaries ``ls.segment`` placed as the guide says):

* ``deep sigmoid MLP``: 24 sigmoid layers of width 64 (weights drawn with
  gain 2), no normalisation, a synthetic 4-class task drawn from a fixed
  random teacher network. The sigmoid's derivative (at most 1/4) shrinks
  the cotangents a binade or more a layer, the textbook vanishing
  gradient: the first layers' lie ~40 binades below the head's. A
  boundary after every second layer.
* ``char RNN, 256 steps``: a tanh recurrent network (hidden 64) reads 256
  bytes of Python standard-library source and predicts the next byte, the
  loss on the last step only; the sequence is 16 chunks of 16 steps, a
  ``lax.scan`` each, with a boundary of its own on the carry before each
  chunk. Cotangents shrink with every step further back, not at the same
  rate in every chunk.
* ``bag-of-bytes classifier``: which of four standard-library modules an
  8192-byte snippet comes from, in a muP-style parametrisation: byte
  embeddings initialised with std 2**13 under an input multiplier of
  2**-24, averaged over the snippet, under a two-layer head. Each byte's
  cotangent is the pooled one over 8192 and times 2**-24: ~45 binades below
  the head's. A boundary on the embedded bytes, below the average.

Runs, with the same initialization and batches: ``float32``; ``float16
unscaled`` (no scale, no check); ``ls.dynamic``; ``ls.predictive`` with
measured peaks (``value_grad_and_peak(every=16)``, ``initial_scale=1``);
``per-segment`` (``ls.predictive(segments=...)``, the same measurement).
Columns: the largest fraction of cotangent elements flushed to zero in any
segment (elements that are 0 in float16 but not in the float32 pass of the
same params and batch, from ``ls.range_report(..., segments=...)`` at the
run's final scales, on an evaluation batch), which segment that is, skipped
steps, the final evaluation loss (float32, on held-out batches) and its gap
to float32's, the accuracy, and the train step's time against
``ls.dynamic``'s (jitted, interleaved rounds after training; paired
medians).

Usage::

    python benchmarks/segments.py --out        # the measurement
    python benchmarks/segments.py --quick      # a smoke test, seconds

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, provenance, tables, timing  # noqa: E402

import loss_scale as ls  # noqa: E402

RUNS = ("float32", "float16 unscaled", "ls.dynamic", "ls.predictive + peak", "per-segment")
EVERY = 16
LEARNING_RATE = 1e-3


class Workload(NamedTuple):
    """A model, its data and its boundaries.

    ``loss_fn(params, batch, dtype, marked)`` returns the float32 loss of
    the model computed in ``dtype``, with its boundaries when ``marked``;
    ``batches(step)`` the training batch of a step; ``eval_batches`` the
    held-out ones; ``accuracy(params, batch)`` the fraction classified
    right, or ``None``."""

    name: str
    description: str
    params: Any
    loss_fn: Callable[..., jax.Array]
    batches: Callable[[int], Any]
    eval_batches: list
    segments: tuple[str, ...]
    accuracy: Callable[[Any, Any], jax.Array] | None


def _dense(rng: np.random.Generator, n_in: int, n_out: int, gain: float = 1.0) -> dict:
    w = rng.standard_normal((n_in, n_out)).astype(np.float32) * np.float32(gain / np.sqrt(n_in))
    return {"w": jnp.asarray(w), "b": jnp.zeros((n_out,), jnp.float32)}


def _apply(layer: dict, x: jax.Array, dtype: Any) -> jax.Array:
    return x @ layer["w"].astype(dtype) + layer["b"].astype(dtype)[None, :]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def _classifier(
    name: str,
    description: str,
    params: Any,
    logits: Callable[..., jax.Array],
    data: Callable[[int, int], tuple[jax.Array, jax.Array]],
    batch: int,
    segments: tuple[str, ...],
) -> Workload:
    """A classification workload: cross-entropy of ``logits(params, inputs,
    dtype, marked)`` against the labels of ``data(seed, n)``; training batch
    ``k`` from seed ``1000 + k``, two held-out batches from seeds 0 and 1."""

    def loss_fn(params, batch, dtype=jnp.float16, marked=True):
        return _cross_entropy(logits(params, batch[0], dtype, marked), batch[1])

    def accuracy(params, batch):
        return jnp.mean(jnp.argmax(logits(params, batch[0], jnp.float32, False), axis=-1) == batch[1])

    return Workload(
        name,
        description,
        params,
        loss_fn,
        lambda step: data(1000 + step, batch),
        [data(k, batch) for k in range(2)],
        segments,
        accuracy,
    )


# -- deep sigmoid MLP ---------------------------------------------------------


def deep_mlp(quick: bool) -> Workload:
    depth, width, classes, batch = (4, 16, 4, 32) if quick else (24, 64, 4, 128)
    rng = np.random.default_rng(0)
    layers = [_dense(rng, width, width, gain=2.0) for _ in range(depth)]
    params = {"layers": layers, "head": _dense(rng, width, classes)}
    teacher = [rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width) for _ in range(2)]
    teacher_out = rng.standard_normal((width, classes)).astype(np.float32)
    segments = tuple(f"layers{k:02d}" for k in range(1, depth, 2))

    def data(seed: int, n: int):
        x = np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)
        h = np.tanh(np.tanh(x @ teacher[0]) @ teacher[1])
        return jnp.asarray(x), jnp.asarray(np.argmax(h @ teacher_out, axis=1).astype(np.int32))

    def logits(params, x, dtype, marked):
        h = x.astype(dtype)
        for k, layer in enumerate(params["layers"]):
            h = jax.nn.sigmoid(_apply(layer, h, dtype))
            if marked and f"layers{k:02d}" in segments:
                h = ls.segment(h, f"layers{k:02d}")
        return _apply(params["head"], h, dtype)

    return _classifier(
        "deep sigmoid MLP",
        f"{depth} sigmoid layers of width {width}, no normalisation, {classes} classes from a random teacher, "
        f"batch {batch}",
        params,
        logits,
        data,
        batch,
        segments,
    )


# -- char RNN -----------------------------------------------------------------


def _ascii_bytes(path: pathlib.Path) -> np.ndarray:
    """The ASCII bytes of a file, as uint8 (other bytes dropped)."""
    data = np.frombuffer(path.read_bytes(), np.uint8)
    return data[data < 128]


def stdlib_bytes(limit: int) -> np.ndarray:
    """ASCII bytes of the running interpreter's standard-library sources
    (sorted top-level modules), at most ``limit`` of them."""
    chunks, size = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_path("stdlib")).glob("*.py")):
        data = _ascii_bytes(path)
        chunks.append(data)
        size += data.size
        if size >= limit:
            break
    return np.concatenate(chunks)[:limit]


# The recurrent matrix: orthogonal times RNN_GAIN; the byte embeddings'
# std. The cotangents shrink by about RNN_GAIN * tanh' a step.
RNN_GAIN, RNN_EMBED_STD = 0.85, 0.1


def char_rnn(quick: bool) -> Workload:
    chunks, steps, hidden, batch = (4, 4, 16, 8) if quick else (16, 16, 64, 32)
    length = chunks * steps
    text = stdlib_bytes(200_000 if not quick else 20_000)
    rng = np.random.default_rng(0)
    params = {
        "embed": jnp.asarray(rng.standard_normal((128, hidden)).astype(np.float32) * np.float32(RNN_EMBED_STD)),
        "recurrent": jnp.asarray(
            np.linalg.qr(rng.standard_normal((hidden, hidden)))[0].astype(np.float32) * np.float32(RNN_GAIN)
        ),
        "bias": jnp.zeros((hidden,), jnp.float32),
        "head": _dense(rng, hidden, 128),
    }

    def data(seed: int, n: int):
        starts = np.random.default_rng(seed).integers(0, text.size - length - 1, n)
        windows = np.stack([text[s : s + length + 1] for s in starts]).astype(np.int32)
        return jnp.asarray(windows[:, :length]), jnp.asarray(windows[:, length])

    segments = tuple(f"chunk{c:02d}" for c in range(chunks))

    def logits(params, tokens, dtype, marked):
        recurrent, bias = params["recurrent"], params["bias"]

        def step(h, token):
            x = params["embed"][token].astype(dtype)
            return jnp.tanh(h @ recurrent.astype(dtype) + x + bias.astype(dtype)[None, :]), None

        # A scan per chunk, a boundary of its own on the carry before each:
        # each chunk's cotangents get their own factor (the decay is not
        # the same from chunk to chunk).
        per_chunk = tokens.T.reshape(chunks, steps, tokens.shape[0])
        h = jnp.zeros((tokens.shape[0], hidden), dtype)
        for c in range(chunks):
            if marked:
                h = ls.segment(h, segments[c])
            h, _ = jax.lax.scan(step, h, per_chunk[c])
        return _apply(params["head"], h, dtype)

    return _classifier(
        f"char RNN, {length} steps",
        f"tanh RNN, hidden {hidden}, {length} bytes of stdlib source -> the next byte (loss on the last step), "
        f"{chunks} chunks of {steps} steps (a boundary each), batch {batch}",
        params,
        logits,
        data,
        batch,
        segments,
    )


# -- bag-of-bytes classifier ----------------------------------------------------

MODULES = ("argparse", "json/decoder", "typing", "collections/__init__")


def bag_of_bytes(quick: bool) -> Workload:
    length, dim, batch = (64, 16, 16) if quick else (8192, 32, 16)
    stdlib = pathlib.Path(sysconfig.get_path("stdlib"))
    texts = [_ascii_bytes(stdlib / f"{module}.py") for module in MODULES]
    rng = np.random.default_rng(0)
    # muP-style: a large embedding initialisation under a small input multiplier.
    init_std, input_multiplier = 2.0**13, 2.0**-24
    params = {
        "embed": jnp.asarray(rng.standard_normal((128, dim)).astype(np.float32) * np.float32(init_std)),
        "hidden": _dense(rng, dim, dim),
        "out": _dense(rng, dim, len(MODULES)),
    }

    def data(seed: int, n: int):
        r = np.random.default_rng(seed)
        labels = r.integers(0, len(MODULES), n)
        rows = []
        for label in labels:
            text = np.resize(texts[label], max(texts[label].size, length + 1))
            start = r.integers(0, text.size - length)
            rows.append(text[start : start + length])
        return jnp.asarray(np.stack(rows).astype(np.int32)), jnp.asarray(labels.astype(np.int32))

    def logits(params, tokens, dtype, marked):
        embedded = params["embed"].astype(dtype)[tokens] * jnp.asarray(input_multiplier, dtype)
        if marked:
            embedded = ls.segment(embedded, "embed")
        pooled = jnp.mean(embedded, axis=1)
        h = jnp.tanh(_apply(params["hidden"], pooled * jnp.asarray(2.0**10, dtype), dtype))
        return _apply(params["out"], h, dtype)

    return _classifier(
        "bag-of-bytes classifier",
        f"which of {len(MODULES)} stdlib modules a {length}-byte snippet comes from: byte embeddings (dim {dim}, "
        f"init std 2**13) x 2**-24, averaged, under a 2-layer head, batch {batch}",
        params,
        logits,
        data,
        batch,
        ("embed",),
    )


WORKLOADS = {"deep": deep_mlp, "rnn": char_rnn, "bag": bag_of_bytes}


# -- the runs -------------------------------------------------------------------


def make_run(name: str, workload: Workload) -> tuple[optax.GradientTransformation, Callable]:
    """The optimizer and jitted train step ``(params, state, batch) ->
    (params, state, loss)`` of a run."""
    adam = optax.adam(LEARNING_RATE)
    loss_fn = workload.loss_fn
    if name in ("float32", "float16 unscaled"):
        dtype = jnp.float32 if name == "float32" else jnp.float16

        def step(params, state, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, dtype, False))(params)
            updates, state = adam.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        return adam, jax.jit(step, donate_argnums=(0, 1))
    if name == "ls.dynamic":
        tx = ls.dynamic(adam)

        def step(params, state, batch):
            loss, grads = ls.value_and_grad(lambda p, b: loss_fn(p, b, jnp.float16, False))(state, params, batch)
            params, state = ls.apply_gradients(tx, grads, state, params, value=loss)
            return params, state, loss

        return tx, jax.jit(step, donate_argnums=(0, 1))
    segments = workload.segments if name == "per-segment" else None
    marked = segments is not None
    tx = ls.predictive(adam, initial_scale=1.0, segments=segments)
    measure = ls.value_grad_and_peak(lambda p, b: loss_fn(p, b, jnp.float16, marked), every=EVERY)

    def step(params, state, batch):
        loss, grads, peak = measure(state, params, batch)
        params, state = ls.apply_gradients(tx, grads, state, params, value=loss, backward_peak=peak)
        return params, state, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))


def flushed_by_segment(workload: Workload, params: Any, run: str, state: Any) -> dict[str, float]:
    """Per segment, the fraction of cotangent elements that are 0 in the
    run's float16 backward pass but not in float32's (same params and
    evaluation batch), at the run's final scales."""
    batch = workload.eval_batches[0]
    names = workload.segments
    if run == "float32":
        return {}
    if run == "float16 unscaled":
        scale, exponents = 1.0, dict.fromkeys(names, 0)
    else:
        found = ls.find_state(state)
        scale = float(found.scale)
        exponents = found.segments.exponents() if run == "per-segment" else {}
        exponents = {n: exponents.get(n, 0) for n in names}

    def zeros(dtype):
        report = ls.range_report(
            lambda p, b: workload.loss_fn(p, b, dtype, True), params, batch, scale=scale, segments=exponents
        )
        return {row.name: row.backward_zero for row in report.segments}

    half = zeros(jnp.float16)
    single = zeros(jnp.float32)
    return {name: max(0.0, half[name] - single.get(name, 0.0)) for name in half}


def evaluate(workload: Workload, params: Any) -> tuple[float, float | None]:
    losses = [float(workload.loss_fn(params, b, jnp.float32, False)) for b in workload.eval_batches]
    accuracy = None
    if workload.accuracy is not None:
        accuracy = float(np.mean([float(workload.accuracy(params, b)) for b in workload.eval_batches]))
    return float(np.mean(losses)), accuracy


def benchmark_workload(workload: Workload, steps: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    steppers = {}
    for run in RUNS:
        tx, step = make_run(run, workload)
        params = jax.tree.map(jnp.copy, workload.params)
        state = tx.init(params)
        start = time.perf_counter()
        losses = []
        for i in range(steps):
            params, state, loss = step(params, state, workload.batches(i))
            losses.append(float(loss))
        train_s = time.perf_counter() - start
        final_loss, accuracy = evaluate(workload, params)
        skipped = int(ls.find_state(state).skipped_steps) if run not in ("float32", "float16 unscaled") else None
        flushed = flushed_by_segment(workload, params, run, state)
        worst = max(flushed.items(), key=lambda item: item[1]) if flushed else (None, 0.0)
        results[run] = {
            "final_loss": final_loss,
            "accuracy": accuracy,
            "skipped_steps": skipped,
            "flushed": flushed,
            "worst_segment": worst[0],
            "worst_flushed": worst[1],
            "train_s": train_s,
            "nonfinite_losses": int(np.sum(~np.isfinite(losses))),
            "final_scale": float(ls.get_scale(state)) if run not in ("float32", "float16 unscaled") else None,
            "exponents": (ls.find_state(state).segments.exponents() if run == "per-segment" else None),
        }
        steppers[run] = (step, params, state)
    # Step time against ls.dynamic: interleaved rounds of a few steps each.
    batch = workload.batches(0)
    states = {run: (p, s) for run, (_, p, s) in steppers.items()}

    def call(run: str) -> None:
        step = steppers[run][0]
        p, s = states[run]
        for _ in range(4):
            p, s, loss = step(p, s, batch)
        jax.block_until_ready(loss)
        states[run] = (p, s)

    times = timing.round_robin(call, list(RUNS), rounds, warmup=1)
    for run in RUNS:
        results[run]["step_vs_dynamic"] = timing.ratio_stats(times[run], times["ls.dynamic"])
        results[run]["loss_gap"] = results[run]["final_loss"] / results["float32"]["final_loss"] - 1.0
    return {"workload": workload.name, "description": workload.description, "steps": steps, "runs": results}


def format_table(result: dict[str, Any]) -> str:
    headers = [
        "run",
        "most flushed segment: fraction",
        "skipped steps",
        "final loss (gap to float32)",
        "accuracy",
        "step ×ls.dynamic [95% CI]",
    ]
    rows = []
    for run, r in result["runs"].items():
        flushed = "—" if run == "float32" else f"{r['worst_segment']}: {r['worst_flushed']:.1%}"
        loss = f"{r['final_loss']:.4f}" + ("" if run == "float32" else f" ({r['loss_gap']:+.1%})")
        if r["nonfinite_losses"]:
            loss += f", {r['nonfinite_losses']} non-finite losses"
        rows.append(
            [
                run,
                flushed,
                "—" if r["skipped_steps"] is None else str(r["skipped_steps"]),
                loss,
                "—" if r["accuracy"] is None else f"{r['accuracy']:.3f}",
                tables.ratio(r["step_vs_dynamic"]),
            ]
        )
    exponents = result["runs"]["per-segment"]["exponents"]
    lines = [
        f"### {result['workload']}: {result['description']}; {result['steps']} steps",
        "",
        tables.markdown(headers, rows),
        "",
        "per-segment exponents at the end: " + ", ".join(f"{n} {e}" for n, e in sorted(exponents.items())),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 600; --quick: 20)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 15; --quick: 2)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke test")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH as JSON")
    cli.add_out(parser, "segments")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (20 if args.quick else 600)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 15)
    args.workloads = cli.split(args.workloads)
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = provenance.environment(__file__, argv)
    header = provenance.header(env)
    print(header, flush=True)
    results = []
    start = time.perf_counter()
    for key in args.workloads:
        result = benchmark_workload(WORKLOADS[key](args.quick), args.steps, args.rounds)
        results.append(result)
        print("\n" + format_table(result), flush=True)
    footnote = (
        "\nflushed: elements 0 in the run's float16 backward pass and not in float32's, same params and evaluation "
        "batch, at the run's final scales (ls.range_report(..., segments=...)); float16 unscaled: scale 1. Final "
        "loss: float32 evaluation on held-out batches. Step time: the jitted train step (every 16th step measures "
        "for the predictive runs), paired medians of interleaved rounds of 4 steps."
        f"\nwall time {time.perf_counter() - start:.0f} s"
    )
    print(footnote, flush=True)
    output = {"argv": list(argv) if argv is not None else sys.argv[1:], "environment": env, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output, f, indent=1)
    if args.out is not None:
        report = tables.Report()
        report.parts = [header, *("\n" + format_table(r) for r in results), footnote]
        report.save(args.out or tables.default_out("segments", jax.default_backend()))
    return output


if __name__ == "__main__":
    timing.fresh_compiles()
    main()

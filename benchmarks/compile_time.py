#!/usr/bin/env python
"""Compile time of the optimizer update against the number of parameter leaves.

For trees of ``--leaves`` parameter leaves (alternating ``[w, w]`` matrices
and ``[w]`` vectors, float32), this jits the update alone, ``tx.update`` +
``optax.apply_updates`` (``--fused``: ``ls.apply_gradients``), with params and
state donated, for each optimizer (SGD, Adam) wrapped by each variant:

* ``bare``: the optimizer itself, the baseline;
* ``ls``: ``loss_scale.dynamic(opt)`` with its defaults;
* ``ls-underflow``, ``ls-grad-norm``, ``ls-locate``: the same with
  ``track_underflow=True``, ``track_grad_norm=True``, ``locate_overflows=True``;
* ``apply-if-finite``: ``optax.apply_if_finite(opt, 5)``;

and reports, separately, the seconds of tracing + lowering (Python and JAX:
building the jaxpr and the StableHLO) and of compiling (XLA), each the median
over ``--repeats`` compiles and as a ratio to the bare optimizer's. Every
variant is traced once, untimed, before the timed compiles, so that what JAX
caches across traces is not charged to whichever compiles first; the timed
repeats run interleaved, every variant once per repeat.

With ``--model transformer --size large`` it times instead one model's
whole train step and its update alone (``_harness/models.py``, the
variants of ``_harness/peers.py``: bare Adam, ``ls.dynamic``,
``optax.apply_if_finite``). With ``--target h100`` (``h200``, ``b200``,
``a100``, ``t4``) every program is compiled for that GPU, deviceless, from
shapes alone (``_harness/gpu.py``; the CUDA plugin of jax's version must be
installed): XLA:GPU's compile time, measured on a machine without a GPU.

Usage::

    python benchmarks/compile_time.py --out            # the measurement (~15-20 min on 2 CPU cores)
    python benchmarks/compile_time.py --target h100 --model transformer --size large --repeats 1
    python benchmarks/compile_time.py --leaves 10,100 --optimizers sgd --repeats 1
    python benchmarks/compile_time.py --quick          # a smoke test, seconds

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import gpu  # noqa: E402

if __name__ == "__main__" and any(a == "--target" or a.startswith("--target=") for a in sys.argv):
    gpu.configure_environment()  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _harness import cli, models, peers, provenance, tables, timing  # noqa: E402

import loss_scale as ls  # noqa: E402

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-3),
    "adam": lambda: optax.adam(1e-3),
}
# key -> (row label, wraps the inner optimizer)
VARIANTS: dict[str, tuple[str, Callable[[optax.GradientTransformation], optax.GradientTransformation]]] = {
    "bare": ("bare", lambda inner: inner),
    "ls": ("ls.dynamic", lambda inner: ls.dynamic(inner)),
    "ls-underflow": ("ls.dynamic track_underflow", lambda inner: ls.dynamic(inner, track_underflow=True)),
    "ls-grad-norm": ("ls.dynamic track_grad_norm", lambda inner: ls.dynamic(inner, track_grad_norm=True)),
    "ls-locate": ("ls.dynamic locate_overflows", lambda inner: ls.dynamic(inner, locate_overflows=True)),
    "apply-if-finite": ("optax.apply_if_finite", lambda inner: optax.apply_if_finite(inner, 5)),
}
HEADERS = (
    "leaves", "optimizer", "variant", "trace+lower s", "trace+lower ×bare", "compile s", "compile ×bare", "total s",
    "total ×bare",
)  # fmt: skip


def make_params(n_leaves: int, width: int) -> dict[str, jax.Array]:
    """``n_leaves`` float32 leaves, like a network's: even leaves ``[width,
    width]`` weights, odd leaves ``[width]`` biases."""
    shapes = [(width, width) if i % 2 == 0 else (width,) for i in range(n_leaves)]
    return {f"p{i:04d}": jnp.full(shape, 0.01 * (i + 1), jnp.float32) for i, shape in enumerate(shapes)}


def update_fn(tx: optax.GradientTransformation, fused: bool) -> Callable:
    """``(params, opt_state, grads) -> (params, opt_state)``."""

    def update(params, opt_state, grads):
        if fused:
            return ls.apply_gradients(tx, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def measure(
    leaves: Sequence[int],
    optimizers: Sequence[str],
    variants: Sequence[str],
    repeats: int,
    width: int,
    fused: bool,
    compiler_options: dict[str, Any] | None,
    target: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (leaf count, optimizer, variant): the median seconds of
    each phase over ``repeats`` fresh compiles, and the ratios to bare;
    compiled for this machine's backend, or for GPU ``target``."""
    cases = [(opt, key) for opt in optimizers for key in variants]

    def compile_once(n: int, opt: str, key: str, trace_only: bool = False) -> timing.CompileTimes | None:
        # A fresh transformation and a fresh function every time: nothing of
        # an earlier compile can be reused.
        tx = VARIANTS[key][1](OPTIMIZERS[opt]())
        params = make_params(n, width)
        args = (params, tx.init(params), params)
        if target is not None:
            args = gpu.specs(args, target)
        if trace_only:
            jax.jit(update_fn(tx, fused)).trace(*args)
            return None
        return timing.compile_timed(update_fn(tx, fused), args, (0, 1), compiler_options)[1]

    for opt, key in cases:
        compile_once(min(leaves), opt, key, trace_only=True)
    rows = []
    for n in leaves:
        samples: dict[tuple[str, str], list[timing.CompileTimes]] = {case: [] for case in cases}
        for _ in range(repeats):
            for case in cases:
                samples[case].append(compile_once(n, *case))
        for opt, key in cases:
            got = samples[opt, key]
            rows.append({
                "leaves": n,
                "optimizer": opt,
                "variant": VARIANTS[key][0],
                "key": key,
                "trace_lower_s": statistics.median(t.trace_lower_s for t in got),
                "compile_s": statistics.median(t.compile_s for t in got),
                "total_s": statistics.median(t.total_s for t in got),
                "samples": [vars(t) for t in got],
            })  # fmt: skip
        for row in rows[-len(cases) :]:
            bare = next(r for r in rows[-len(cases) :] if r["optimizer"] == row["optimizer"] and r["key"] == "bare")
            for phase in ("trace_lower_s", "compile_s", "total_s"):
                row[phase.replace("_s", "_ratio")] = row[phase] / bare[phase]
    return rows


MODEL_VARIANTS = ("bare", "ls", "apply-if-finite")


def measure_model(
    name: str, precision: str, size: str, variant_keys: Sequence[str], repeats: int, target: str | None
) -> list[dict[str, Any]]:
    """One row per (kind, variant) of model ``name``: the whole train step
    and the update alone (params and state donated), the median seconds of
    each phase over ``repeats`` fresh compiles, and the ratios to bare."""
    model = models.build(name, precision, size) if target is None else models.build_abstract(name, precision, size)
    variants, _ = peers.build(list(variant_keys), {peers.PYTREE: model})
    variants = [v for v in variants if v.family == peers.PYTREE and v.same_as is None]
    grads = jax.eval_shape(jax.grad(model.loss_fn), model.params, model.batch)
    cases = []
    for v in variants:
        state, extra = jax.eval_shape(v.init, model.params)
        for kind, fn, last in (("step", v.train_step, model.batch), ("update", v.update, grads)):
            args = (model.params, state, extra, last)
            cases.append((kind, v.name, fn, gpu.specs(args, target) if target is not None else args))
    samples: dict[tuple[str, str], list[timing.CompileTimes]] = {(k, n): [] for k, n, _, _ in cases}
    for _ in range(repeats):
        for kind, variant, fn, args in cases:
            samples[kind, variant].append(timing.compile_timed(fn, args, (0, 1, 2))[1])
    rows = []
    for (kind, variant), got in samples.items():
        rows.append({
            "leaves": len(jax.tree.leaves(model.params)),
            "optimizer": f"adam, {kind}",
            "variant": variant,
            "key": variant,
            "kind": kind,
            "trace_lower_s": statistics.median(t.trace_lower_s for t in got),
            "compile_s": statistics.median(t.compile_s for t in got),
            "total_s": statistics.median(t.total_s for t in got),
            "samples": [vars(t) for t in got],
        })  # fmt: skip
    for row in rows:
        bare = next(r for r in rows if r["kind"] == row["kind"] and r["variant"] == peers.BARE)
        for phase in ("trace_lower_s", "compile_s", "total_s"):
            row[phase.replace("_s", "_ratio")] = row[phase] / bare[phase]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        [r["leaves"], r["optimizer"], r["variant"],
         tables.seconds(r["trace_lower_s"]), tables.times(r["trace_lower_ratio"]),
         tables.seconds(r["compile_s"]), tables.times(r["compile_ratio"]),
         tables.seconds(r["total_s"]), tables.times(r["total_ratio"])]
        for r in rows
    ]  # fmt: skip
    return tables.markdown(HEADERS, cells)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--leaves", default=None, help="comma-separated leaf counts (default: 10,100,1000; --quick: 4,16)"
    )
    parser.add_argument("--optimizers", default="sgd,adam", help="comma-separated: " + ",".join(OPTIMIZERS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; bare is always included")
    parser.add_argument(
        "--repeats", type=int, default=None, help="compiles per case, median reported (default: 3; --quick: 1)"
    )
    parser.add_argument("--width", type=int, default=32, help="leaf size: [width, width] and [width] leaves")
    parser.add_argument("--fused", action="store_true", help="time ls.apply_gradients instead of tx.update")
    parser.add_argument("--quick", action="store_true", help="few leaves, one repeat, fast compiles: a smoke test")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH as JSON")
    parser.add_argument("--target", choices=gpu.TARGETS, help="compile for this GPU, deviceless")
    parser.add_argument("--model", choices=models.MODELS, help="time this model's step and update instead")
    parser.add_argument("--size", default="default", choices=models.SIZES, help="the model's size (with --model)")
    parser.add_argument("--precision", default="mixed", choices=models.PRECISIONS, help="the model's (with --model)")
    cli.add_out(parser, "compile_time")
    args = parser.parse_args(argv)
    args.leaves = [int(n) for n in cli.split(args.leaves or ("4,16" if args.quick else "10,100,1000"))]
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.optimizers = cli.split(args.optimizers)
    args.variants = ["bare", *(v for v in cli.split(args.variants) if v != "bare")]
    for o in args.optimizers:
        if o not in OPTIMIZERS:
            parser.error(f"unknown optimizer {o!r}; choose from {', '.join(OPTIMIZERS)}")
    for v in args.variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.repeats < 1 or args.width < 1 or not args.leaves or min(args.leaves) < 1:
        parser.error("--repeats, --width and every leaf count must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.target is not None:
        gpu.require()
    env = provenance.environment(__file__, argv)
    report = tables.Report()
    report.print(provenance.header(env))
    if args.target is not None:
        report.print(f"compiled for {gpu.device_kind(args.target)} (--target {args.target}), deviceless")
    start = time.perf_counter()
    if args.model is not None:
        rows = measure_model(args.model, args.precision, args.size, MODEL_VARIANTS, args.repeats, args.target)
        model = models.build_abstract(args.model, args.precision, args.size)
        title = f"Compile time of {model.description} ({args.precision}): the step and the update"
    else:
        rows = measure(
            args.leaves,
            args.optimizers,
            args.variants,
            args.repeats,
            args.width,
            args.fused,
            timing.quick_compiler_options() if args.quick else None,
            args.target,
        )
        step = "ls.apply_gradients" if args.fused else "tx.update + optax.apply_updates"
        title = (
            f"Optimizer update compile time ({step}), leaves alternating [{args.width}, {args.width}] and "
            f"[{args.width}] float32; median of {args.repeats} compile(s)"
            + (" (quick: XLA optimizations reduced; a smoke test, not a measurement)" if args.quick else "")
        )
    wall_s = time.perf_counter() - start
    report.print(f"\n### {title}\n")
    report.print(format_table(rows))
    report.print(
        "\ntrace+lower: jax.jit(f).trace(...).lower() (Python, JAX); compile: .compile() (XLA). "
        "×bare: the same optimizer unwrapped, same leaves."
        f"\nwall time {wall_s:.0f} s"
    )
    results = {"argv": list(argv) if argv is not None else sys.argv[1:], "environment": env, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.out is not None:
        report.save(args.out or tables.default_out("compile_time", args.target or env["backend"]))
    return results


if __name__ == "__main__":
    timing.fresh_compiles()
    main()

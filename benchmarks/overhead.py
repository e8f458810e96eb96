#!/usr/bin/env python
"""Per-step overhead of loss scaling: loss_scale's paths against the peers.

For a ~21M-parameter MLP, a ~10M-parameter causal transformer LM and a
316-parameter MLP (``tiny``: the bookkeeping's own cost), each in float32
and in "mixed" precision (float32 params, float16 compute, float32
loss), this times Adam trained by every variant of ``_harness/peers.py``:
bare Adam (the baseline), ``ls.dynamic`` through ``tx.update`` and through
``ls.apply_gradients`` (each also fed so that every step overflows and is
skipped), ``optax.apply_if_finite``, jmp and flax DynamicScale (and, asked
for by name, the flax paths: ``loss_scale.flax.TrainState`` and the NNX
optimizers, ``--variants ls-trainstate,nnx-bare,ls-nnx``); for the MLP
also as an Equinox module: bare Equinox, ``loss_scale.equinox`` and MPX
(``mixed-precision-for-JAX``), in the same rounds, against bare Equinox.

Each variant is timed as a full jitted train step (forward, backward,
update, apply) and as the update alone (given precomputed gradients), with
params and optimizer state donated. Variants run interleaved round-robin, so
every round holds one sample of each under the same machine conditions; each
is reported as the median of its per-round ratio to its baseline, with a 95%
confidence interval from order statistics. Compile time (trace + lower +
compile) and the memory XLA plans (``compiled.memory_analysis()``) sit next
to it.

XLA:CPU timings depend heavily on glibc malloc: ``--tuned-malloc`` reruns the
benchmark in a subprocess with malloc tuned to reuse memory, as accelerator
allocators do; ``--both`` prints both.

Usage::

    python benchmarks/overhead.py --tuned-malloc --rounds 30 --out   # the CPU measurement
    python benchmarks/overhead.py --both --json out.json
    python benchmarks/overhead.py --quick           # tiny models: a smoke test
    python benchmarks/overhead.py --variants ls-fused,mpx --models mlp

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, hlo, models, peers, provenance, tables, timing  # noqa: E402

# Row names that speedup.py and the tests read.
BARE, LS, LS_OVERFLOW, LS_FUSED, LS_FUSED_OVERFLOW = (
    peers.BARE, peers.LS, peers.LS_OVERFLOW, peers.LS_FUSED, peers.LS_FUSED_OVERFLOW,
)  # fmt: skip
KINDS = ("step", "update")


def benchmark_model(
    name: str,
    precision: str,
    size: str,
    variant_keys: Sequence[str],
    rounds: int,
    warmup: int,
    hlo_dir: str | None = None,
    compiler_options: dict[str, Any] | None = None,
    warm_tracing: bool = True,
) -> dict[str, Any]:
    """Compiles, checks and times the variants on one model and precision.

    Args:
      name, precision, size: the model (``models.build``'s arguments).
      variant_keys: ``peers.ALL`` keys.
      rounds: timed round-robin rounds.
      warmup: untimed rounds before them.
      hlo_dir: if given, the optimized HLO of every executable is written there.
      compiler_options: XLA options for every compile.
      warm_tracing: trace every variant once, untimed, before the timed
        compiles, so that helpers JAX caches across traces (jitted
        ``jax.numpy`` internals) are not charged to whichever compiles first.
    """
    wants_equinox = bool(set(peers.resolve(variant_keys)) & set(peers.EQUINOX_KEYS))
    family_models = {
        peers.PYTREE: models.build(name, precision, size),
        peers.EQUINOX: models.build_equinox(name, precision, size) if wants_equinox else None,
    }
    variants, notes = peers.build(variant_keys, family_models)
    family_models = {family: m for family, m in family_models.items() if m is not None}

    feeds, grads = {}, {}
    for family, m in family_models.items():
        g = jax.jit(jax.grad(m.loss_fn)).lower(m.params, m.batch).compile(compiler_options)(m.params, m.batch)
        grads[family] = (g, jax.tree.map(lambda x: x * peers.LOSS_SCALE, g))
    for v in variants:
        unscaled, scaled = grads[v.family]
        feed = scaled if v.grad_scale != 1.0 else unscaled
        feeds[v.name] = peers.poison(feed) if v.overflow else feed

    def call_args(v: peers.Variant, kind: str) -> tuple:
        m = family_models[v.family]
        opt_state, extra = v.init(m.params)
        return m.params, opt_state, extra, m.batch if kind == "step" else feeds[v.name]

    if warm_tracing:
        for v in variants:
            if v.same_as is None:
                jax.jit(v.train_step).trace(*call_args(v, "step"))
                jax.jit(v.update).trace(*call_args(v, "update"))
    compiled: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    compile_s: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    memory: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    for v in variants:
        if v.same_as is not None:
            continue
        for kind, fn in (("step", v.train_step), ("update", v.update)):
            hlo_path = hlo.dump_path(hlo_dir, name, precision, v.name, kind) if hlo_dir else None
            exe, seconds = timing.compile_timed(fn, call_args(v, kind), (0, 1, 2), compiler_options, hlo_path)
            compiled[kind][v.name], compile_s[kind][v.name] = exe, seconds.total_s
            memory[kind][v.name] = timing.memory_mib(exe)
    for v in variants:
        if v.same_as is not None:
            for kind in KINDS:
                compiled[kind][v.name] = compiled[kind][v.same_as]
                compile_s[kind][v.name] = compile_s[kind][v.same_as]
                memory[kind][v.name] = memory[kind][v.same_as]

    peers.check_updates(
        variants,
        lambda v, state, g: compiled["update"][v.name](*state, g),
        {family: m.params for family, m in family_models.items()},
        feeds,
    )

    # A tiny model's step takes microseconds: each sample times many steps.
    steps_per_sample = models.TINY_STEPS_PER_SAMPLE if name == "tiny" else 1
    times: dict[str, dict[str, list[float]]] = {}
    for kind in ("update", "step"):
        states, inputs = {}, {}
        for v in variants:
            m = family_models[v.family]
            state = (peers.copy(m.params), *peers.copy(v.init(m.params)))
            inputs[v.name] = m.batch if kind == "step" else feeds[v.name]
            if v.overflow and kind == "step":
                state, inputs[v.name] = v.overflow_inputs(state, inputs[v.name])
            states[v.name] = state

        def call(variant: str, kind: str = kind, states: dict = states, inputs: dict = inputs) -> None:
            for _ in range(steps_per_sample):
                out = compiled[kind][variant](*states[variant], inputs[variant])
                states[variant] = tuple(out[:3])
            jax.block_until_ready(out)

        if kind == "step":  # a sample, then check every variant is on the branch it claims
            for v in variants:
                call(v.name)
            peers.check_applied(variants, states)
        per_sample = timing.round_robin(call, [v.name for v in variants], rounds, warmup)
        times[kind] = {k: [t / steps_per_sample for t in ts] for k, ts in per_sample.items()}
        del states

    rows = []
    for v in variants:
        base = v.baseline or v.name
        row: dict[str, Any] = {"variant": v.name, "family": v.family, "baseline": base, "same_executable_as": v.same_as}
        for kind in KINDS:
            row[kind] = timing.ratio_stats(times[kind][v.name], times[kind][base])
            row[f"{kind}_compile_s"] = compile_s[kind][v.name]
            row[f"{kind}_compile_ratio"] = compile_s[kind][v.name] / compile_s[kind][base]
            row[f"{kind}_memory"] = memory[kind][v.name]
            row[f"{kind}_baseline_memory"] = memory[kind][base]
        rows.append(row)
    return {
        "model": name,
        "precision": precision,
        "description": family_models[peers.PYTREE].description,
        "n_params": models.n_params(family_models[peers.PYTREE].params),
        "backend": jax.default_backend(),
        "size": size,
        "rounds": rounds,
        "warmup": warmup,
        "notes": notes,
        "rows": rows,
        "raw_seconds": times,
    }


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], base: str) -> str:
    headers = [
        "variant",
        f"step ×{base} median [95% CI]",
        f"update-only ×{base}",
        f"compile ×{base} (step / update)",
        f"step temp MiB (Δ {base})",
        f"step peak MiB (Δ {base})",
        f"update temp MiB (Δ {base})",
    ]
    cells = []
    for row in rows:
        compile_text = f"{row['step_compile_ratio']:.2f} / {row['update_compile_ratio']:.2f}"
        if row["same_executable_as"]:
            compile_text = f"= {row['same_executable_as']}"
        step_memory, step_base = row["step_memory"], row["step_baseline_memory"]
        cells.append([
            row["variant"],
            tables.ratio(row["step"]),
            tables.ratio(row["update"]),
            compile_text,
            tables.mib(step_memory, step_base, "temp_mib"),
            tables.mib(step_memory, step_base, "peak_mib"),
            tables.mib(row["update_memory"], row["update_baseline_memory"], "temp_mib"),
        ])  # fmt: skip
    return tables.markdown(headers, cells)


def _duration(ms: float) -> str:
    return f"{ms:.2f} ms" if ms >= 1 else f"{ms * 1e3:.1f} µs"


def format_table(result: dict[str, Any]) -> str:
    """The markdown tables of one model and precision: the pytree variants
    against bare Adam, then (if any) the Equinox variants against bare
    Equinox, timed in the same rounds."""
    bare = next(r for r in result["rows"] if r["variant"] == BARE)
    lines = [
        f"### {result['model']} {result['precision']}: {result['description']}",
        "",
        f"bare adam: step {_duration(bare['step']['median_ms'])}, update-only "
        f"{_duration(bare['update']['median_ms'])} (medians); compile step {bare['step_compile_s']:.2f} s; "
        f"{result['rounds']} rounds, "
        f"{result['warmup']} warm-up"
        + (" (quick: tiny model, XLA optimizations reduced; a smoke test, not a measurement)"
           if result.get("size") == "quick" else ""),
        "",
        _table([r for r in result["rows"] if r["family"] == peers.PYTREE], "bare"),
    ]  # fmt: skip
    equinox = [r for r in result["rows"] if r["family"] == peers.EQUINOX]
    if equinox:
        lines += [
            "",
            f"Equinox, the same MLP as an `eqx.Module`, in the same rounds: ratios and Δ to `{peers.EQX_BARE}` "
            f"(whose own row is to `{BARE}`).",
            "",
            _table(equinox, "eqx bare"),
        ]
    lines += [f"note: {note}" for note in result["notes"]]
    if result["model"] == "mlp" and result["precision"] == "mixed" and result.get("backend") == "cpu":
        lines.append(
            "note: on XLA:CPU the float16 MLP's weight gradients leave the dot transposed; bare Adam's fusions read "
            "them a row apart per element, while a variant whose update sits in a conditional (optax.apply_if_finite) "
            "copies them to row-major once, so it can look faster than bare here (an XLA:CPU layout artifact, not a "
            "property of the scalers)."
        )
    if result["model"] == "tiny":
        lines.append(
            f"note: each sample times {models.TINY_STEPS_PER_SAMPLE} steps; at this size a step's time is its "
            "kernels and buffers (on XLA:CPU about 1 µs each), not its arithmetic."
        )
    return "\n".join(lines)


FOOTNOTES = """\
Ratios: per round, variant time / baseline time in that round; the median over rounds and, in brackets, a
distribution-free 95% confidence interval of that median (order statistics; with fewer than 6 rounds, the range).
Overflow rows: the variant's own executables, fed so that every step is skipped (update-only: one inf in the
gradients; full step: ls.dynamic at scale inf, a fixed point of the backoff, and the Equinox rows on a batch
with one inf input); compile and memory are the variant's.
Peak = arguments + outputs + temp - aliased (donated) outputs, from compiled.memory_analysis().
optax.apply_if_finite only checks (no loss scale); jmp, flax and MPX scale the loss by the same 2^15.
MPX: mpx.filter_value_and_grad + mpx.optimizer_update (in float32 the same MPX calls without its float16 cast);
its update-only row is fed the same float32 gradients as the others."""


def render_run(run: dict[str, Any]) -> str:
    """One run (one malloc setting) as printed: header, tables, footnotes."""
    parts = [run["header"]]
    parts += ["\n" + format_table(t) + f"\n({t['wall_s']:.0f} s)" for t in run["tables"]]
    parts.append(f"\n{FOOTNOTES}\nwall time {run['wall_s']:.0f} s")
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 20; --quick: 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default: 2; --quick: 1)")
    parser.add_argument("--models", default="mlp,transformer,tiny", help="comma-separated: " + ",".join(models.MODELS))
    parser.add_argument("--precisions", default="f32,mixed", help="comma-separated: " + ",".join(models.PRECISIONS))
    parser.add_argument(
        "--variants",
        default=",".join(peers.DEFAULT),
        help=f"comma-separated, or 'all' ({','.join(peers.ALL)}); bare Adam is always timed",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny models, few rounds, fast compiles: a smoke test")
    size.add_argument("--large", action="store_true", help="~200M-parameter models, for a GPU")
    size.add_argument(
        "--size",
        choices=models.SIZES,
        help="the models' size (--quick and --large name two; gpu: --large's MLP and a 2-layer transformer of its "
        "width, what a short GPU window compiles)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH as JSON")
    cli.add_out(parser, "overhead")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write each executable's optimized HLO to DIR")
    malloc = parser.add_mutually_exclusive_group()
    malloc.add_argument(
        "--tuned-malloc", action="store_true", help="run in a subprocess with " + timing.malloc_flag_help()
    )
    malloc.add_argument("--both", action="store_true", help="run with default malloc, then tuned; print both")
    args = parser.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "large" if args.large else "default")
    args.quick = args.size == "quick"
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.models = cli.split(args.models)
    args.precisions = cli.split(args.precisions)
    args.variants = list(peers.ALL) if args.variants == "all" else cli.split(args.variants)
    for m in args.models:
        if m not in models.MODELS:
            parser.error(f"unknown model {m!r}")
    for p in args.precisions:
        if p not in models.PRECISIONS:
            parser.error(f"unknown precision {p!r}")
    try:
        peers.resolve(args.variants)
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def _child_argv(args: argparse.Namespace, tuned: bool) -> list[str]:
    argv = [
        "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--models", ",".join(args.models),
        "--precisions", ",".join(args.precisions), "--variants", ",".join(args.variants),
    ]  # fmt: skip
    argv += ["--size", args.size]
    if args.dump_hlo:
        argv += ["--dump-hlo", os.path.join(args.dump_hlo, "tuned" if tuned else "default")]
    return argv


def run_here(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    """The benchmark in this process, printing each table when it is done."""
    env = provenance.environment(__file__, argv)
    header = provenance.header(env)
    print(header, flush=True)
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
    results = []
    run_start = time.perf_counter()
    for name in args.models:
        for precision in args.precisions:
            start = time.perf_counter()
            result = benchmark_model(
                name,
                precision,
                args.size,
                args.variants,
                args.rounds,
                args.warmup,
                hlo_dir=args.dump_hlo,
                compiler_options=timing.quick_compiler_options() if args.quick else None,
                warm_tracing=not args.quick,
            )
            result["wall_s"] = time.perf_counter() - start
            results.append(result)
            print("\n" + format_table(result) + f"\n({result['wall_s']:.0f} s)", flush=True)
    wall_s = time.perf_counter() - run_start
    print(f"\n{FOOTNOTES}\nwall time {wall_s:.0f} s", flush=True)
    return {"environment": env, "header": header, "tables": results, "wall_s": wall_s}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"argv": [...], "runs": [run, ...]}``,
    one run per malloc setting, each with its environment and one table per
    model and precision (rows of ratio statistics, compile times, memory)."""
    args = parse_args(argv)
    if args.both:
        runs = []
        for tuned in (False, True):
            print(f"\n## malloc: {'tuned' if tuned else 'glibc defaults'}\n", flush=True)
            runs += timing.rerun(__file__, _child_argv(args, tuned), tuned)["runs"]
    elif args.tuned_malloc and not timing.tuned_malloc_in_effect():
        runs = timing.rerun(__file__, _child_argv(args, True), tuned=True)["runs"]
    else:
        runs = [run_here(args, argv)]
    results = {"argv": list(argv) if argv is not None else sys.argv[1:], "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.out is not None:
        report = tables.Report()
        report.parts = [render_run(run) for run in runs]
        report.save(args.out or tables.default_out("overhead", runs[0]["tables"][0]["backend"]))
    return results


if __name__ == "__main__":
    timing.fresh_compiles()
    main()

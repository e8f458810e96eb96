#!/usr/bin/env python
"""The training step of a model written in float32 under ``ls.autocast``
against the same model cast by hand and against float32.

For each model (``--models``: the benchmark MLP and transformer LM of
``_harness/models.py``), three versions of one jitted training step
(``ls.value_and_grad`` + ``ls.apply_gradients`` on
``ls.dynamic(optax.adam)``, params and state donated):

* ``float32``: the float32 model;
* ``hand-cast``: the same model cast by hand as jmp and MPX users write it
  (params and inputs cast to float16, layer-norm statistics, softmax and
  loss in float32);
* ``autocast``: ``ls.autocast(float32 model)``, no cast written.

and reports the median step time (interleaved rounds, every version once
per round; ratios paired by round, with their 95% order-statistic CI),
XLA's planned temporary memory, the trace+lower and compile seconds, and
the number of ``convert`` instructions in the optimized HLO.

Usage::

    python benchmarks/autocast.py --out          # the measurement (~5 min on 2 CPU cores)
    python benchmarks/autocast.py --quick        # a smoke test, seconds

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import pathlib
import re
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import loss_scale as ls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, models, provenance, tables, timing  # noqa: E402

VERSIONS = ("float32", "hand-cast", "autocast")


def _loss(model_name: str, version: str, size: str) -> tuple[models.Model, Any]:
    base = models.build(model_name, "f32", size)
    if version == "float32":
        return base, base.loss_fn
    if version == "hand-cast":
        return base, models.build(model_name, "mixed", size).loss_fn
    return base, ls.autocast(base.loss_fn, jnp.float16)


def _step(loss_fn: Any, tx: optax.GradientTransformation) -> Any:
    def step(params, opt_state, batch):
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, batch)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    return step


def _converts(compiled: Any) -> int:
    return len(re.findall(r"= [a-z0-9\[\],{}]* ?convert\(", compiled.as_text()))


def measure(model_name: str, size: str, rounds: int, warmup: int) -> dict[str, Any]:
    tx = ls.dynamic(optax.adam(1e-4))
    compiled: dict[str, Any] = {}
    state: dict[str, Any] = {}
    results: dict[str, Any] = {}
    description = ""
    for version in VERSIONS:
        base, loss_fn = _loss(model_name, version, size)
        description = base.description
        params = jax.tree.map(jnp.copy, base.params)
        opt_state = tx.init(params)
        exe, times = timing.compile_timed(_step(loss_fn, tx), (params, opt_state, base.batch), donate_argnums=(0, 1))
        compiled[version] = exe
        state[version] = [params, opt_state, base.batch]
        results[version] = {
            "trace_lower_s": times.trace_s + times.lower_s,
            "compile_s": times.compile_s,
            "memory": timing.memory_mib(exe),
            "converts": _converts(exe),
        }

    def call(version: str) -> None:
        params, opt_state, batch = state[version]
        params, opt_state, loss = compiled[version](params, opt_state, batch)
        jax.block_until_ready(loss)
        state[version][:2] = [params, opt_state]

    seconds = timing.round_robin(call, VERSIONS, rounds=rounds, warmup=warmup)
    for version in VERSIONS:
        results[version]["median_ms"] = statistics.median(seconds[version]) * 1e3
        results[version]["vs_hand_cast"] = timing.ratio_stats(seconds[version], seconds["hand-cast"])
        results[version]["vs_float32"] = timing.ratio_stats(seconds[version], seconds["float32"])
    return {"description": description, "versions": results}


def table(name: str, measured: dict[str, Any]) -> str:
    versions = measured["versions"]
    hand = versions["hand-cast"]
    rows = []
    for version in VERSIONS:
        r = versions[version]
        rows.append(
            [
                version,
                f"{r['median_ms']:.1f}",
                tables.ratio(r["vs_hand_cast"]),
                tables.ratio(r["vs_float32"]),
                tables.mib(r["memory"], hand["memory"], "temp_mib"),
                f"{r['trace_lower_s']:.2f}",
                f"{r['compile_s']:.2f} ({r['compile_s'] / hand['compile_s']:.2f}x)",
                r["converts"],
            ]
        )
    headers = [
        "version",
        "step ms",
        "vs hand-cast",
        "vs float32",
        "temp MiB (vs hand-cast)",
        "trace+lower s",
        "compile s (vs hand-cast)",
        "converts in HLO",
    ]
    return f"{name}: {measured['description']}\n\n" + tables.markdown(headers, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp, transformer")
    parser.add_argument("--size", default="default", choices=models.SIZES, help="model size (default: default)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default: 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--quick", action="store_true", help="quick size, 3 rounds: a smoke test")
    cli.add_out(parser, "autocast")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.warmup = "quick", 3, 1
    timing.fresh_compiles()
    report = tables.Report()
    env = provenance.environment(__file__, argv)
    report.print(provenance.header(env))
    results: dict[str, Any] = {"environment": env, "models": {}}
    for name in cli.split(args.models):
        measured = measure(name, args.size, args.rounds, args.warmup)
        results["models"][name] = measured
        report.print()
        report.print(table(name, measured))
    if args.out is not None:
        report.save(args.out or tables.default_out("autocast", jax.default_backend()))
    return results


if __name__ == "__main__":
    main()

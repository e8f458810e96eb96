#!/usr/bin/env python
"""The temporary memory a GPU's program plans for the training step of
today's decoder shapes: ``ls.autocast`` of the float32 model against the
same model cast by hand, and against float32.

For each decoder style (``--styles``, ``_harness/decoders.py``: a pre-norm
Llama, a Gemma-3 with post-norms, query/key norms and sliding windows, a
Qwen-3 with query/key norms) and sequence length (``--seqs``), three
versions of the gradient of the loss, compiled for GPU ``--target`` from
shapes alone (deviceless, ``_harness/gpu.py``: nothing is allocated, so
long sequences compile on a small machine):

* ``float32``: the float32 model;
* ``hand-cast``: the model's float16 mode, as a framework's ``dtype=float16``
  layers cast it (a norm's statistics and the loss in float32, the
  attention scores and their softmax in float16);
* ``autocast``: ``ls.autocast(float32 model, jnp.float16)``.

It reports ``compiled.memory_analysis().temp_size_in_bytes`` of each and
the ratio of autocast's to the hand-cast model's, and the megabytes of
the program's top-level buffers shaped like the attention scores
(batch x heads x seq x seq) in float32: the arrays a hand-cast model keeps
in float16.

Usage::

    python benchmarks/autocast_memory.py --out        # H100, seq 512 to 4096 (~3 min on 2 CPU cores)
    python benchmarks/autocast_memory.py --quick      # one style at seq 128: a smoke test

From Python, ``main([...])`` returns the results as a dict.
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import gpu  # noqa: E402

if __name__ == "__main__":
    gpu.configure_environment()  # before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _harness import cli, decoders, models, provenance, tables  # noqa: E402

import loss_scale as ls  # noqa: E402

VERSIONS = ("float32", "hand-cast", "autocast")
MIB = 1 << 20


def decoder_config(seq: int, width: int = 256, layers: int = 2, batch: int = 4) -> dict[str, int]:
    """The decoders' size at sequence length ``seq``: 8 heads sharing 4
    key/value heads, a vocabulary of 1000 (not a multiple of 8 * seq, so
    no logits array counts as a score-sized buffer)."""
    return {
        "vocab": 1000,
        "d_model": width,
        "n_layers": layers,
        "n_heads": 8,
        "n_kv_heads": 4,
        "seq_len": seq,
        "batch_size": batch,
    }


def _losses(style: str, config: dict[str, int]) -> tuple[Any, Any, dict[str, Any]]:
    token = models._ABSTRACT.set(True)  # shapes only: nothing param-sized is drawn
    try:
        f32 = decoders.make_decoder(style, "f32", **config)
        hand = decoders.make_decoder(style, "mixed", **config)
    finally:
        models._ABSTRACT.reset(token)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (f32.params, f32.batch))
    losses = {"float32": f32.loss_fn, "hand-cast": hand.loss_fn, "autocast": ls.autocast(f32.loss_fn, jnp.float16)}
    return f32, shapes, losses


def _score_buffers_mib(text: str, config: dict[str, int]) -> float:
    """MiB of the entry computation's float32 buffers with as many elements
    as the attention scores (batch x heads x seq x seq): its instructions'
    results and the elements of a multi-output fusion's (not a parameter
    or a bitcast, which are views)."""
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}\n")]
    elements = config["batch_size"] * config["n_heads"] * config["seq_len"] ** 2
    total = 0
    for dims in re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} (?!parameter|bitcast)", entry):
        if math.prod(int(d) for d in dims.split(",")) == elements:
            total += 4 * elements
    return total / MIB


def measure(style: str, config: dict[str, int], target: str, versions: tuple[str, ...] = VERSIONS) -> dict[str, Any]:
    model, (params, batch), losses = _losses(style, config)
    rows: dict[str, Any] = {}
    for version in versions:
        compiled = gpu.compile_for(target, jax.value_and_grad(losses[version]), (params, batch))
        rows[version] = {
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / MIB,
            "f32_scores_mib": _score_buffers_mib(compiled.as_text(), config),
        }
    return {"description": model.description, "versions": rows}


def table(results: list[dict[str, Any]]) -> str:
    headers = ["style", "seq", *(f"{v} temp MiB" for v in VERSIONS), "autocast / hand-cast", "f32 score-sized MiB"]
    body = []
    for r in results:
        v = r["versions"]
        body.append(
            [
                r["style"],
                r["seq"],
                *(f"{v[name]['temp_mib']:.1f}" for name in VERSIONS),
                f"{v['autocast']['temp_mib'] / v['hand-cast']['temp_mib']:.2f}x",
                f"{v['autocast']['f32_scores_mib']:.0f} (hand-cast {v['hand-cast']['f32_scores_mib']:.0f})",
            ]
        )
    return tables.markdown(headers, body)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.parser(__doc__)
    parser.add_argument("--target", default="h100", choices=gpu.TARGETS, help="the GPU to compile for")
    parser.add_argument("--styles", default=",".join(decoders.STYLES), help="comma-separated decoder styles")
    parser.add_argument("--seqs", default="512,1024,2048,4096", help="comma-separated sequence lengths")
    parser.add_argument("--width", type=int, default=256, help="d_model")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (gemma3: every sixth global)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--quick", action="store_true", help="llama at seq 128: a smoke test")
    cli.add_out(parser, "autocast_memory")
    args = parser.parse_args(argv)
    gpu.require()
    if args.quick:
        args.styles, args.seqs, args.width = "llama", "128", 64
    report = tables.Report()
    env = provenance.environment(__file__, argv)
    report.print(provenance.header(env))
    report.print(f"compiled for {gpu.device_kind(args.target)} (--target {args.target}), deviceless")
    results = []
    for style in cli.split(args.styles):
        for seq in (int(s) for s in cli.split(args.seqs)):
            config = decoder_config(seq, args.width, args.layers, args.batch)
            measured = measure(style, config, args.target)
            results.append({"style": style, "seq": seq, **measured})
            print(f"{measured['description']}: done", file=sys.stderr, flush=True)
    report.print()
    shape = decoder_config(0, args.width, args.layers, args.batch)
    report.print(
        f"the gradient of the loss (jax.value_and_grad), decoders of width {args.width}, {args.layers} layers, "
        f"{shape['n_heads']} heads ({shape['n_kv_heads']} key/value), vocab {shape['vocab']}, batch {args.batch}"
    )
    report.print()
    report.print(table(results))
    if args.out is not None:
        report.save(args.out or tables.default_out("autocast_memory", args.target))
    return {"environment": env, "results": results}


if __name__ == "__main__":
    main()

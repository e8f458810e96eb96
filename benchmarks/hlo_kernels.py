#!/usr/bin/env python
"""The kernels each loss-scaling path adds to Adam's update, and the bytes
they move, read from the optimized HLO of the compiled programs.

For one model of ``_harness/models.py`` (the MLP by default) in each
precision, every variant of ``_harness/peers.py`` is compiled as
``overhead.py`` times it (params and optimizer state donated), as the
update alone given the gradients and as the full train step, and its
optimized HLO is read (``_harness/hlo.py``): how many kernels run, how many
bytes they read and write, each against bare Adam's, and the kernels that
move a buffer of at least ``--min-mib``. On a GPU every kernel is a launch
and the bytes are HBM traffic; the floor a scaler can reach is one read of
the gradients more than bare Adam (the finite check), everything else
riding in the optimizer's own passes. Nothing is timed: the counts are the
same on every run of the same versions.

With ``--target h100`` (``h200``, ``b200``, ``a100``, ``t4``) every
program is compiled for that GPU on this machine, with no GPU
(``_harness/gpu.py``: the CUDA plugin of jax's version must be installed),
from the models' shapes alone: nothing param-sized is allocated, so the
218M-parameter transformer compiles on a 24 GB machine.

Usage::

    python benchmarks/hlo_kernels.py                       # the default MLP, on this machine's backend
    python benchmarks/hlo_kernels.py --target h100         # the program an H100 would run
    python benchmarks/hlo_kernels.py --size gpu --kinds update,step
    python benchmarks/hlo_kernels.py --dump DIR            # also write every program's HLO to DIR

From Python, ``main([...])`` returns the rows as a list of dicts.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import gpu  # noqa: E402

if __name__ == "__main__" and any(a == "--target" or a.startswith("--target=") for a in sys.argv):
    gpu.configure_environment()  # before jax is imported

import jax  # noqa: E402
from _harness import cli, hlo, models, peers, provenance, tables  # noqa: E402

VARIANTS = (
    "bare", "ls", "ls-fused", "ls-static", "ls-no-op", "ls-bf16", "ls-nnx", "apply-if-finite", "jmp", "flax",
    "eqx-bare", "eqx-ls",
)  # fmt: skip
MIB = 1 << 20


def _compiled_text(fn: Any, args: tuple, target: str | None) -> str:
    if target is not None:
        return gpu.compile_for(target, fn, args, donate_argnums=(0, 1, 2)).as_text()
    return jax.jit(fn, donate_argnums=(0, 1, 2)).lower(*args).compile().as_text()


def measure(
    name: str,
    precision: str,
    size: str,
    variant_keys: Sequence[str],
    kinds: Sequence[str],
    min_mib: float,
    dump: str | None = None,
    target: str | None = None,
) -> list[dict[str, Any]]:
    """One row per variant and kind: kernels, bytes, and against its
    baseline (bare Adam; for an Equinox row, Adam on the same ``eqx.Module``,
    where the model has an Equinox version); compiled for this machine's
    backend, or for GPU ``target`` from shapes."""
    if dump:
        os.makedirs(dump, exist_ok=True)
    keys = [k for k in variant_keys if not k.endswith("overflow")]
    if target is None:
        build, build_equinox = models.build, models.build_equinox
    else:
        build, build_equinox = models.build_abstract, models.build_equinox_abstract
    family_models = {peers.PYTREE: build(name, precision, size)}
    if set(peers.resolve(keys)) & set(peers.EQUINOX_KEYS):
        family_models[peers.EQUINOX] = build_equinox(name, precision, size)
    variants, _ = peers.build(keys, family_models)
    gradients = {}  # family -> (gradients, scaled gradients)
    for family, model in family_models.items():
        if model is None:
            continue
        if target is None:
            grads = jax.jit(jax.grad(model.loss_fn))(model.params, model.batch)
            gradients[family] = grads, jax.tree.map(lambda g: g * peers.LOSS_SCALE, grads)
        else:
            grads = jax.eval_shape(jax.grad(model.loss_fn), model.params, model.batch)
            gradients[family] = grads, grads
    found: dict[tuple[str, str], hlo.Kernels] = {}
    baselines: dict[str, str] = {}
    for v in variants:
        if v.same_as is not None:
            continue
        model = family_models[v.family]
        baselines[v.name] = v.baseline or v.name
        opt_state, extra = v.init(model.params) if target is None else jax.eval_shape(v.init, model.params)
        grads, scaled = gradients[v.family]
        for kind in kinds:
            if kind == "step":
                fn, last = v.train_step, model.batch
            else:
                fn, last = v.update, scaled if v.grad_scale != 1.0 else grads
            text = _compiled_text(fn, (model.params, opt_state, extra, last), target)
            if dump:
                pathlib.Path(hlo.dump_path(dump, name, precision, v.name, kind)).write_text(text)
            found[v.name, kind] = hlo.kernels(text, int(min_mib * MIB))
    rows = []
    for (variant, kind), k in found.items():
        # Against the variant's own baseline: an Equinox row against Adam
        # on the same eqx.Module (which is against the plain pytree's).
        base = found[baselines[variant], kind]
        rows.append(
            {
                "model": name,
                "target": target or jax.default_backend(),
                "precision": precision,
                "variant": variant,
                "baseline": baselines[variant],
                "kind": kind,
                "kernels": k.count,
                "extra_kernels": k.count - base.count,
                "read_mib": k.read_bytes / MIB,
                "written_mib": k.written_bytes / MIB,
                "extra_mib": (k.read_bytes + k.written_bytes - base.read_bytes - base.written_bytes) / MIB,
                "large": [(n, op, r / MIB, w / MIB) for n, op, r, w in k.large],
                "by_opcode": k.by_opcode,
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]], params_mib: float) -> str:
    headers = ["model", "precision", "variant", "kind", "kernels", "vs bare", "read MiB", "written MiB", "vs bare MiB"]
    body = [
        [
            r["model"],
            r["precision"],
            r["variant"],
            r["kind"],
            r["kernels"],
            f"{r['extra_kernels']:+d}",
            f"{r['read_mib']:.1f}",
            f"{r['written_mib']:.1f}",
            f"{r['extra_mib']:+.1f} ({r['extra_mib'] / params_mib:+.2f} P)",
        ]
        for r in rows
    ]
    return tables.markdown(headers, body)


def parse_args(argv: Sequence[str] | None) -> Any:
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default="mlp", help="comma-separated: " + ",".join(models.MODELS))
    parser.add_argument("--precisions", default="mixed,f32", help="comma-separated: " + ",".join(models.PRECISIONS))
    parser.add_argument("--size", default="default", choices=models.SIZES, help="the models' size")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ",".join(peers.ALL))
    parser.add_argument("--kinds", default="update", help="comma-separated: update (given gradients), step (whole)")
    parser.add_argument("--min-mib", type=float, default=1.0, help="list the kernels moving a buffer this large")
    parser.add_argument("--dump", metavar="DIR", help="write every program's optimized HLO to DIR")
    parser.add_argument(
        "--target", choices=gpu.TARGETS, help="compile for this GPU, deviceless (needs the CUDA plugin)"
    )
    cli.add_out(parser, "hlo_kernels")
    args = parser.parse_args(argv)
    args.models, args.precisions = cli.split(args.models), cli.split(args.precisions)
    args.variants, args.kinds = cli.split(args.variants), cli.split(args.kinds)
    unknown = [k for k in args.kinds if k not in ("update", "step")]
    if unknown:
        parser.error(f"unknown --kinds {', '.join(unknown)}; choose from update, step")
    peers.resolve(args.variants)
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.target is not None:
        gpu.require()
    env = provenance.environment("hlo_kernels.py", argv)
    report = tables.Report()
    report.print(provenance.header(env))
    if args.target is not None:
        report.print(f"compiled for {gpu.device_kind(args.target)} (--target {args.target}), deviceless")
    rows = []
    for name in args.models:
        for precision in args.precisions:
            model = models.build_abstract(name, precision, args.size)
            params_mib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params)) / MIB
            found = measure(name, precision, args.size, args.variants, args.kinds, args.min_mib, args.dump, args.target)
            report.print(f"\n{model.description}; P = the params' {params_mib:.1f} MiB\n")
            report.print(format_rows(found, params_mib))
            for r in found:
                if r["variant"] != peers.BARE and r["large"]:
                    moves = ", ".join(f"{op} {rd:.0f}/{wr:.0f}" for _, op, rd, wr in r["large"])
                    report.print(f"\n{r['variant']} {r['kind']}: kernels moving >= {args.min_mib:g} MiB "
                                 f"(read/written MiB): {moves}")  # fmt: skip
            rows += found
    if args.out is not None:
        report.save(args.out or tables.default_out("hlo_kernels", args.target or jax.default_backend()))
    return rows


if __name__ == "__main__":
    main()

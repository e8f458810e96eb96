"""``range_report``: every floating intermediate of a loss function, forward
and backward, at a given loss scale.

How the backward values are seen: the loss function's jaxpr is evaluated
equation by equation, and each floating value an equation produces whose
cotangent ``jax.grad`` forms (one on a path from the differentiated
arguments to the loss: not data, not a ``stop_gradient``'ed value, not one
only the aux output reads) gets a zero "probe" added to it (``v + p``, with ``p`` all zeros of ``v``'s shape
and dtype). The forward pass is unchanged, and the gradient with respect to
``p`` is exactly the cotangent that reaches ``v`` in the backward pass, in
``v``'s dtype: one ``jax.grad`` gives every intermediate's cotangent at once.
Calls of jitted functions and ``jax.checkpoint`` are evaluated inside (their
equations get rows); ``custom_jvp``/``custom_vjp`` functions and control
flow (``scan``, ``while_loop``, ``cond``) are bound whole, and their outputs
on such a path get a row each. Values off every such path are evaluated
plainly, as ``jax.grad`` evaluates them (a ``while_loop`` or
``pure_callback`` on data works).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from loss_scale import _validate as validate
from loss_scale._check import largest_magnitude
from loss_scale._probe import Evaluator, is_probed, on_paths
from loss_scale._rules.segmented import segment_owners
from loss_scale._segments import Segmented
from loss_scale._segments.analysis import Analyser, all_potentials
from loss_scale._segments.evaluate import new_probes
from loss_scale._segments.marker import cotangent_stats
from loss_scale._types import LOSS_SEGMENT, PyTree
from loss_scale._unscale import unscale_dtype as _at_least_float32
from loss_scale._validate import floating_dtype


class RangeRow(NamedTuple):
    """One floating value of the forward pass and its cotangent.

    Attributes:
      index: position in forward (evaluation) order; arguments first.
      where: the name stack (``jax.named_scope``, jitted function and flax
        module names where recorded) and the user's file:line.
      primitive: the JAX primitive that produced the value (``argument`` for
        a differentiated input; for a ``custom_jvp``/``custom_vjp`` call or
        control flow, that whole call).
      shape: the value's shape.
      dtype: the value's dtype.
      forward_max: ``max |x|`` (inf when not finite).
      backward_max: ``max |cotangent|`` at the report's scale, in the value's
        dtype (inf when not finite).
      backward_zero: fraction of cotangent elements exactly 0.
      backward_below_normal: fraction below the dtype's smallest normal
        (zeros included).
      overflows: whether the cotangent has a non-finite element.
      headroom: how many times larger the cotangent could be before it
        overflows, measured at ``max_safe_scale`` (``inf`` for a zero
        cotangent; ``nan`` when no scale is safe).
      segment: with ``range_report(..., segments=...)``, the segment the
        value's cotangent is in (``"loss"`` for the loss's own; a
        differentiated argument's gradient is brought back to the global
        scale, so its row is in ``"loss"``); ``""`` otherwise.

    Examples:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> report = ls.range_report(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((4, 2)), jnp.ones((3, 4)))
      >>> [row.primitive for row in report.rows]
      ['argument', 'dot_general', 'tanh', 'reduce_sum']
      >>> row = report.rows[2]
      >>> row.where.startswith("<doctest"), row.shape, row.dtype
      (True, (3, 2), 'float32')
      >>> float(row.forward_max) < 1.0, float(row.backward_max), row.overflows
      (True, 32768.0, False)
    """

    index: int
    where: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    forward_max: float
    backward_max: float
    backward_zero: float
    backward_below_normal: float
    overflows: bool
    headroom: float
    segment: str = ""


class SegmentRow(NamedTuple):
    """One segment of the backward pass with its boundaries in force
    (``range_report(..., segments=...)``).

    Attributes:
      name: the boundary's name, or ``"loss"`` for the loss's own segment
        (the segment of a value is the deepest boundary its paths to the
        loss cross).
      exponent: the boundary's exponent (0 for ``"loss"``).
      scale: the smallest scale its cotangents carry (the report's scale
        times the factors of the boundaries crossed); a boundary crossed
        once per step of a scan gives larger ones further back.
      backward_max: the largest cotangent magnitude in the segment at those
        scales (inf when one was not finite).
      backward_zero: fraction of the segment's cotangent elements exactly 0.
      backward_below_normal: fraction below the dtype's smallest normal
        (zeros included).
      overflows: whether a cotangent of the segment was not finite.

    Examples:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     h = ls.segment(jnp.tanh(x.astype(jnp.float16) @ w["embed"].astype(jnp.float16)), "embed")
      ...     return jnp.mean((h @ w["head"].astype(jnp.float16)).astype(jnp.float32))
      >>> w, x = {"embed": jnp.full((3, 4), 0.25), "head": jnp.ones((4, 2))}, jnp.ones((5, 3))
      >>> report = ls.range_report(loss_fn, w, x, scale=2.0**10, segments={"embed": 3})
      >>> [(r.name, r.exponent, r.scale, r.backward_zero) for r in report.segments]
      [('loss', 0, 1024.0, 0.0), ('embed', 3, 8192.0, 0.0)]
      >>> sorted({row.segment for row in report.rows})
      ['embed', 'loss']
    """

    name: str
    exponent: int
    scale: float
    backward_max: float
    backward_zero: float
    backward_below_normal: float
    overflows: bool


class RangeReport(NamedTuple):
    """What ``range_report`` returns; ``str(report)`` is a table, widest
    offenders (least headroom) first.

    Attributes:
      rows: one ``RangeRow`` per differentiated argument leaf and per
        floating value on a path from them to the loss, in forward order.
      scale: the loss scale of the report's backward pass.
      max_safe_scale: the largest power of two at which no backward value
        overflows (``None`` when none up to ``2**-64`` is safe, e.g. when the
        forward pass is not finite).
      notes: what was evaluated inside and what was kept whole.
      segments: with ``segments``, one ``SegmentRow`` per segment: the
        backward pass with its boundaries in force (the rows are at the
        one scale ``scale``, so the two side by side show what the
        boundaries change); ``None`` otherwise.

    Examples:
      >>> import jax, jax.numpy as jnp, loss_scale as ls
      >>> loss_fn = lambda w, x: jnp.log(jax.nn.softmax(x @ w))[:, 0].mean()
      >>> w, x = jnp.linspace(-3.0, 3.0, 64).reshape(4, 16), jnp.ones((8, 4))
      >>> report = ls.range_report(loss_fn, w, x, scale=2.0**15, compute_dtype="float16")
      >>> report.scale, report.max_safe_scale, len(report.overflowing) > 0
      (32768.0, 512.0, True)
      >>> report.overflowing[0].primitive, report.overflowing[0].dtype
      ('div', 'float16')
      >>> print(str(report).splitlines()[0])
      range report at scale 32768: ... values, ... overflow; max safe scale 2**9
    """

    rows: list[RangeRow]
    scale: float
    max_safe_scale: float | None
    notes: str
    segments: list[SegmentRow] | None = None

    @property
    def overflowing(self) -> list[RangeRow]:
        """The rows whose cotangent overflows at ``scale``, the one that
        overflows first as the scale grows (least headroom) first; among
        rows with the same headroom, the one the backward pass reaches
        first (latest in forward order) first."""
        rows = [r for r in self.rows if r.overflows]
        return sorted(rows, key=_offender_order)

    def __str__(self) -> str:
        return format_report(self)


def _offender_order(row: RangeRow) -> tuple[float, int]:
    headroom = row.headroom if not math.isnan(row.headroom) else -1.0
    return (headroom, -row.index)


def _split(tree: PyTree) -> tuple[list, list[int], Any]:
    """The tree's leaves, the positions of its array leaves, its treedef
    (Equinox and NNX modules keep functions and other non-arrays as leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray | np.generic)]
    return leaves, positions, treedef


def _cast(tree: PyTree, dtype: jnp.dtype | None) -> PyTree:
    if dtype is None:
        return tree

    def leaf(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(leaf, tree)


def range_report(
    fun: Callable[..., Any],
    *args: Any,
    scale: float = 2.0**15,
    compute_dtype: Any = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    segments: Mapping[str, int] | None = None,
) -> RangeReport:
    """Runs ``fun(*args)`` forward and backward once at loss scale ``scale``
    and reports the range of every floating intermediate.

    Each row is a value some operation produced whose cotangent ``jax.grad``
    forms, one that depends on the differentiated arguments and reaches the
    loss (see ``RangeRow``): where it
    comes from, its forward ``max |x|``, the ``max |cotangent|`` that reaches
    it in the backward pass of ``fun(*args) * scale``, the fractions of that
    cotangent that are 0 and below the dtype's smallest normal, and whether
    it overflows. ``max_safe_scale`` is the largest power of two at which no
    backward value overflows, found by running the backward pass at powers
    of two around the estimate the report's own maxima give.

    Jitted functions and ``jax.checkpoint`` are looked into;
    ``custom_jvp``/``custom_vjp`` functions and ``scan``, ``while_loop`` and
    ``cond`` are bound whole, a row for each of their outputs on a path to
    the loss (``report.notes`` says which were met). It runs eagerly: called
    under ``jit``, ``vmap`` or ``grad`` it raises a ``TypeError``.

    Args:
      fun: the loss function; returns a floating scalar (or ``(loss, aux)``
        with ``has_aux``).
      *args: its arguments. Non-array leaves (the functions of an Equinox
        module, say) are held fixed.
      scale: the loss scale of the reported backward pass.
      compute_dtype: when given (e.g. ``"float16"``), the floating array
        leaves of ``args`` are cast to it first, to see the pass as it would
        run in that dtype.
      argnums: the arguments whose gradients get rows of their own
        (primitive ``argument``), as in ``jax.grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)`` (a tuple or a list,
        as ``jax.value_and_grad`` accepts); values only ``aux`` reads get no
        row.
      segments: the exponents of ``fun``'s boundaries (``loss_scale.segment``)
        by name, e.g. an optimizer state's
        ``ls.find_state(opt_state).segments.exponents()``: each row is then
        labelled with its segment (``RangeRow.segment``), and
        ``report.segments`` gives each segment's scale, largest cotangent
        and flush fractions with the boundaries in force.

    Returns:
      A ``RangeReport``.

    Examples:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     h = jnp.tanh(x @ w)
      ...     return jnp.mean(h * 1000.0)
      >>> w, x = jnp.full((4, 4), 0.1, jnp.float16), jnp.ones((8, 4), jnp.float16)
      >>> report = ls.range_report(loss_fn, w, x, scale=2.0**15)
      >>> report.max_safe_scale
      256.0
      >>> [row.primitive for row in report.overflowing]  # the first overflows first
      ['argument', 'tanh', 'dot_general']
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {type(fun).__name__}")
    if not (isinstance(scale, int | float) and not isinstance(scale, bool)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    dtype = None if compute_dtype is None else floating_dtype("compute_dtype", compute_dtype)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        raise TypeError(
            "range_report runs eagerly (it runs the backward pass at several scales and reads the results): "
            "call it outside jax.jit, vmap and grad, on concrete arrays"
        )
    argnums_t = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    n = len(args)
    for a in argnums_t:
        if not isinstance(a, int) or not -n <= a < n:
            raise ValueError(f"argnums {argnums!r} out of range for {n} positional arguments")
    argnums_t = tuple(a % n for a in argnums_t)
    args = tuple(_cast(a, dtype) for a in args)

    # Array leaves are traced; everything else stays a constant of the jaxpr.
    flat = [_split(a) for a in args]

    def rebuild(arrays: list[list]) -> tuple:
        out = []
        for (leaves, positions, treedef), values in zip(flat, arrays, strict=True):
            leaves = list(leaves)
            for i, v in zip(positions, values, strict=True):
                leaves[i] = v
            out.append(jax.tree.unflatten(treedef, leaves))
        return tuple(out)

    def loss_of(arrays):
        out = fun(*rebuild(arrays))
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):  # as jax.value_and_grad accepts
                raise TypeError("with has_aux=True, fun must return a (loss, aux) pair (a tuple or list of two)")
            out = out[0]
        out = jnp.asarray(out)
        if out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(f"fun must return a floating scalar loss, got {out.dtype}{list(out.shape)}")
        return out

    arrays = [[leaves[i] for i in positions] for leaves, positions, _ in flat]
    closed = jax.make_jaxpr(loss_of)(arrays)
    in_leaves = jax.tree.leaves(arrays)

    # Differentiated arguments' floating leaves get rows first.
    arg_sites = []
    for a in argnums_t:
        leaves, positions, treedef = flat[a]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args[a])[0]]
        for i in positions:
            if is_probed(leaves[i]):
                arg_sites.append((a, positions.index(i), f"args[{a}]{paths[i]}"))

    # Rows for the values jax.grad forms a cotangent for: those on a path
    # from the differentiated arguments' leaves to the loss.
    differentiated = [False] * len(in_leaves)
    offsets = np.cumsum([0] + [len(positions) for _, positions, _ in flat])
    for a, j, _ in arg_sites:
        differentiated[offsets[a] + j] = True
    paths = on_paths(closed, in_leaves, differentiated)
    sites = paths.sites
    in_tree = jax.tree.structure(arrays)

    def scaled_loss(probes, diff, leaves, s):
        arrays = jax.tree.unflatten(in_tree, leaves)
        for (a, j, _), value in zip(arg_sites, diff, strict=True):
            arrays[a][j] = value
        evaluator = Evaluator(probes, paths.probed)
        (loss,) = evaluator.run(closed.jaxpr, closed.consts, jax.tree.leaves(arrays))
        forward = [largest_magnitude(jax.lax.stop_gradient(x)) for x in evaluator.values]
        return loss.astype(_at_least_float32(loss.dtype)) * s, forward

    @jax.jit
    def backward(leaves, s):
        arrays = jax.tree.unflatten(in_tree, leaves)
        diff = [arrays[a][j] for a, j, _ in arg_sites]
        probes = [jnp.zeros(site.shape, site.dtype) for site in sites]
        grads, forward = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)(probes, diff, leaves, s)
        cotangents = list(grads[1]) + list(grads[0])
        stats = []
        for ct in cotangents:
            peak, zeros, below = cotangent_stats(ct)
            stats.append((peak, zeros / ct.size, below / ct.size, jnp.isfinite(peak)))
        return stats, [largest_magnitude(x) for x in diff] + forward

    def run(s: float):
        stats, forward = jax.device_get(backward(in_leaves, jnp.float32(s)))
        return stats, forward

    def all_finite(stats) -> bool:
        return all(bool(finite) for *_, finite in stats)

    dtypes = [jnp.dtype(leaf.dtype) for a, j, _ in arg_sites for leaf in [arrays[a][j]]] + [s.dtype for s in sites]
    stats, forward = run(scale)
    safe = _max_safe_scale(run, all_finite, stats, dtypes, scale)
    headroom = [math.nan] * len(stats)
    if safe is not None:
        safe_stats, _ = run(safe)
        headroom = [
            math.inf if peak == 0 else float(jnp.finfo(dt).max) / float(peak)
            for (peak, *_), dt in zip(safe_stats, dtypes, strict=True)
        ]
    described = [(label, "argument", tuple(np.shape(arrays[a][j]))) for a, j, label in arg_sites] + [
        (s.where, s.primitive, s.shape) for s in sites
    ]
    rows = [
        RangeRow(
            index=i,
            where=where,
            primitive=primitive,
            shape=shape,
            dtype=str(dt),
            forward_max=float(fmax),
            backward_max=float(peak),
            backward_zero=float(zero),
            backward_below_normal=float(below),
            overflows=not bool(finite),
            headroom=room,
        )
        for i, ((where, primitive, shape), dt, fmax, (peak, zero, below, finite), room) in enumerate(
            zip(described, dtypes, forward, stats, headroom, strict=True)
        )
    ]
    notes = []
    if paths.inlined:
        notes.append("looked into: " + ", ".join(sorted(paths.inlined)))
    if paths.whole:
        notes.append("kept whole (their outputs only): " + ", ".join(sorted(paths.whole)))
    segment_rows = None
    if segments is not None:
        exponents = _segment_exponents(segments)
        labels = _segment_labels(closed, differentiated, exponents, paths, len(arg_sites))
        rows = [row._replace(segment=label) for row, label in zip(rows, labels, strict=True)]
        segment_rows = _segment_rows(loss_of, arrays, differentiated, exponents, scale, dtype)
    return RangeReport(rows, float(scale), safe, "; ".join(notes), segment_rows)


def _segment_exponents(segments: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(segments, Mapping):
        raise TypeError(
            f"segments must map each boundary's name to its exponent (e.g. ls.find_state(opt_state)."
            f"segments.exponents()), got {type(segments).__name__}"
        )
    return {validate.segment_name("segments' name", name): int(e) for name, e in segments.items()}


def _segment_labels(closed, differentiated, exponents, paths, n_arguments) -> list[str]:
    """Each row's segment: the arguments the loss's (they are held at the
    global scale), the rest the deepest boundary their paths cross."""
    names = tuple(sorted(exponents))
    plan = Analyser(names).analyse(closed, differentiated)
    found = all_potentials(plan)
    keys = sorted({found[v] for v in paths.variables if v in found} | {(0,) * len(names)})
    owners = dict(zip(keys, segment_owners(np.asarray(keys, np.int32).reshape(len(keys), len(names))), strict=True))
    labels = [LOSS_SEGMENT] * n_arguments
    for variable, probed in zip(paths.variables, paths.probed, strict=True):
        if probed:
            potential = found.get(variable)
            owner = owners.get(potential, 0) if potential is not None else 0
            labels.append(LOSS_SEGMENT if owner == 0 else names[owner - 1])
    return labels


def _segment_rows(loss_of, arrays, differentiated, exponents, scale, dtype) -> list[SegmentRow]:
    """The backward pass with the boundaries in force, each segment's
    statistics (``SegmentPeaks`` at ``scale``, by name)."""
    leaves = jax.tree.leaves(arrays)
    tree = jax.tree.structure(arrays)

    def scaled(leaves):
        loss = loss_of(jax.tree.unflatten(tree, leaves))
        return loss.astype(_at_least_float32(loss.dtype)) * scale, None

    compute = dtype if dtype is not None else _widest_16bit(leaves)
    segmented = Segmented.with_exponents(scaled, leaves, exponents, differentiated, compute)
    if segmented is None:
        raise ValueError("segments were given, but the loss function has no boundary (loss_scale.segment)")

    @jax.jit
    def measure(leaves):
        positions = [i for i, flag in enumerate(differentiated) if flag]

        def objective(diff, probes):
            call = list(leaves)
            for i, d in zip(positions, diff, strict=True):
                call[i] = d
            return segmented.evaluate(call, probes)

        probes = new_probes(segmented.sites)
        diff = [leaves[i] for i in positions]
        (at_leaves, at_probes), _ = jax.grad(objective, argnums=(0, 1), has_aux=True)(diff, probes)
        return segmented.peaks(at_probes, at_leaves)

    peaks = jax.device_get(measure(leaves))
    names = segmented.names
    keys = peaks.key_matrix
    owners = segment_owners(keys)
    rows = []
    for s, name in enumerate((LOSS_SEGMENT, *names)):
        parts = np.flatnonzero(owners == s)
        if not parts.size:
            continue
        power = keys[parts] @ np.asarray([exponents[n] for n in names], np.int64) if names else np.zeros(len(parts))
        count = float(np.sum(peaks.count[parts]))
        peak = float(np.max(peaks.peak[parts]))
        rows.append(
            SegmentRow(
                name=name,
                exponent=0 if s == 0 else exponents[name],
                scale=float(scale * 2.0 ** int(np.min(power))),
                backward_max=peak,
                backward_zero=float(np.sum(peaks.zeros[parts])) / max(count, 1.0),
                backward_below_normal=float(np.sum(peaks.below_normal[parts])) / max(count, 1.0),
                overflows=not math.isfinite(peak),
            )
        )
    return rows


def _widest_16bit(leaves: Sequence[Any]) -> jnp.dtype:
    """The dtype whose cotangents the segments' statistics count when no
    compute dtype is given: float16 unless no leaf is float16 and one is
    bfloat16."""
    dtypes = {jnp.dtype(x.dtype) for x in leaves if hasattr(x, "dtype")}
    if jnp.dtype(jnp.float16) not in dtypes and jnp.dtype(jnp.bfloat16) in dtypes:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float16)


def _max_safe_scale(run, all_finite, stats, dtypes, scale: float) -> float | None:
    """The largest power of two ``s`` with every cotangent finite at ``s``:
    estimated from the maxima at ``scale`` (cotangents grow linearly with
    the scale), then confirmed by running at ``s`` and ``2 s``."""
    finite_rows = [(peak, dt) for (peak, _, _, finite), dt in zip(stats, dtypes, strict=True) if finite and peak > 0]
    exponent = math.floor(math.log2(scale))
    if finite_rows:
        room = min(float(jnp.finfo(dt).max) / float(peak) for peak, dt in finite_rows)
        exponent = math.floor(math.log2(scale * room))
    if not all_finite(stats):
        exponent = min(exponent, math.ceil(math.log2(scale)) - 1)
    exponent = max(min(exponent, 127), -64)
    # Down until finite, then up while the next power is finite.
    while not all_finite(run(2.0**exponent)[0]):
        exponent -= 1
        if exponent < -64:
            return None
    while exponent < 127 and all_finite(run(2.0 ** (exponent + 1))[0]):
        exponent += 1
    return 2.0**exponent


def format_report(report: RangeReport, limit: int = 20) -> str:
    """The report as a table, least headroom first (at most ``limit`` rows)."""
    safe = "none" if report.max_safe_scale is None else f"2**{int(math.log2(report.max_safe_scale))}"
    lines = [
        f"range report at scale {report.scale:g}: {len(report.rows)} values, "
        f"{sum(r.overflows for r in report.rows)} overflow; max safe scale {safe}",
    ]
    if report.notes:
        lines.append(report.notes)
    labelled = report.segments is not None
    header = ("where", "op", "shape", "dtype", "fwd max", "bwd max", "bwd 0", "bwd <normal", "headroom", "")
    if labelled:
        header = ("segment", *header)
    body = []
    for r in sorted(report.rows, key=_offender_order)[:limit]:
        body.append(
            ((r.segment,) if labelled else ())
            + (
                r.where if len(r.where) <= 60 else r.where[:57] + "...",
                r.primitive,
                "x".join(map(str, r.shape)) or "()",
                r.dtype,
                f"{r.forward_max:.3g}",
                f"{r.backward_max:.3g}",
                f"{r.backward_zero:.0%}",
                f"{r.backward_below_normal:.0%}",
                "nan" if math.isnan(r.headroom) else f"{r.headroom:.3g}",
                "OVERFLOW" if r.overflows else "",
            )
        )
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    for row in [header, *body]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if len(report.rows) > limit:
        lines.append(f"... {len(report.rows) - limit} more rows in report.rows")
    if report.segments is not None:
        lines.append("")
        lines.append("with the boundaries in force (report.segments):")
        header = ("segment", "exponent", "scale", "bwd max", "bwd 0", "bwd <normal", "")
        body = [
            (
                r.name,
                str(r.exponent),
                f"{r.scale:g}",
                f"{r.backward_max:.3g}",
                f"{r.backward_zero:.0%}",
                f"{r.backward_below_normal:.0%}",
                "OVERFLOW" if r.overflows else "",
            )
            for r in report.segments
        ]
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
        for row in [header, *body]:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)

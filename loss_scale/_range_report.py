"""``range_report``: every floating intermediate of a loss function, forward
and backward, at a given loss scale.

How the backward values are seen: the loss function's jaxpr is evaluated
equation by equation (``_probe``), and each floating value an equation
produces whose cotangent ``jax.grad`` forms (one on a path from the
differentiated arguments to the loss: not data, not a ``stop_gradient``'ed
value, not one only the aux output reads) gets a zero "probe" added to it
(``v + p``, with ``p`` all zeros of ``v``'s shape and dtype). The forward
pass is unchanged, and the gradient with respect to ``p`` is exactly the
cotangent that reaches ``v`` in the backward pass, in ``v``'s dtype: one
``jax.grad`` gives every intermediate's cotangent at once. Calls of jitted
functions and ``jax.checkpoint`` are evaluated inside (their equations get
rows); ``custom_jvp``/``custom_vjp`` functions and control flow (``scan``,
``while_loop``, ``cond``) are bound whole, and their outputs on such a path
get a row each. Values off every such path are evaluated plainly, as
``jax.grad`` evaluates them (a ``while_loop`` or ``pure_callback`` on data
works).

The report's types and its table are ``_range_rows``'s (importable from
here too); the rows' segments and the per-segment pass ``_range_segments``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._check import largest_magnitude
from loss_scale._probe import Evaluator, is_probed, on_paths
from loss_scale._range_rows import RangeReport, RangeRow, SegmentRow, format_report
from loss_scale._range_segments import segment_exponents, segment_labels, segment_rows
from loss_scale._segments.marker import cotangent_stats
from loss_scale._types import PyTree
from loss_scale._unscale import unscale_dtype as _at_least_float32
from loss_scale._validate import floating_dtype

__all__ = ["RangeReport", "RangeRow", "SegmentRow", "format_report", "range_report"]


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
        (loss,) = evaluator.run(closed, jax.tree.leaves(arrays))
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
    per_segment = None
    if segments is not None:
        exponents = segment_exponents(segments)
        labels = segment_labels(closed, differentiated, exponents, paths, len(arg_sites))
        rows = [row._replace(segment=label) for row, label in zip(rows, labels, strict=True)]
        per_segment = segment_rows(loss_of, arrays, differentiated, exponents, scale, dtype)
    return RangeReport(rows, float(scale), safe, "; ".join(notes), per_segment)


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

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
works). Each probed value also records whether the operation's floating
inputs were finite, so that a forward overflow is told from the values it
makes non-finite downstream (``RangeRow.forward_overflows``).

The report's types and its table are ``_range_rows``'s (importable from
here too); the rows' segments and the per-segment pass ``_range_segments``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale import _validate as validate
from loss_scale._check import all_finite as _all_finite
from loss_scale._check import largest_magnitude
from loss_scale._probe import Evaluator, is_probed, on_paths
from loss_scale._range_rows import RangeReport, RangeRow, SegmentRow, format_report
from loss_scale._range_segments import segment_exponents, segment_labels, segment_rows
from loss_scale._segments.marker import cotangent_stats
from loss_scale._types import AxisName, PyTree
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
    axis_name: AxisName | None = None,
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
    of two around the estimate the report's own maxima give; it describes
    the backward pass alone.

    An operation that overflows in the forward pass (``report.
    forward_overflowing``: a ``square`` of float16 activations above 256,
    a float16 product above 65504) overflows at every scale, so no loss
    scale fixes it: the table's header names the first one before anything
    else, and its rows come first.

    Jitted functions and ``jax.checkpoint`` are looked into;
    ``custom_jvp``/``custom_vjp`` functions and ``scan``, ``while_loop`` and
    ``cond`` are bound whole, a row for each of their outputs on a path to
    the loss (``report.notes`` says which were met, and what that means for
    the numbers). It runs eagerly: called under ``jit``, ``vmap`` or
    ``grad`` it raises a ``TypeError``.

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
      axis_name: the name (or a tuple of names) of a mapped axis that the
        loss function's collectives reduce over (``jax.lax.psum``/``pmean``,
        flax ``BatchNorm(axis_name=...)``), which a data-parallel step binds
        with ``shard_map`` or ``pmap``. The report runs ``fun`` as the only
        member of that axis (``jax.vmap`` with ``axis_size=1``): the
        collectives see the whole batch of ``args`` on one replica (a
        ``psum`` or ``pmean`` returns its operand), as a single-device run
        with the same global batch would.

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
    axis_name = validate.axis_name("axis_name", axis_name)
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

    names = () if axis_name is None else axis_name if isinstance(axis_name, tuple) else (axis_name,)
    arrays = [[leaves[i] for i in positions] for leaves, positions, _ in flat]
    try:
        closed = jax.make_jaxpr(loss_of, axis_env=[(name, 1) for name in names])(arrays)
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise
        raise NameError(_unbound_axis_message(str(e), axis_name)) from e
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
    paths = _paths_in(closed, in_leaves, differentiated, names)
    sites = paths.sites
    in_tree = jax.tree.structure(arrays)

    def scaled_loss(probes, diff, leaves, s):
        arrays = jax.tree.unflatten(in_tree, leaves)
        for (a, j, _), value in zip(arg_sites, diff, strict=True):
            arrays[a][j] = value
        evaluator = _Forward(probes, paths.probed)
        (loss,) = evaluator.run(closed, jax.tree.leaves(arrays))
        forward = [largest_magnitude(jax.lax.stop_gradient(x)) for x in evaluator.values]
        loss_finite = jnp.isfinite(jax.lax.stop_gradient(loss))
        return loss.astype(_at_least_float32(loss.dtype)) * s, (forward, evaluator.reads_finite, loss_finite)

    def backward(leaves, s):
        arrays = jax.tree.unflatten(in_tree, leaves)
        diff = [arrays[a][j] for a, j, _ in arg_sites]
        probes = [jnp.zeros(site.shape, site.dtype) for site in sites]
        grads, (forward, reads_finite, loss_finite) = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)(
            probes, diff, leaves, s
        )
        cotangents = list(grads[1]) + list(grads[0])
        stats = []
        for ct in cotangents:
            peak, zeros, below = cotangent_stats(ct)
            stats.append((peak, zeros / ct.size, below / ct.size, jnp.isfinite(peak)))
        reads_finite = [jnp.bool_(True)] * len(diff) + list(reads_finite)  # an argument reads nothing
        return stats, ([largest_magnitude(x) for x in diff] + forward, reads_finite, loss_finite)

    backward = _compile_measurement(_only_member(backward, names))

    def run(s: float):
        stats, forward = jax.device_get(backward(in_leaves, jnp.float32(s)))
        return stats, forward

    def all_finite(stats) -> bool:
        return all(bool(finite) for *_, finite in stats)

    dtypes = [jnp.dtype(leaf.dtype) for a, j, _ in arg_sites for leaf in [arrays[a][j]]] + [s.dtype for s in sites]
    stats, (forward, reads_finite, loss_finite) = run(scale)
    # The arguments are the same at every scale: read once, not per run.
    inputs_finite = jax.jit(_all_finite)(in_leaves)
    safe = _max_safe_scale(run, all_finite, stats, dtypes, scale)
    headroom = [math.nan] * len(stats)
    if safe is not None:
        safe_stats, _ = run(safe)
        headroom = [
            math.inf if peak == 0 else float(jnp.finfo(dt).max) / float(peak)
            for (peak, *_), dt in zip(safe_stats, dtypes, strict=True)
        ]
    described = [(label, "argument", tuple(np.shape(arrays[a][j])), "") for a, j, label in arg_sites] + [
        (s.where, s.primitive, s.shape, s.library) for s in sites
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
            forward_overflows=bool(reads) and not float(fmax) <= float(jnp.finfo(dt).max),
            library=library,
        )
        for i, ((where, primitive, shape, library), dt, fmax, reads, (peak, zero, below, finite), room) in enumerate(
            zip(described, dtypes, forward, reads_finite, stats, headroom, strict=True)
        )
    ]
    per_segment = None
    if segments is not None:
        exponents = segment_exponents(segments)
        labels = segment_labels(closed, differentiated, exponents, paths, len(arg_sites))
        rows = [row._replace(segment=label) for row, label in zip(rows, labels, strict=True)]
        per_segment = segment_rows(_only_member(loss_of, names), arrays, differentiated, exponents, scale, dtype)
    notes = _notes(paths.inlined, paths.whole)
    return RangeReport(rows, float(scale), safe, notes, per_segment, bool(loss_finite), bool(inputs_finite))


def _compile_measurement(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.jit(backward)``: the measurement that ``range_report`` runs at
    each scale, ``backward(leaves, scale)``. A function of its own so that
    a test can compile the same measurement for another backend (a GPU's
    program, compiled without one)."""
    return jax.jit(backward)


class _Forward(Evaluator):
    """``Evaluator`` that also records, for each probed value, whether the
    floating inputs of the operation that made it were all finite
    (``reads_finite``, in the order of ``values``)."""

    def __init__(self, probes: Sequence[Any], probed: Sequence[bool]):
        super().__init__(probes, probed)
        self.reads_finite: list[jax.Array] = []
        self._reading: list[list[Any]] = []  # a stack: an entered call's equations run inside its own

    def equation(self, equation, invals, bind):
        self._reading.append(invals)
        try:
            return super().equation(equation, invals, bind)
        finally:
            self._reading.pop()

    def probe(self, x, where, primitive, var=None, library=""):
        before = len(self.values)
        x = super().probe(x, where, primitive, var, library)
        if len(self.values) > before:
            reads = [v for v in (self._reading[-1] if self._reading else []) if is_probed(v)]
            self.reads_finite.append(_all_finite(jax.lax.stop_gradient(reads)))
        return x


def _only_member(fn: Callable, names: tuple) -> Callable:
    """``fn`` (returning arrays) run as the only member of each mapped axis
    in ``names`` (``jax.vmap`` with ``axis_size=1``), so that collectives
    over them are bound: a ``psum`` or ``pmean`` returns its operand. Its
    outputs as ``fn``'s (the leading axes of size 1 dropped)."""
    if not names:
        return fn

    def run(*args):
        call = lambda: fn(*args)  # noqa: E731
        for name in names:
            call = jax.vmap(call, axis_name=name, axis_size=1)
        return jax.tree.map(lambda a: a.reshape(a.shape[len(names) :]), call())

    return run


def _paths_in(closed: Any, leaves: list, differentiated: list[bool], names: tuple) -> Any:
    """``on_paths`` with the axes ``names`` bound (``_only_member``)."""
    found = []

    def discover():
        found.append(on_paths(closed, leaves, differentiated))
        return jnp.zeros(())

    _only_member(discover, names)()
    return found[0]


def _unbound_axis_message(error: str, axis_name: AxisName | None) -> str:
    """What to do when the loss function reduces over an axis the report
    does not bind."""
    found = re.search(r"unbound axis name: (\S+?)\.?(\s|$)", error)
    name = repr(found.group(1)) if found else "<its name>"
    given = f" (axis_name={axis_name!r} binds others)" if axis_name is not None else ""
    return (
        f"the loss function reduces over the named axis {name}{given} (a jax.lax.psum or pmean, or a flax "
        f"BatchNorm(axis_name=...)), which only jax.vmap, pmap or shard_map bind; call "
        f"range_report(..., axis_name={name}) to run it as the only member of that axis, on the whole batch "
        f"(jax's message: {error.strip()})"
    )


# What each call the report evaluates inside, or keeps whole, is in the
# user's words; a primitive not named here is shown by its name alone.
_INSIDE = {
    "pjit": "jax.jit functions, also the jnp and jax.nn functions jax jits itself",
    "jit": "jax.jit functions, also the jnp and jax.nn functions jax jits itself",
    "checkpoint": "jax.checkpoint bodies",
    "remat2": "jax.checkpoint (jax.remat) bodies",
    "closed_call": "calls",
    "core_call": "calls",
}
_WHOLE = {
    "custom_jvp_call": "functions with their own derivative rule, jax.custom_jvp, e.g. jax.nn.relu",
    "custom_vjp_call": "functions with their own backward pass, jax.custom_vjp",
    "custom_vjp_call_jaxpr": "functions with their own backward pass, jax.custom_vjp",
    "scan": "lax.scan loops, also lax.map, fori_loop with fixed bounds and flax nn.scan",
    "while": "lax.while_loop loops",
    "cond": "lax.cond and lax.switch",
    "shard_map": "shard_map bodies",
}


def _notes(inlined: set[str], whole: set[str]) -> str:
    """``RangeReport.notes``: what the report looked into and what it kept
    whole, and what that means for the table's numbers; one line each."""

    def named(names, words):
        return ", ".join(f"{n} ({words[n]})" if n in words else n for n in sorted(names))

    notes = []
    if inlined:
        notes.append(f"looked into (each operation inside has a row of its own): {named(inlined, _INSIDE)}")
    if whole:
        notes.append(f"kept whole (a row per output, none for the operations inside): {named(whole, _WHOLE)}")
        notes.append(
            "  their rows hold their outputs' forward max and cotangents; an overflow inside shows only where it "
            "comes out:\n  in the forward pass as an output that is not finite, in the backward pass as a cotangent "
            "that is not finite in the rows of the values they read"
        )
    return "\n".join(notes)


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

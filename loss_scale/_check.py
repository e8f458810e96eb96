"""The finite check and the gradient statistics: the update's hot path.

One read of every gradient leaf decides whether the step is applied, and
gives the largest unscaled magnitude (which the predictive rule and the
metrics use); the optional statistics (norm, underflow fractions) reduce
over the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._check_gpu import SMALL_LEAVES_PER_KERNEL, by_rows, magnitude, reduced_by_rows
from loss_scale._grid import nearest_on_grid
from loss_scale._sharding import axis_names, varying_axes
from loss_scale._types import AxisName, PyTree
from loss_scale._unscale import is_float_leaf, unscale_dtype, unscale_leaf, unscaled_value


def peak_and_finite(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """``(max|x|, all(isfinite(x)))`` over ``axes`` of a floating array, in
    one pass.

    One variadic reduction reads each element once and yields both. The
    finite flag comes from ``isfinite`` and a logical and, whose results IEEE
    arithmetic fixes; it never relies on a float ``max`` propagating NaN,
    which XLA does not promise (on XLA:CPU, jaxlib 0.10.2, ``jnp.max`` over a
    float32 array of 4096 or more elements drops NaN: ``max|x|`` of
    ``ones(8192).at[100].set(nan)`` is 1.0). The peak is only meaningful when
    the flag is True; with a NaN present it may be anything.

    The peak is in ``x``'s real dtype (exact); complex leaves give the larger
    of ``|re|`` and ``|im|`` (see ``_magnitude``). A leaf with no elements is
    finite with peak 0.

    Neither result is a differentiable quantity, and the variadic reduction
    has no JVP rule: ``x``'s gradient is stopped here, so that
    differentiating through an update (meta-learning a learning rate,
    unrolled optimisation) sees a constant check.
    """
    x = jax.lax.stop_gradient(x)
    magnitudes = magnitude(x)
    zero = jnp.zeros((), magnitudes.dtype)
    return jax.lax.reduce((magnitudes, jnp.isfinite(x)), (zero, jnp.array(True)), _max_and_all, axes)


def largest_magnitude(x: jax.Array) -> jax.Array:
    """``max|x|`` over all of a floating ``x`` as a float32 scalar: ``inf``
    when an element is not finite, 0 when ``x`` is empty. One
    ``peak_and_finite`` reduction, so NaN is never left to a float ``max``."""
    peak, finite = peak_and_finite(x, tuple(range(x.ndim)))
    return jnp.where(finite, peak.astype(jnp.float32), jnp.inf)


def _max_and_all(a, b):
    # A module-level function, so that op-by-op calls reuse its compilation.
    return jnp.maximum(a[0], b[0]), jnp.logical_and(a[1], b[1])


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite.

    Each floating leaf is read once (``isfinite`` and a logical-and
    reduction: exact on every backend, whatever its float ``max`` does with
    NaN); integer and boolean leaves are ignored. An empty tree is finite.

    Args:
      tree: any pytree of arrays.

    Returns:
      A bool scalar: ``False`` when any inf or nan is present.

    Examples:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> bool(ls.all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
      >>> bool(ls.all_finite({"w": jnp.ones(8192).at[100].set(jnp.nan)}))
      False
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_float_leaf(x)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


class GradStats(NamedTuple):
    """What one pass over the scaled gradients tells about the unscaled ones.

    Attributes:
      finite: bool, whether every gradient is finite once unscaled.
      leaf_finite: bool[n], one flag per leaf of the gradient tree (in
        ``jax.tree.leaves`` order; non-floating leaves count as finite), or
        ``None`` when not asked for.
      grad_max: float32, the largest unscaled magnitude (inf when a gradient
        is not finite).
      sq_norm: float32, the squared global norm of the unscaled gradients, or
        ``None`` when it was not asked for.
      underflow: float32[2], the fractions of gradient elements that are
        exactly 0 and whose scaled magnitude is below float16's smallest
        normal (6.1e-5), or ``None`` when not asked for.
    """

    finite: jax.Array
    leaf_finite: jax.Array | None
    grad_max: jax.Array
    sq_norm: jax.Array | None
    underflow: jax.Array | None = None


FLOAT16_TINY = float(jnp.finfo(jnp.float16).tiny)


# Leaves of at most this many elements are checked together, a few per
# reduction: a reduction per leaf is one kernel (and on XLA:CPU about 2 ms of
# compile time) each, which dominates for trees of many small leaves (biases,
# norms). The bound is below the HLO budget's parameter-sized buffers, so
# that the copy that batches them is never a pass over a large buffer.
SMALL_LEAF = 2**14


class _Batch(NamedTuple):
    """Leaves checked by one set of reductions: ``values[j]`` holds leaf
    ``indices[j]``, a large leaf in its own shape, small ones flattened and
    padded with zeros to the batch's width (zeros are finite, do not raise
    the peak and add nothing to a norm; ``padding`` counts them per row).
    Each row is reduced over all its axes. ``parts`` are the same leaves
    unbatched: the big leaf's ``values``, or the small leaves themselves
    (which a GPU's check reads without stacking them, ``_check_gpu``)."""

    indices: list[int]
    values: jax.Array
    padding: np.ndarray
    sharded: bool
    parts: list[jax.Array]


def _batches(leaves: list, axis_name: AxisName | None) -> list[_Batch]:
    """Big leaves one by one, in their own shape; small leaves of the same
    dtype, ``shard_map`` axis type and power-of-two size class stacked into
    one array.

    A big leaf is not flattened: a reshape fixes the order of the read to
    the logical row-major one, and a gradient that XLA keeps transposed in
    memory (a float16 weight gradient on XLA:CPU: the dot's output, read
    through a transpose) is then read a row apart per element. Reduced over
    its own axes, it is read in memory order: on a 2048x2048 float16 weight
    gradient, 2.6 ms against 25 ms flattened (2-core x86, jaxlib 0.10.2)."""
    batches, buckets = [], {}
    for i, x in enumerate(leaves):
        if not is_float_leaf(x):
            continue
        varying = varying_axes(jax.typeof(x))
        sharded = axis_name is not None and bool(axis_names(axis_name) & varying)
        if x.size > SMALL_LEAF:
            batches.append(_Batch([i], x[None], np.zeros(1), sharded, [x[None]]))
        else:
            width = 1 << max(x.size - 1, 0).bit_length()
            buckets.setdefault((x.dtype, varying, width), []).append(i)
    for width, indices in _merge_small_classes(buckets):
        rows = [leaves[i].reshape(-1) for i in indices]
        if len(rows) == 1:
            values, padding = rows[0].reshape(1, -1), np.zeros(1)
        else:
            values = jnp.stack([jnp.pad(row, (0, width - row.size)) for row in rows])
            padding = np.array([width - row.size for row in rows], np.float32)
        sharded = axis_name is not None and bool(axis_names(axis_name) & varying_axes(jax.typeof(values)))
        batches.append(_Batch(indices, values, padding, sharded, [leaves[i] for i in indices]))
    return batches


def _merge_small_classes(buckets: dict[tuple, list[int]]) -> list[tuple[int, list[int]]]:
    """``(width, indices)`` per batch of small leaves: the size classes of
    one dtype and axis type, narrowest first, merged while the merged batch,
    padded to its widest class, holds at most ``SMALL_LEAF`` elements (one
    reduction instead of one per class, where padding costs nothing)."""
    merged: list[tuple[int, list[int]]] = []
    open_batches: dict[tuple, int] = {}
    for (dtype, varying, width), indices in sorted(buckets.items(), key=lambda item: item[0][2]):
        key = (dtype, varying)
        at = open_batches.get(key)
        if at is not None and (len(merged[at][1]) + len(indices)) * width <= SMALL_LEAF:
            merged[at] = (width, merged[at][1] + indices)
        else:
            open_batches[key] = len(merged)
            merged.append((width, list(indices)))
    return merged


def gradient_stats(
    tree: PyTree,
    scale: jax.Array,
    with_norm: bool = False,
    with_underflow: bool = False,
    axis_name: AxisName | None = None,
    per_leaf: bool = True,
) -> GradStats:
    """The finite check, the largest magnitude and optionally the norm and
    the underflow fractions.

    Each floating leaf is read once by ``peak_and_finite`` (small leaves a
    few at a time, see ``SMALL_LEAF``); the optional statistics add
    reductions over the same values (XLA can fuse them into one read, but
    that depends on the backend).

    A leaf is finite once unscaled exactly when its elements are finite and
    its peak, unscaled as the elements are (in at least float32, then back to
    the leaf's dtype), is finite: the unscale is monotonic, so the largest
    unscaled magnitude is the unscaled largest magnitude. That catches a
    finite gradient that overflows when divided by a scale below 1.

    Without ``per_leaf`` no flag per leaf is kept: the batches of each
    dtype give one peak and one flag (``_peak_of_batches``).

    With ``axis_name`` (inside ``shard_map`` or ``pmap``) every replica gets
    the same flags and maximum, so all take the same branch and keep the same
    scale. The norm and the underflow counts add up the leaves that JAX types
    as varying along the axis (slices of a sharded parameter) over it; the
    others are replicated, and counted once.
    """
    leaves = jax.tree.leaves(tree)
    # Peaks grouped by dtype and unscaled one group at a time: one vector op
    # per dtype rather than one scalar op (one GPU kernel) per leaf.
    # With per_leaf, (indices, peaks, flags) per batch; without, the batches.
    groups: dict[jnp.dtype, list] = {}
    # Sums (square norm, zeros, below float16's normal, elements), split by
    # whether they are added up over the axis.
    sums = {False: [], True: []}
    for batch in _batches(leaves, axis_name):
        values = batch.values
        if per_leaf:
            peak, finite = peak_and_finite(values, tuple(range(1, values.ndim)))
            groups.setdefault(peak.dtype, []).append((batch.indices, peak, finite))
        else:
            groups.setdefault(jnp.finfo(values.dtype).dtype, []).append(batch)
        if with_norm or with_underflow:
            row = []
            if with_norm:
                unscaled = unscale_leaf(values, scale).astype(unscale_dtype(values.dtype))  # as the inner sees it
                # Non-finite elements are left out of the differentiable sum
                # and the norm made inf below: squaring an inf would put
                # 0 * inf = nan into the gradient of an update differentiated
                # through a skipped step with clipping.
                unscaled = jnp.where(jnp.isfinite(unscaled), unscaled, 0)
                row.append(jnp.sum(jnp.real(unscaled * jnp.conj(unscaled)), dtype=jnp.float32))
            if with_underflow:
                magnitudes = magnitude(values)
                pad = float(batch.padding.sum())
                row += [
                    jnp.sum(magnitudes == 0, dtype=jnp.float32) - pad,
                    jnp.sum(magnitudes < FLOAT16_TINY, dtype=jnp.float32) - pad,
                    jnp.float32(values.size - pad),
                ]
            sums[batch.sharded].append(jnp.stack(row))
    if not per_leaf:
        totals = _totals(sums, with_norm, with_underflow, axis_name)
        return _combined_stats(groups, scale, axis_name, totals, with_norm, with_underflow)
    order, flags, maxima = [], [], []
    for dtype, items in groups.items():
        # The peaks unscaled as the elements are, and rounded to their dtype
        # on its grid in at least float32 (``_grid``: a cast round trip
        # would not round on a GPU, and a half gradient that overflows
        # there once unscaled would pass as finite).
        unscaled = nearest_on_grid(unscaled_value(jnp.concatenate([peak for _, peak, _ in items]), scale), dtype)
        finite = jnp.concatenate([finite for _, _, finite in items]) & jnp.isfinite(unscaled)
        order += [i for indices, _, _ in items for i in indices]
        flags.append(finite)
        maxima.append(jnp.where(finite, unscaled.astype(jnp.float32), jnp.inf))
    taken = set(order)
    others = [i for i in range(len(leaves)) if i not in taken]  # non-floating leaves: finite
    flags.append(jnp.ones((len(others),), jnp.bool_))
    leaf_finite = jnp.concatenate(flags)
    if order + others != list(range(len(leaves))):
        leaf_finite = leaf_finite[np.argsort(order + others)]  # back to leaf order
    grad_max = jnp.max(jnp.concatenate(maxima)) if maxima else jnp.zeros((), jnp.float32)
    if axis_name is not None:
        leaf_finite = jax.lax.pmin(leaf_finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
        grad_max = jax.lax.pmax(grad_max, axis_name)
    finite = jnp.all(leaf_finite)
    totals = _totals(sums, with_norm, with_underflow, axis_name)
    sq_norm, underflow = _finish_sums(totals, finite, with_norm, with_underflow)
    return GradStats(finite, leaf_finite, grad_max, sq_norm, underflow)


def _totals(sums: dict[bool, list], with_norm: bool, with_underflow: bool, axis_name: AxisName | None) -> jax.Array:
    """The batches' sums added up, those of sharded batches over ``axis_name``."""
    totals = jnp.zeros((int(with_norm) + 3 * int(with_underflow),), jnp.float32)
    if sums[True]:
        totals = totals + jax.lax.psum(jnp.sum(jnp.stack(sums[True]), axis=0), axis_name)
    if sums[False]:
        totals = totals + jnp.sum(jnp.stack(sums[False]), axis=0)
    return totals


def _finish_sums(
    totals: jax.Array, finite: jax.Array, with_norm: bool, with_underflow: bool
) -> tuple[jax.Array | None, jax.Array | None]:
    """``(sq_norm, underflow)`` from the added-up sums."""
    width = totals.shape[0]
    sq_norm = jnp.where(finite, totals[0], jnp.inf) if with_norm else None
    underflow = None
    if with_underflow:
        zeros, tiny, count = totals[width - 3], totals[width - 2], totals[width - 1]
        underflow = jnp.stack([zeros, tiny]) / jnp.maximum(count, 1)
    return sq_norm, underflow


def _combined(reduction, values: list[jax.Array]) -> jax.Array:
    """``reduction`` (``jnp.max``, ``jnp.all``) over scalars: one reduction
    of their stack, one small kernel.

    Every leaf's update kernel reads the result (the decision). A tree of
    elementwise operations instead (also one kernel, in the program XLA
    makes) is a producer that XLA:GPU's fusion pass weighs fusing into each
    of those kernels, again whenever one of them changes: on a 125-leaf
    transformer's update that pass took 5x bare Adam's time, and the
    whole compile 3x. A reduction is not fused into its readers."""
    if len(values) == 1:
        return values[0]
    return reduction(jnp.stack(values))


def _reduced_whole(*batches: jax.Array) -> tuple[jax.Array, jax.Array]:
    pairs = [peak_and_finite(b, tuple(range(b.ndim))) for b in batches]
    return _combined(jnp.max, [peak for peak, _ in pairs]), _combined(jnp.all, [flag for _, flag in pairs])


def _peak_of_batches(batches: list[_Batch]) -> tuple[jax.Array, jax.Array]:
    """``(max|x|, all(isfinite(x)))`` over every element of ``batches`` (of
    one real dtype), each element read once.

    On XLA:GPU a reduction of a whole large array is two kernels (XLA splits
    it to use the whole GPU), a reduction of its rows one. There each big
    leaf is reduced over its rows (its leading axis kept), small leaves at
    most ``SMALL_LEAVES_PER_KERNEL`` to a kernel, and one kernel writes
    their results into one array, which one more reduction reads. On an
    H100 that halves what the check adds to an update (a 160-leaf tree:
    +165 kernels to +90; ``benchmarks/hlo_kernels.py --target h100``).
    Elsewhere (XLA:CPU, TPU) each batch is reduced whole, in one loop, and
    the scalar results are combined (``_combined``); each platform's
    program holds only its own form."""
    stacked = [batch.values for batch in batches]
    parts = [part for batch in batches for part in batch.parts]

    def whole(*arrays):
        return _reduced_whole(*arrays[: len(stacked)])

    def gpu(*arrays):
        if not any(by_rows(b.values) for b in batches) and all(
            len(b.parts) <= SMALL_LEAVES_PER_KERNEL for b in batches
        ):
            return whole(*arrays)  # no row to save: each batch is one kernel already
        groups, at = [], len(stacked)
        for batch in batches:
            groups.append((batch.parts[0].size > SMALL_LEAF, list(arrays[at : at + len(batch.parts)])))
            at += len(batch.parts)
        return reduced_by_rows(groups)

    return jax.lax.platform_dependent(*stacked, *parts, cuda=gpu, rocm=gpu, default=whole)


def _combined_stats(
    groups: dict, scale: jax.Array, axis_name: AxisName | None, totals: jax.Array, with_norm: bool, with_underflow: bool
) -> GradStats:
    """``GradStats`` without flags per leaf, from the batches of each dtype:
    each dtype's largest peak is unscaled (the unscale is monotonic, so the
    largest unscaled magnitude is the unscaled largest magnitude)."""
    finite, maxima = [], []
    for dtype, batches in groups.items():
        peak, flag = _peak_of_batches(batches)
        unscaled = nearest_on_grid(unscaled_value(peak, scale), dtype)
        ok = flag & jnp.isfinite(unscaled)
        finite.append(ok)
        maxima.append(jnp.where(ok, unscaled.astype(jnp.float32), jnp.inf))
    all_finite = _combined(jnp.all, finite) if finite else jnp.array(True)
    grad_max = _combined(jnp.max, maxima) if maxima else jnp.zeros((), jnp.float32)
    if axis_name is not None:
        all_finite = jax.lax.pmin(all_finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
        grad_max = jax.lax.pmax(grad_max, axis_name)
    sq_norm, underflow = _finish_sums(totals, all_finite, with_norm, with_underflow)
    return GradStats(all_finite, None, grad_max, sq_norm, underflow)

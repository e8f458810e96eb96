"""Per-segment loss scaling: a scale per part of the backward pass
(``loss_scale.predictive(..., segments=...)``).

The global scale follows ``PredictiveRule`` exactly, fed the peak the
backward pass would have had at the global scale alone (each segment's
measured peak with its boundaries' factors divided out): it is the scale
one global scale would take. On every measuring step the boundaries'
exponents are then set from the measured peaks of the segments, so that
each segment's largest cotangent sits ``min_headroom + extra_headroom``
binades below the overflow threshold; they lift the segments whose
cotangents are smaller than the largest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._rules import RuleState
from loss_scale._rules.predictive import PredictiveCounters, PredictiveRule, _ceil_log2
from loss_scale._rules.segment_names import encode_names
from loss_scale._rules.segment_table import SegmentTable

# Exponents stay within this, far inside float32's range.
MAX_EXPONENT = 64
# A measurement lowers an exponent at once, and raises it by one binade
# (the batches between measurements may need less than this one did), or
# by up to STARVED_CLIMB while the parts it decides are starved (their peak
# more than STARVED binades below the threshold: subnormal or flushed
# values, nowhere near an overflow). An overflow measured in a part lowers
# the nearest boundary above it by OVERFLOW_BACKOFF.
CLIMB = 1
STARVED_CLIMB = 16
STARVED = 20
OVERFLOW_BACKOFF = 4
MARGIN_STEP = 1
# The headroom a boundary's parts keep at first on top of the global
# rule's: they are measured once every few steps, and the batches between
# vary.
INITIAL_MARGIN = 2
# No part is lifted above 2**MAX_CUMULATIVE: a part that needs more holds
# cotangents so far below the loss's that its contributions to the
# gradients, brought back to the global scale in float32, are below
# float32's range (flushed in a float32 run too); lifting it would only
# risk overflows.
MAX_CUMULATIVE = 100


@jax.tree_util.register_pytree_node_class
class SegmentPeaks:
    """What a measuring step saw of the cotangents in each part of the
    backward pass, as ``loss_scale.value_grad_and_peak`` returns it for an
    optimizer with segments (pass it on as ``tx.update(...,
    backward_peak=peaks)``).

    The parts are the distinct *potentials* of the backward pass's values:
    ``keys[k][i]`` counts how often the paths from such a value to the loss
    cross boundary ``names[i]`` (twice for a value two steps further back in
    a scan whose body holds the boundary); its cotangents carry the global
    scale times ``2**(keys[k] @ exponents)``. ``keys[0]`` is all zeros: the
    loss's own segment. ``keys`` and ``names`` are static (pytree
    metadata); the rest are float32[K] arrays.

    Attributes:
      keys: the potentials, a tuple of K tuples of ``len(names)`` ints.
      names: the boundaries' names.
      peak: the largest scaled cotangent magnitude in each part (inf if one
        was not finite; 0 where the step did not measure).
      zeros: how many cotangent elements were exactly 0.
      below_normal: how many were below the compute dtype's smallest normal
        (flushed to zero, or subnormal).
      count: how many elements were measured.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     h = ls.segment(jnp.tanh(x.astype(jnp.float16) @ w["embed"].astype(jnp.float16)), "embed")
      ...     return jnp.mean((h @ w["head"].astype(jnp.float16)).astype(jnp.float32) ** 2)
      >>> w = {"embed": jnp.ones((3, 4)) / 4, "head": jnp.ones((4, 2))}
      >>> tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0, segments=("embed",))
      >>> _, grads, peaks = ls.value_grad_and_peak(loss_fn)(tx.init(w), w, jnp.ones((5, 3)))
      >>> peaks.names, peaks.keys  # the loss's own segment, and below the boundary
      (('embed',), ((0,), (1,)))
      >>> [round(float(p), 2) for p in peaks.peak]  # largest scaled cotangent of each
      [1.61, 3.03]
    """

    def __init__(
        self,
        keys: tuple[tuple[int, ...], ...],
        names: tuple[str, ...],
        peak: jax.Array,
        zeros: jax.Array,
        below_normal: jax.Array,
        count: jax.Array,
    ):
        self.keys = tuple(tuple(int(c) for c in key) for key in keys)
        self.names = tuple(names)
        self.peak, self.zeros, self.below_normal, self.count = peak, zeros, below_normal, count

    def tree_flatten(self):
        return (self.peak, self.zeros, self.below_normal, self.count), (self.keys, self.names)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, *children)

    @property
    def key_matrix(self) -> np.ndarray:
        """``keys`` as an int32[K, len(names)] array."""
        return np.asarray(self.keys, np.int32).reshape(len(self.keys), len(self.names))

    def __repr__(self) -> str:
        return f"SegmentPeaks(keys={self.keys}, names={self.names}, peak={self.peak!r})"

    def peak_of_loss_segment(self) -> jax.Array:
        """The peak of the loss's own segment (``keys[0]``)."""
        return self.peak[0]


class SegmentCounters(NamedTuple):
    """The per-segment rule's counters: ``PredictiveCounters``' fields (the
    global scale's), then the segments' table.

    Attributes:
      headroom: as in ``PredictiveCounters`` (the global scale's).
      grad_peak: as in ``PredictiveCounters``.
      searching: as in ``PredictiveCounters``.
      overflow_run: as in ``PredictiveCounters``.
      extra_headroom: as in ``PredictiveCounters``.
      measured: as in ``PredictiveCounters``.
      segments: a ``SegmentTable``: each boundary's exponent and margin, and
        each segment's last measurement.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> state = ls.predictive(optax.sgd(0.1), segments=("embed",)).init(jnp.zeros(2))
      >>> type(state.counters).__name__, state.counters._fields[-1]
      ('SegmentCounters', 'segments')
      >>> {name: int(e) for name, e in state.counters.segment_exponents.items()}
      {'embed': 0}
    """

    headroom: jax.Array
    grad_peak: jax.Array
    searching: jax.Array
    overflow_run: jax.Array
    extra_headroom: jax.Array
    measured: jax.Array
    segments: SegmentTable

    @property
    def segment_exponents(self) -> dict[str, jax.Array]:
        """``{boundary name: int32 exponent}`` (arrays; works under ``jit``)."""
        return {name: self.segments.exponent[i] for i, name in enumerate(self.segments.names)}


_PREDICTIVE_FIELDS = len(PredictiveCounters._fields)


@dataclasses.dataclass(frozen=True)
class SegmentedRule(PredictiveRule):
    """``PredictiveRule`` for the global scale, plus an exponent per
    boundary in ``segments``, set on every clean measuring step from the
    measured peaks (``SegmentPeaks``).

    Each part ``k`` of the backward pass (a potential ``c_k``) measured at
    the cumulative scale ``S * 2**(c_k @ e)`` had an unscaled peak ``u_k``;
    its target is the largest exponent ``t_k`` with ``u_k * 2**t_k`` at
    least ``min_headroom + extra_headroom`` binades below the threshold.
    With ``a = ceil(log2(S))`` for the new global scale, the exponents are
    chosen boundary by boundary, nearest to the loss first (by the fewest
    crossings of any part that crosses it): boundary ``m`` gets the largest
    ``e_m`` for which every measured part whose other boundaries are already
    chosen stays within its target, ``a + c_k @ e <= t_k``: lowered at
    once, raised by one binade a measurement (the batches until the next
    measurement may need less than this one did), or by up to 16 while the
    parts it decides are starved (their largest cotangent 20 binades or
    more below the threshold). A boundary with no measured part keeps its
    exponent. Between measurements, and on a
    step that overflows, the exponents stay; the global scale backs off as
    ``PredictiveRule``'s does, which lowers every segment alike, and the
    next step (``good_steps`` 0) measures again. An overflow that a
    measuring step locates below the loss's own part is the boundaries'
    business, not the global scale's: the exponent of the boundary nearest
    to the loss among those deciding an overflowing part comes down by
    ``OVERFLOW_BACKOFF`` and the parts it decides keep a binade more of
    headroom from then on (``SegmentTable.margin``: what that boundary's
    parts vary by from batch to batch, learned), and the global rule
    counts the step as clean (the step itself is skipped all the same). An
    overflow on a step that did not measure backs the global scale off for
    that step as ``PredictiveRule`` does, but what it teaches goes to every
    boundary's margin (a binade each) instead of the global rule's extra
    headroom, which would lower the global scale for good.
    """

    segments: tuple[str, ...] = ()

    def init(self) -> RuleState:
        start = super().init()
        n = len(self.segments)
        table = SegmentTable(
            self.segments,
            jnp.zeros((n,), jnp.int32),
            jnp.full((n,), INITIAL_MARGIN, jnp.int32),
            *(jnp.zeros((n + 1,), jnp.float32) for _ in range(3)),
            jnp.asarray(encode_names(self.segments)),
        )
        return RuleState(start.scale, start.good_steps, SegmentCounters(*start.counters, table))

    def adjust(self, state: RuleState, finite: jax.Array, grad_max: jax.Array, backward_peak: Any = None) -> RuleState:
        scale, good_steps, counters = state
        peaks = backward_peak if isinstance(backward_peak, SegmentPeaks) else None
        if peaks is not None and peaks.names != self.segments:
            raise ValueError(
                f"the measured peaks are of the segments {list(peaks.names)}, this optimizer's are "
                f"{list(self.segments)}: measure with this optimizer's state"
            )
        global_peak = backward_peak
        if peaks is not None:
            # The peak the backward pass would have had at the global scale
            # alone: the global scale is the one a single scale would take,
            # and the boundaries lift the segments that need more.
            global_peak = jnp.max(peaks.peak * jnp.ldexp(jnp.float32(1.0), -self._powers(peaks, counters)))
        global_finite = finite
        if peaks is not None and len(peaks.keys) > 0:
            # An overflow measured below the loss's own part is the
            # boundaries' business (the nearest one above it comes down,
            # below), not the global scale's: for it the step is clean.
            below = ~finite & jnp.isfinite(peaks.peak[0]) & ~jnp.all(jnp.isfinite(peaks.peak))
            global_finite = finite | below
            grad_max = jnp.where(below, 0.0, grad_max)
        predictive = PredictiveCounters(*counters[:_PREDICTIVE_FIELDS])
        moved = super().adjust(RuleState(scale, good_steps, predictive), global_finite, grad_max, global_peak)
        table = counters.segments
        if peaks is not None and len(peaks.keys) > 0 and self.segments:
            # An overflow on a step that did not measure may have been in any
            # part: the global scale backs off for the step as one scale's
            # does, but what it learns (extra headroom, which would lower it
            # for good) goes to every boundary's parts instead, a binade each.
            unmeasured = ~finite & jnp.all(peaks.peak == 0)
            moved = moved._replace(
                counters=moved.counters._replace(
                    extra_headroom=jnp.where(unmeasured, predictive.extra_headroom, moved.counters.extra_headroom)
                )
            )
            table = table.replace(
                margin=jnp.where(unmeasured, jnp.minimum(table.margin + MARGIN_STEP, MAX_EXPONENT), table.margin)
            )
        if peaks is not None and len(peaks.keys) > 0:
            # Only a step that measured something moves them (one branch,
            # so the other steps do not pay for the solve).
            measured = self._measured_parts(peaks, counters, scale, finite)
            table = jax.lax.cond(
                jnp.any(measured),
                lambda: self._segments(peaks, counters, moved, scale, measured),
                lambda: table,
            )
            # A measuring step that overflowed below the loss's own part: the
            # nearest boundary above the overflow comes down.
            table = jax.lax.cond(below, lambda: self._back_off(peaks, table), lambda: table)

        return RuleState(moved.scale, moved.good_steps, SegmentCounters(*moved.counters, table))

    def _back_off(self, peaks: SegmentPeaks, table: SegmentTable) -> SegmentTable:
        """``table`` with the exponent of the boundary nearest to the loss
        among those whose parts measured a non-finite peak lowered by
        ``OVERFLOW_BACKOFF`` (the parts below it saw the same inf)."""
        keys = peaks.key_matrix
        owner = segment_owners(keys)
        order = [m for m in _order(keys) if np.any(owner == m + 1)]
        if not order:
            return table
        bad = jnp.stack([~jnp.all(jnp.isfinite(peaks.peak[owner == m + 1])) for m in order])
        first = jnp.asarray(order)[jnp.argmax(bad)]
        lowered = jnp.maximum(table.exponent[first] - OVERFLOW_BACKOFF, -MAX_EXPONENT)
        exponent = jnp.where(jnp.any(bad), table.exponent.at[first].set(lowered), table.exponent)
        # ... and its parts keep MARGIN_STEP binades more headroom from now on.
        margin = jnp.where(jnp.any(bad), table.margin.at[first].add(MARGIN_STEP), table.margin)
        return table.replace(exponent=exponent.astype(jnp.int32), margin=jnp.minimum(margin, MAX_EXPONENT))

    def _unscaled(self, peaks: SegmentPeaks, counters: SegmentCounters, scale: jax.Array) -> jax.Array:
        """Each part's unscaled peak: its measured one over the cumulative
        scale it was measured at."""
        return peaks.peak / (scale * jnp.ldexp(jnp.float32(1.0), self._powers(peaks, counters)))

    def _measured_parts(
        self, peaks: SegmentPeaks, counters: SegmentCounters, scale: jax.Array, finite: jax.Array
    ) -> jax.Array:
        """Which parts the step measured: a finite, non-zero peak on a clean step."""
        unscaled = self._unscaled(peaks, counters, scale)
        return finite & (peaks.peak > 0) & jnp.isfinite(unscaled) & (unscaled > 0)

    def _powers(self, peaks: SegmentPeaks, counters: SegmentCounters) -> jax.Array:
        """Each part's exponent over the global scale, ``keys @ e``, int32[K]."""
        keys = peaks.key_matrix
        if not self.segments:
            return jnp.zeros((len(keys),), jnp.int32)
        return jnp.asarray(keys) @ counters.segments.exponent

    def _segments(
        self, peaks: SegmentPeaks, counters: SegmentCounters, moved: RuleState, scale: jax.Array, measured: jax.Array
    ) -> SegmentTable:
        """The exponents and statistics after a step that measured the parts
        ``measured``."""
        keys = peaks.key_matrix
        old = counters.segments.exponent if self.segments else None
        unscaled = self._unscaled(peaks, counters, scale)
        margin = self.min_headroom + moved.counters.extra_headroom
        target = jnp.where(measured, self._room(unscaled) - margin, 0)
        # Each part belongs to the deepest boundary it crosses (the loss's
        # segment, index 0, for none): that boundary's exponent decides it.
        owner = segment_owners(keys)
        new = old
        if old is not None:
            a = _ceil_log2(moved.scale)
            for m in _order(keys):
                mine = np.flatnonzero(owner == m + 1)
                if not mine.size:
                    continue
                c = keys[mine]
                others = jnp.asarray(np.delete(c, m, axis=1)) @ jnp.delete(new, m) if len(self.segments) > 1 else 0
                room = target[mine] - counters.segments.margin[m] - a - others
                best = jnp.floor_divide(room, jnp.asarray(c[:, m]))
                best = jnp.where(measured[mine], best, jnp.iinfo(jnp.int32).max)
                best = jnp.minimum(best, jnp.floor_divide(MAX_CUMULATIVE - a - others, jnp.asarray(c[:, m])))
                starved = jnp.all(
                    jnp.where(measured[mine], peaks.peak[mine] < self.overflow_threshold * 2.0**-STARVED, True)
                )
                climb = jnp.where(starved, STARVED_CLIMB, CLIMB)
                chosen = jnp.clip(jnp.minimum(jnp.min(best), old[m] + climb), -MAX_EXPONENT, MAX_EXPONENT)
                new = new.at[m].set(jnp.where(jnp.any(measured[mine]), chosen, new[m]).astype(jnp.int32))
        # Statistics per named segment.
        table = counters.segments
        values = {"peak": [], "zero_fraction": [], "below_normal_fraction": []}
        for s in range(len(self.segments) + 1):
            parts = np.flatnonzero(owner == s)
            if not parts.size:
                for field, column in values.items():
                    column.append(getattr(table, field)[s])
                continue
            count = jnp.maximum(jnp.sum(peaks.count[parts]), 1.0)
            values["peak"].append(jnp.max(jnp.where(measured, unscaled, 0.0)[parts]))
            values["zero_fraction"].append(jnp.sum(peaks.zeros[parts]) / count)
            values["below_normal_fraction"].append(jnp.sum(peaks.below_normal[parts]) / count)
        exponent = new.astype(jnp.int32) if new is not None else table.exponent
        return SegmentTable(
            self.segments,
            exponent,
            table.margin,
            *(jnp.stack(column).astype(jnp.float32) for column in values.values()),
            table.name_bytes,
        )


def _order(keys: np.ndarray) -> list[int]:
    """The boundaries nearest to the loss first: by the fewest crossings of
    any part that crosses them (ties in declaration order)."""
    totals = keys.sum(axis=1)
    depth = [int(totals[keys[:, m] > 0].min()) if np.any(keys[:, m] > 0) else 1 << 30 for m in range(keys.shape[1])]
    return sorted(range(keys.shape[1]), key=lambda m: (depth[m], m))


def segment_owners(keys: np.ndarray) -> np.ndarray:
    """Each part's segment: 0 (the loss's) for no crossing, else 1 + the
    deepest boundary it crosses (last in ``_order``)."""
    if keys.shape[1] == 0:
        return np.zeros(len(keys), np.int64)
    rank = {b: r for r, b in enumerate(_order(keys))}
    owners = []
    for key in keys:
        crossed = [b for b in range(len(key)) if key[b] > 0]
        owners.append(0 if not crossed else 1 + max(crossed, key=lambda b: rank[b]))
    return np.asarray(owners, np.int64)

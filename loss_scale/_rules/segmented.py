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
from loss_scale._types import LOSS_SEGMENT

# Exponents stay within this, far inside float32's range.
MAX_EXPONENT = 64


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
      >>> import jax.numpy as jnp
      >>> from loss_scale._rules.segmented import SegmentPeaks
      >>> p = SegmentPeaks(((0,), (1,)), ("embed",), *[jnp.array([1.0, 2.0])] * 4)
      >>> p.peak_of_loss_segment().item()
      1.0
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

    def __repr__(self) -> str:
        return f"SegmentPeaks(keys={self.keys}, names={self.names}, peak={self.peak!r})"

    def peak_of_loss_segment(self) -> jax.Array:
        """The peak of the loss's own segment (``keys[0]``)."""
        return self.peak[0]


class SegmentCounters(NamedTuple):
    """The per-segment rule's counters: ``PredictiveCounters``' fields (the
    global scale's), then the segments'.

    Attributes:
      headroom, grad_peak, searching, overflow_run, extra_headroom, measured:
        as in ``PredictiveCounters``.
      segment_exponents: dict name -> int32: boundary ``name`` multiplies the
        cotangents below it by ``2**exponent``.
      segment_peak: dict name -> float32: the largest *unscaled* cotangent
        magnitude of the segment at the last measurement (the segment of a
        value is the deepest boundary its paths to the loss cross;
        ``"loss"`` for the loss's own segment).
      segment_zero_fraction: dict name -> float32: the fraction of the
        segment's cotangent elements that were exactly 0 at the last
        measurement.
      segment_below_normal_fraction: dict name -> float32: the fraction below
        the compute dtype's smallest normal (flushed or subnormal).
    """

    headroom: jax.Array
    grad_peak: jax.Array
    searching: jax.Array
    overflow_run: jax.Array
    extra_headroom: jax.Array
    measured: jax.Array
    segment_exponents: dict[str, jax.Array]
    segment_peak: dict[str, jax.Array]
    segment_zero_fraction: dict[str, jax.Array]
    segment_below_normal_fraction: dict[str, jax.Array]


_PREDICTIVE_FIELDS = len(PredictiveCounters._fields)


@dataclasses.dataclass(frozen=True)
class SegmentedRule(PredictiveRule):
    """``PredictiveRule`` for the global scale, plus an exponent per
    boundary in ``segments``, set on every clean measuring step from the
    measured peaks (``SegmentPeaks``).

    Each part ``k`` of the backward pass (a potential ``c_k``) measured at
    the cumulative scale ``S * 2**(c_k @ e)`` had an unscaled peak ``u_k``;
    its target is the largest exponent ``t_k`` with ``u_k * 2**t_k`` at
    least ``min_headroom + extra_headroom * max(1, sum(c_k))`` binades below
    the threshold: what overflows taught counts once per boundary crossed,
    as a part many crossings deep moves with the batch-to-batch spread of
    every factor above it.
    With ``a = ceil(log2(S))`` for the new global scale, the exponents are
    chosen boundary by boundary, nearest to the loss first (by the fewest
    crossings of any part that crosses it): boundary ``m`` gets the largest
    ``e_m`` for which every measured part whose other boundaries are already
    chosen stays within its target, ``a + c_k @ e <= t_k``. A boundary with
    no measured part keeps its exponent. Between measurements, and on a
    step that overflows, the exponents stay; the global scale backs off as
    ``PredictiveRule``'s does, which lowers every segment alike, and the
    next step (``good_steps`` 0) measures again.
    """

    segments: tuple[str, ...] = ()

    def init(self) -> RuleState:
        start = super().init()
        names = (LOSS_SEGMENT, *self.segments)
        return RuleState(
            start.scale,
            start.good_steps,
            SegmentCounters(
                *start.counters,
                segment_exponents={name: jnp.zeros((), jnp.int32) for name in self.segments},
                segment_peak={name: jnp.zeros((), jnp.float32) for name in names},
                segment_zero_fraction={name: jnp.zeros((), jnp.float32) for name in names},
                segment_below_normal_fraction={name: jnp.zeros((), jnp.float32) for name in names},
            ),
        )

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
        predictive = PredictiveCounters(*counters[:_PREDICTIVE_FIELDS])
        moved = super().adjust(RuleState(scale, good_steps, predictive), finite, grad_max, global_peak)
        exponents = counters.segment_exponents
        stats = (counters.segment_peak, counters.segment_zero_fraction, counters.segment_below_normal_fraction)
        if peaks is not None and len(peaks.keys) > 0:
            exponents, stats = self._segments(peaks, counters, moved, scale, finite)
        return RuleState(moved.scale, moved.good_steps, SegmentCounters(*moved.counters, exponents, *stats))

    def _powers(self, peaks: SegmentPeaks, counters: SegmentCounters) -> jax.Array:
        """Each part's exponent over the global scale, ``keys @ e``, int32[K]."""
        keys = np.asarray(peaks.keys, np.int32).reshape(len(peaks.keys), len(self.segments))
        if not self.segments:
            return jnp.zeros((len(keys),), jnp.int32)
        return jnp.asarray(keys) @ jnp.stack([counters.segment_exponents[n] for n in self.segments])

    def _segments(
        self, peaks: SegmentPeaks, counters: SegmentCounters, moved: RuleState, scale: jax.Array, finite: jax.Array
    ) -> tuple[dict, tuple]:
        """The exponents and statistics after a step with measured peaks."""
        keys = np.asarray(peaks.keys, np.int32).reshape(len(peaks.keys), len(self.segments))
        old = jnp.stack([counters.segment_exponents[n] for n in self.segments]) if self.segments else None
        # Each part's unscaled peak: its measured one over the cumulative
        # scale it was measured at.
        unscaled = peaks.peak / (scale * jnp.ldexp(jnp.float32(1.0), self._powers(peaks, counters)))
        measured = finite & (peaks.peak > 0) & jnp.isfinite(unscaled) & (unscaled > 0)
        # What overflows taught compounds with the crossings: a part k
        # boundaries deep moves with k factors' worth of the batch-to-batch
        # spread, so each overflow adds a binade per crossing.
        crossings = np.maximum(keys.sum(axis=1), 1)
        margin = self.min_headroom + moved.counters.extra_headroom * jnp.asarray(crossings, jnp.int32)
        target = jnp.where(measured, self._room(unscaled) - margin, 0)
        new = old
        if old is not None:
            a = _ceil_log2(moved.scale)
            for m in _order(keys):
                mine = _parts_decided_by(keys, m)
                if not mine.size:
                    continue
                c = keys[mine]
                others = jnp.asarray(np.delete(c, m, axis=1)) @ jnp.delete(new, m) if len(self.segments) > 1 else 0
                room = target[mine] - a - others
                best = jnp.floor_divide(room, jnp.asarray(c[:, m]))
                best = jnp.where(measured[mine], best, jnp.iinfo(jnp.int32).max)
                chosen = jnp.clip(jnp.min(best), -MAX_EXPONENT, MAX_EXPONENT)
                new = new.at[m].set(jnp.where(jnp.any(measured[mine]), chosen, new[m]).astype(jnp.int32))
        step_measured = jnp.any(measured)
        exponents = {
            name: jnp.where(step_measured, new[i], old[i]).astype(jnp.int32) for i, name in enumerate(self.segments)
        }
        # Statistics per named segment: each part belongs to the deepest
        # boundary it crosses ("loss" for none).
        names = (LOSS_SEGMENT, *self.segments)
        owner = _owners(keys)
        stats = []
        for old_values, values, combine in (
            (counters.segment_peak, jnp.where(measured, unscaled, 0.0), "max"),
            (counters.segment_zero_fraction, peaks.zeros, "fraction"),
            (counters.segment_below_normal_fraction, peaks.below_normal, "fraction"),
        ):
            out = {}
            for s, name in enumerate(names):
                parts = np.flatnonzero(owner == s)
                if not parts.size:
                    out[name] = old_values[name]
                    continue
                if combine == "max":
                    value = jnp.max(values[parts])
                else:
                    value = jnp.sum(values[parts]) / jnp.maximum(jnp.sum(peaks.count[parts]), 1.0)
                out[name] = jnp.where(step_measured, value, old_values[name]).astype(jnp.float32)
            stats.append(out)
        return exponents, tuple(stats)


def _order(keys: np.ndarray) -> list[int]:
    """The boundaries nearest to the loss first: by the fewest crossings of
    any part that crosses them (ties in declaration order)."""
    totals = keys.sum(axis=1)
    depth = [int(totals[keys[:, m] > 0].min()) if np.any(keys[:, m] > 0) else 1 << 30 for m in range(keys.shape[1])]
    return sorted(range(keys.shape[1]), key=lambda m: (depth[m], m))


def _parts_decided_by(keys: np.ndarray, m: int) -> np.ndarray:
    """The parts whose last boundary in ``_order`` is ``m``."""
    rank = {b: r for r, b in enumerate(_order(keys))}
    found = []
    for k, key in enumerate(keys):
        crossed = [b for b in range(len(key)) if key[b] > 0]
        if crossed and max(crossed, key=lambda b: rank[b]) == m:
            found.append(k)
    return np.asarray(found, np.int64)


def _owners(keys: np.ndarray) -> np.ndarray:
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

"""Per-segment loss scaling: the gradient side.

``loss_scale.segment`` marks boundaries in a model; an optimizer built with
``loss_scale.predictive(..., segments=...)`` keeps an exponent per boundary
in its state (``SegmentCounters``). The library's gradient functions
(``value_and_grad``, ``value_grad_and_peak``, and their flax and Equinox
versions) then differentiate the loss through ``SegmentedGradient``: the
loss function is traced once, its boundaries found and every value's
segment worked out (``analysis.py``), and the jaxpr evaluated with the
boundaries' factors in force (``evaluate.py``), measuring each segment's
cotangents on measuring steps. A loss function without boundaries takes
the plain path, exactly as without segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._rules.segmented import SegmentCounters, SegmentPeaks
from loss_scale._segments.analysis import Analyser, SegmentError, has_marker
from loss_scale._segments.evaluate import STATS, Evaluator, new_probes
from loss_scale._segments.marker import cotangent_stats, segment
from loss_scale._sharding import axis_names, varying_axes
from loss_scale._signatures import over_leaves
from loss_scale._state import LossScaleState
from loss_scale._unscale import is_float_leaf

__all__ = ["SegmentError", "Segmented", "SegmentedGradient", "segment", "segment_names"]


def segment_names(state: LossScaleState) -> tuple[str, ...] | None:
    """The boundaries of a state with segments (sorted), ``None`` without."""
    counters = state.shapes().counters  # the names are static: no array is read
    if isinstance(counters, SegmentCounters):
        return counters.segments.names
    return None


class Segmented:
    """A loss function of a flat list of leaves, traced once and analysed:
    ``evaluate`` runs it with the boundaries' factors in force (a function
    whose ``jax.grad`` is the per-segment gradient), probing the values of
    ``compute_dtype`` when given probes. ``trace`` returns ``None`` for a
    function without boundaries."""

    @classmethod
    def trace(
        cls,
        fun: Callable[[list], Any],
        leaves: Sequence[Any],
        state: LossScaleState,
        differentiated: Sequence[bool] | None = None,
        compute_dtype: Any = jnp.float16,
    ) -> Segmented | None:
        names = segment_names(state)
        if names is None:
            return None
        exponents = state.counters.segment_exponents
        return cls.with_exponents(fun, leaves, exponents, differentiated, compute_dtype)

    @classmethod
    def with_exponents(
        cls,
        fun: Callable[[list], Any],
        leaves: Sequence[Any],
        exponents: dict[str, Any],
        differentiated: Sequence[bool] | None = None,
        compute_dtype: Any = jnp.float16,
    ) -> Segmented | None:
        """As ``trace``, with the boundaries' exponents given by name."""
        closed, out_shapes = jax.make_jaxpr(fun, return_shape=True)(list(leaves))
        if not has_marker(closed.jaxpr):
            return None
        if differentiated is None:
            differentiated = [is_float_leaf(x) for x in leaves]
        return cls(closed, out_shapes, leaves, differentiated, exponents, compute_dtype)

    def __init__(self, closed, out_shapes, leaves, differentiated, exponents, compute_dtype):
        self.closed = closed
        self.out_tree = jax.tree.structure(out_shapes)
        self.leaves = list(leaves)
        self.names = tuple(sorted(exponents))
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.exponents = jax.lax.stop_gradient(jnp.stack([jnp.asarray(exponents[n], jnp.int32) for n in self.names]))
        names = self.names
        self.analyser = Analyser(names)
        self.plan = self.analyser.analyse(closed, differentiated, loss=0)
        self._sites = None
        self.keys = {self.analyser.zero: 0}

    @property
    def sites(self) -> list:
        """The probe sites, found once (and the parts they fall in, ``keys``)."""
        if self._sites is None:
            discover = Evaluator(self.exponents, self.compute_dtype, measure=True, keys=self.keys)
            closed, plan = self.closed, self.plan
            jax.eval_shape(lambda leaves: discover.run(closed.jaxpr, closed.consts, leaves, plan), self.leaves)
            self._sites = discover.sites
        return self._sites

    def evaluate(self, leaves: Sequence[Any], probes: Sequence[jax.Array] | None = None) -> Any:
        """The function's output at ``leaves``; with ``probes`` (from
        ``new_probes(self.sites)``), measuring."""
        measure = probes is not None
        if measure:
            self.sites  # noqa: B018 - the keys are registered in site order
        evaluator = Evaluator(self.exponents, self.compute_dtype, measure=measure, probes=probes, keys=dict(self.keys))
        flat = evaluator.run(self.closed.jaxpr, self.closed.consts, list(leaves), self.plan)
        if measure and evaluator.used != len(probes):  # pragma: no cover - a trace that differs from the discovery
            raise RuntimeError(f"the evaluation took {evaluator.used} probes, the discovery found {len(probes)}")
        return jax.tree.unflatten(self.out_tree, flat)

    def unmeasured_peaks(self) -> SegmentPeaks:
        """The peaks of a step that does not measure: zeros, of the measured
        ones' structure."""
        self.sites  # noqa: B018 - the keys are registered in site order
        zeros = jnp.zeros((len(self.keys),), jnp.float32)
        return SegmentPeaks(self._key_tuple(), self.names, zeros, zeros, zeros, zeros)

    def _key_tuple(self) -> tuple[tuple[int, ...], ...]:
        return tuple(key for key, _ in sorted(self.keys.items(), key=lambda item: item[1]))

    def peaks(self, at_probes: Sequence[jax.Array], grads: Sequence[Any], axis_name: Any = None) -> SegmentPeaks:
        """Each part's statistics, from the probes' "cotangents" and the
        gradients of the parameters of the compute dtype (the loss's part)."""
        n_keys = len(self.keys)
        peak = jnp.zeros((n_keys,), jnp.float32)
        zeros = jnp.zeros((n_keys,), jnp.float32)
        below = jnp.zeros((n_keys,), jnp.float32)
        count = np.zeros((n_keys,), np.float32)
        for site, stats in zip(self.sites, at_probes, strict=True):
            if np.ndim(site.key) == 0:
                index, rows = np.asarray([site.key]), stats.reshape(1, STATS)
            else:
                live = np.flatnonzero(np.asarray(site.key) >= 0)
                index, rows = np.asarray(site.key)[live], stats[live]
            peak = peak.at[index].max(rows[:, 0])
            zeros = zeros.at[index].add(rows[:, 1])
            below = below.at[index].add(rows[:, 2])
            np.add.at(count, index, site.size)
        for g in grads:
            if hasattr(g, "dtype") and g.dtype == self.compute_dtype:
                g_peak, g_zeros, g_below = cotangent_stats(g)
                peak = peak.at[0].max(g_peak)
                zeros = zeros.at[0].add(g_zeros)
                below = below.at[0].add(g_below)
                count[0] += g.size
        count = jnp.asarray(count)
        axes = set(varying_axes(jax.typeof(peak)))
        if axis_name is not None:
            axes |= axis_names(axis_name)
        if axes:
            axes = tuple(sorted(axes, key=str))
            peak = jax.lax.pmax(peak, axes)
            zeros, below = jax.lax.psum(zeros, axes), jax.lax.psum(below, axes)
            count = jax.lax.psum(count, axes)
        return SegmentPeaks(self._key_tuple(), self.names, peak, zeros, below, count)


class SegmentedGradient:
    """``jax.grad`` of ``scaled`` (``(*args, **kwargs) -> (loss * scale,
    out)``) with respect to the arguments ``argnums``, with the boundaries
    of ``state`` in force; ``prepare`` returns ``None`` when the loss
    function has no boundary (or the state no segments).

    ``plain()`` and ``measured()`` give ``(grads, out)`` and ``(grads, out,
    SegmentPeaks)``; ``unmeasured_peaks()`` the peaks of a step that does
    not measure."""

    @classmethod
    def prepare(
        cls,
        scaled: Callable[..., tuple[jax.Array, Any]],
        argnums: int | Sequence[int],
        args: tuple,
        kwargs: dict,
        state: LossScaleState,
        compute_dtype: Any = jnp.float16,
        allow_int: bool = False,
    ) -> SegmentedGradient | None:
        if segment_names(state) is None:
            return None
        of_leaves, leaves, tree = over_leaves(scaled, argnums, args, kwargs)
        segmented = Segmented.trace(of_leaves, leaves, state, compute_dtype=compute_dtype)
        if segmented is None:
            return None
        return cls(segmented, tree, argnums, allow_int)

    def __init__(self, segmented: Segmented, tree: Any, argnums: int | Sequence[int], allow_int: bool):
        self.segmented, self.tree, self.argnums, self.allow_int = segmented, tree, argnums, allow_int

    def _grad(self, measure: bool) -> tuple[Any, Any, list]:
        segmented = self.segmented

        def objective(leaves, probes):
            return segmented.evaluate(leaves, probes if measure else None)

        probes = new_probes(segmented.sites) if measure else []
        grad = jax.grad(objective, argnums=(0, 1), has_aux=True, allow_int=self.allow_int)
        (at_leaves, at_probes), out = grad(segmented.leaves, probes)
        grads = tuple(jax.tree.unflatten(self.tree, at_leaves))
        if isinstance(self.argnums, int):
            (grads,) = grads
        return grads, out, at_probes

    def plain(self) -> tuple[Any, Any]:
        grads, out, _ = self._grad(False)
        return grads, out

    def measured(self, axis_name: Any = None) -> tuple[Any, Any, SegmentPeaks]:
        grads, out, at_probes = self._grad(True)
        return grads, out, self.segmented.peaks(at_probes, jax.tree.leaves(grads), axis_name)

    def unmeasured_peaks(self) -> SegmentPeaks:
        return self.segmented.unmeasured_peaks()

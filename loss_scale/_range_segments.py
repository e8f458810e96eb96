"""``range_report(..., segments=...)``: each row's segment (the deepest
boundary, ``loss_scale.segment``, its value's paths to the loss cross), and
the backward pass with the boundaries in force, measured segment by segment
(``SegmentRow``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale import _validate as validate
from loss_scale._range_rows import SegmentRow
from loss_scale._rules.segmented import segment_owners
from loss_scale._segments import Segmented
from loss_scale._segments.analysis import Analyser, all_potentials
from loss_scale._segments.evaluate import new_probes
from loss_scale._types import LOSS_SEGMENT
from loss_scale._unscale import unscale_dtype as _at_least_float32


def segment_exponents(segments: Mapping[str, int]) -> dict[str, int]:
    """``segments`` checked: each boundary's name and its exponent."""
    if not isinstance(segments, Mapping):
        raise TypeError(
            f"segments must map each boundary's name to its exponent (e.g. ls.find_state(opt_state)."
            f"segments.exponents()), got {type(segments).__name__}"
        )
    return {validate.segment_name("segments' name", name): int(e) for name, e in segments.items()}


def segment_labels(closed, differentiated, exponents, paths, n_arguments) -> list[str]:
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


def segment_rows(loss_of, arrays, differentiated, exponents, scale, dtype) -> list[SegmentRow]:
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

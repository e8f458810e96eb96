"""What ``range_report`` returns: a row per floating value (``RangeRow``),
a row per segment with its boundaries in force (``SegmentRow``), the report
(``RangeReport``) and its table (``format_report``)."""

from __future__ import annotations

import math
from typing import NamedTuple


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

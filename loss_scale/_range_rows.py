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
        module names where recorded, whole) and the user's file:line: the
        innermost line of the call stack outside jax, flax, Equinox, optax
        and this library (for a ``Dense``'s product, the line of your module
        that calls the layer).
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
      forward_overflows: whether the operation made a value that is not
        finite (beyond its dtype's largest value, or nan) from inputs that
        were all finite: the forward pass overflows here, at every loss
        scale (for an ``argument``: the argument is not finite). A value
        that is not finite because an input was not is ``forward_max`` inf
        without this flag.
      library: the library's ``file:line (function)`` that made the value
        (``flax/linen/linear.py:287 (Dense.__call__)``) when ``where``
        shows the user's line that called into it; ``""`` otherwise.

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
    forward_overflows: bool = False
    library: str = ""


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
    """What ``range_report`` returns; ``str(report)`` is a table: the
    operations that overflow in the forward pass first (all of them), then
    the widest offenders of the backward pass (least headroom) first.

    Attributes:
      rows: one ``RangeRow`` per differentiated argument leaf and per
        floating value on a path from them to the loss, in forward order.
      scale: the loss scale of the report's backward pass.
      max_safe_scale: the largest power of two at which no backward value
        overflows (``None`` when none down to ``2**-64`` is safe, e.g. when
        the backward pass is nan at every scale). It describes the backward
        pass only: a forward overflow (``forward_overflowing``) happens at
        every scale, so no scale makes such a step right, whatever this
        says; read ``forward_overflowing`` first.
      notes: what was evaluated inside (each operation a row) and what was
        kept whole (one row per output), and what that means for the
        table's numbers; one line each.
      segments: with ``segments``, one ``SegmentRow`` per segment: the
        backward pass with its boundaries in force (the rows are at the
        one scale ``scale``, so the two side by side show what the
        boundaries change); ``None`` otherwise.
      loss_finite: whether the loss itself is finite. Values that are not
        finite in the forward pass while it is were absorbed on the way (a
        mask filled with ``-inf`` and read by a softmax, a ``where`` that
        chose the other branch).
      inputs_finite: whether every floating array among the loss
        function's arguments is finite. When it is, a value that is not
        finite comes from the program itself: an operation that overflows
        (``forward_overflowing``) or a constant that is not finite in its
        dtype (a mask fill of ``-2.38e38`` cast to float16 is ``-inf``).

    Examples:
      A softmax written out, so that each of its operations is a row (from
      jax 0.12.1, ``jax.nn.softmax`` is a ``jax.custom_jvp`` function,
      which the report keeps whole: one row, ``custom_jvp_call``):

      >>> import jax, jax.numpy as jnp, loss_scale as ls
      >>> def softmax(z):
      ...     e = jnp.exp(z - z.max(axis=-1, keepdims=True))
      ...     return e / e.sum(axis=-1, keepdims=True)
      >>> loss_fn = lambda w, x: jnp.log(softmax(x @ w))[:, 0].mean()
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
    loss_finite: bool = True
    inputs_finite: bool = True

    @property
    def overflowing(self) -> list[RangeRow]:
        """The rows whose cotangent overflows at ``scale``, the one that
        overflows first as the scale grows (least headroom) first; among
        rows with the same headroom, the one the backward pass reaches
        first (latest in forward order) first."""
        rows = [r for r in self.rows if r.overflows]
        return sorted(rows, key=_backward_order)

    @property
    def forward_overflowing(self) -> list[RangeRow]:
        """The rows whose operation overflows in the forward pass
        (``RangeRow.forward_overflows``: a value that is not finite made
        from finite inputs), in forward order: the first is where the
        forward pass first goes wrong. No loss scale fixes these: the
        values are computed before the loss is scaled. Keep such an
        operation in float32 (``ls.full_precision``) or bring its inputs
        into range.

        Examples:
          >>> import jax.numpy as jnp, loss_scale as ls
          >>> loss_fn = lambda w, x: jnp.sum((x * w).astype(jnp.float16) ** 2)
          >>> report = ls.range_report(loss_fn, jnp.ones(4), jnp.full(4, 1000.0))
          >>> [(r.primitive, r.dtype, r.forward_max) for r in report.forward_overflowing]
          [('integer_pow', 'float16', inf)]
          >>> print(str(report).splitlines()[0])
          forward overflow: 1 operation overflows in the forward pass ...; first: integer_pow at <doctest...
        """
        return [r for r in self.rows if r.forward_overflows]

    def __str__(self) -> str:
        return format_report(self)


def _backward_order(row: RangeRow) -> tuple[float, int]:
    headroom = row.headroom if not math.isnan(row.headroom) else -1.0
    return (headroom, -row.index)


def _offender_order(row: RangeRow) -> tuple[int, float, int]:
    """Forward overflows first, in forward order; then ``_backward_order``."""
    if row.forward_overflows:
        return (0, 0.0, row.index)
    return (1, *_backward_order(row))


def _headline(report: RangeReport) -> list[str]:
    """The report's first lines: what overflows in the forward pass, if
    anything does (no loss scale fixes it), before the backward pass's
    count and safe scale."""
    safe = "none" if report.max_safe_scale is None else f"2**{int(math.log2(report.max_safe_scale))}"
    summary = (
        f"range report at scale {report.scale:g}: {len(report.rows)} values, "
        f"{sum(r.overflows for r in report.rows)} overflow; max safe scale {safe}"
    )
    first_lines, last_lines = [], []
    causes = report.forward_overflowing
    inherited = [r for r in report.rows if not math.isfinite(r.forward_max)]
    hidden = "; the loss is finite all the same: a later operation hides it" if report.loss_finite else ""
    if causes:
        n, first = len(causes), causes[0]
        first_lines.append(
            f"forward overflow: {n} operation{'s' if n > 1 else ''} overflow{'' if n > 1 else 's'} in the forward "
            f"pass (inf or nan from finite inputs), which no loss scale fixes; "
            f"first: {first.primitive} at {first.where}{hidden}"
        )
    elif inherited:
        origin = (
            "because an input of the loss function is"
            if not report.inputs_finite
            else "from a constant of the program that is not finite in its dtype (a fill value beyond the compute "
            "dtype's range: -2.38e38 is -inf in float16)"
        )
        first = f"first: {inherited[0].primitive} at {inherited[0].where}"
        if report.loss_finite:
            # Read where they change nothing (a softmax over a masked row, a
            # where that chose the other branch): a deliberate mask.
            last_lines.append(
                f"masked: {len(inherited)} values are inf or nan {origin}, and absorbed before the loss, which is "
                f"finite (a softmax or a where reads them): nothing to fix; {first}"
            )
        else:
            first_lines.append(
                f"forward pass not finite: {len(inherited)} values are inf or nan {origin}, and so is the loss "
                f"(no loss scale fixes it); {first}"
            )
    if first_lines:
        summary += " (of the backward pass alone)"
    return [*first_lines, summary, *last_lines]


_WHERE_WIDTH = 60


def _wrap(text: str, width: int = _WHERE_WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken after a
    ``/`` or ``]`` or at a space (not before a ``(``) where it can be, the
    lines after the first indented: a module path stays whole, on as many
    lines as it takes."""
    pieces, piece = [], ""
    for i, c in enumerate(text):
        piece += c
        if c in "/]" or (c == " " and not text.startswith("(", i + 1)):  # "file:line (function)" stays whole
            pieces.append(piece)
            piece = ""
    pieces.append(piece)
    lines, line = [], ""
    for piece in pieces:
        room = width - (2 if lines else 0)
        if line and len(line) + len(piece.rstrip()) > room:
            lines.append(line)
            line, room = "", width - 2
        while len(piece.rstrip()) > room:  # one name longer than a line: cut it
            lines.append(piece[:room])
            piece, room = piece[room:], width - 2
        line += piece
    lines.append(line)
    lines = [line.rstrip() for line in lines if line.strip()] or [""]
    return lines[:1] + ["  " + line for line in lines[1:]]


def _table(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Columns padded to their widest cell; a cell holding several lines
    (a wrapped ``where``) continues on the lines below, the other cells
    blank there."""
    cells = [[c.split("\n") for c in row] for row in [header, *body]]
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(len(header))]
    lines = []
    for row in cells:
        for k in range(max(len(c) for c in row)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(row, widths, strict=True)]
            lines.append("  ".join(parts).rstrip())
    return lines


def format_report(report: RangeReport, limit: int = 20) -> str:
    """The report as a table: every forward overflow first, in forward
    order, then the backward pass's rows, least headroom first (at most
    ``limit`` rows in all, forward overflows never left out). A ``where``
    longer than 60 characters continues on the lines below."""
    lines = _headline(report)
    if report.notes:
        lines.extend(report.notes.splitlines())
    labelled = report.segments is not None
    header = ("where", "op", "shape", "dtype", "fwd max", "bwd max", "bwd 0", "bwd <normal", "headroom", "")
    if labelled:
        header = ("segment", *header)
    ordered = sorted(report.rows, key=_offender_order)
    shown = max(limit, len(report.forward_overflowing))
    body = []
    for r in ordered[:shown]:
        flags = ["FORWARD OVERFLOW"] * r.forward_overflows + ["OVERFLOW"] * r.overflows
        body.append(
            ((r.segment,) if labelled else ())
            + (
                "\n".join(_wrap(r.where)),
                r.primitive,
                "x".join(map(str, r.shape)) or "()",
                r.dtype,
                f"{r.forward_max:.3g}",
                f"{r.backward_max:.3g}",
                f"{r.backward_zero:.0%}",
                f"{r.backward_below_normal:.0%}",
                "nan" if math.isnan(r.headroom) else f"{r.headroom:.3g}",
                ", ".join(flags),
            )
        )
    lines.extend(_table(header, body))
    if len(report.rows) > shown:
        lines.append(f"... {len(report.rows) - shown} more rows in report.rows")
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
        lines.extend(_table(header, body))
    return "\n".join(lines)

"""Which segment every value of a loss function's backward pass is in.

A boundary (``segment(x, name)``) multiplies the cotangent that flows
through it by ``2**e[name]``. The cotangent of a value then carries the
global scale times ``2**(c @ e)``, where ``c`` counts, per boundary, how
many times the paths from the value to the loss cross it: the value's
*potential*. Paths of different potentials must not meet in a sum (the
backward pass of a value used twice), or the sum would add cotangents of
different scales. Where they meet:

* at a value of at least 32 bits (a float32 parameter used on both sides
  of a boundary, a float32 value a scan reads at every step), each use's
  contribution is brought to the value's own potential with an exact power
  of two before the sum (a *rescale* of that use);
* at a 16-bit value, which cannot hold both scales, the analysis raises an
  error that names the value and says how to place the boundary instead.

The differentiated inputs (the parameters) are held at potential 0: every
use of a parameter in another segment is rescaled, so each gradient comes
out at the global scale, as with one scale, and the update needs nothing
new.

``analyse`` walks the jaxpr backwards from the loss. Calls of jitted
functions and ``jax.checkpoint`` are analysed inside, as are the branches of
``lax.cond``; ``lax.scan`` bodies are analysed once per iteration (a
boundary inside a body is crossed once more for every step further back,
so a body's potentials depend on the step). Other equations that hold a
jaxpr (``while_loop``, ``custom_jvp``/``custom_vjp`` functions,
``shard_map``) are taken whole: their inputs get their outputs' potential,
and a boundary inside them is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from loss_scale._jaxpr import (
    NO_LABELS,
    Frame,
    Interpreter,
    Labels,
    equations,
    is_dropped,
    is_literal,
    scan_params,
    sub_jaxprs,
    walk,
)
from loss_scale._probe import _describe
from loss_scale._segments import errors
from loss_scale._segments.errors import SegmentError
from loss_scale._segments.marker import marker_name
from loss_scale._segments.plan import OUT, Plan, Potential, ScanPlan, all_potentials

__all__ = [
    "CALLS",
    "OUT",
    "REMAT",
    "Analyser",
    "Plan",
    "Potential",
    "ScanPlan",
    "SegmentError",
    "all_potentials",
    "has_marker",
    "is_var",
]

# Calls analysed inside, and evaluated inside (entered) by the evaluation;
# checkpoints analysed inside, and rebuilt where their plan rewrites.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
REMAT = frozenset({"checkpoint", "remat2"})


def is_var(v: Any) -> bool:
    """Whether an equation's operand or output is a variable someone reads
    (not a literal, not ``_``)."""
    return not is_literal(v) and not is_dropped(v)


def _floating(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _wide(v: Any) -> bool:
    return jnp.finfo(v.aval.dtype).bits >= 32


def has_marker(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (open) holds a boundary at any depth."""
    return any(marker_name(eqn) is not None for eqn in equations(jaxpr))


def _dependence(jaxpr: Any, labels: Sequence[Labels]) -> dict[Any, Labels]:
    """Which differentiated inputs each variable of ``jaxpr`` depends on
    (its inputs labelled ``labels``, one label per differentiated input):
    an equation's outputs on those of all its inputs, through jaxprs taken
    whole too (an over-approximation the evaluation's probes share)."""
    return Interpreter().variable_labels(jaxpr, labels, Frame())


class Analyser:
    """Potentials over the boundaries ``names`` (index ``k`` counts
    crossings of ``names[k]``)."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        self.index = {name: k for k, name in enumerate(self.names)}
        self.zero: Potential = (0,) * len(self.names)

    def add(self, p: Potential, q: Potential) -> Potential:
        return tuple(a + b for a, b in zip(p, q, strict=True))

    def sub(self, p: Potential, q: Potential) -> Potential:
        return tuple(a - b for a, b in zip(p, q, strict=True))

    def describe(self, p: Potential) -> str:
        """A potential in words: ``"the loss's segment"``, ``"2 x rnn + embed"``."""
        parts = [f"{c} x {n}" if c != 1 else n for n, c in zip(self.names, p, strict=True) if c]
        return " + ".join(parts) if parts else "the loss's segment"

    def analyse(
        self,
        closed: Any,
        differentiated: Sequence[bool],
        loss: int = 0,
    ) -> Plan:
        """The plan of ``closed`` (a ``ClosedJaxpr``) whose output ``loss`` is
        the scaled loss (potential 0) and whose inputs ``differentiated`` are
        the parameters (held at potential 0)."""
        jaxpr = closed.jaxpr
        out = [None] * len(jaxpr.outvars)
        out[loss] = self.zero
        seeds = {i: self.zero for i, d in enumerate(differentiated) if d}
        labels = [frozenset({i}) if d else NO_LABELS for i, d in enumerate(differentiated)]
        return self._jaxpr(jaxpr, out, labels, seeds)

    # -- one jaxpr -------------------------------------------------------------

    def _jaxpr(
        self,
        jaxpr: Any,
        out_potentials: Sequence[Potential | None],
        in_labels: Sequence[Labels],
        seeds: dict[int, Potential] | None = None,
        in_scan: bool = False,
    ) -> Plan:
        """The plan of the open ``jaxpr`` whose outputs reach the loss at
        ``out_potentials``, its inputs labelled with the differentiated
        inputs they depend on (``in_labels``)."""
        labels = _dependence(jaxpr, in_labels)
        dependent = {v for v, tag in labels.items() if tag}
        plan = Plan({}, [], {}, {}, {}, {}, dependent)
        potentials = plan.potentials
        for i, p in (seeds or {}).items():
            potentials[jaxpr.invars[i]] = p
        seeded = {jaxpr.invars[i] for i in (seeds or {})}
        # The casts that made 16-bit values from wider ones, by the value.
        casts = {
            e.outvars[0]: e
            for _, e in walk(jaxpr)
            if e.primitive.name == "convert_element_type" and is_var(e.invars[0]) and _floating(e.invars[0])
        }

        def use(var: Any, p: Potential | None, position: tuple[int, int], eqn: Any) -> None:
            if p is None or not is_var(var) or var not in dependent or not _floating(var):
                return
            q = potentials.get(var)
            if q is None:
                potentials[var] = p
            elif q != p:
                if _wide(var):
                    plan.rescales[position] = self.sub(q, p)
                elif var in casts and _wide(casts[var].invars[0]) and position[0] != OUT:
                    # A cast of a wider value: this use casts its own copy,
                    # and the wider value takes the rescale.
                    plan.recasts[position] = casts[var]
                    use(casts[var].invars[0], p, position, eqn)
                else:
                    kind = errors.kind_of(var, jaxpr.invars, seeded)
                    raise errors.mixed(self.describe, var, q, p, eqn, kind)

        for j, (v, p) in enumerate(zip(jaxpr.outvars, out_potentials, strict=True)):
            use(v, p, (OUT, j), None)
        for i, eqn in walk(jaxpr, reverse=True):  # from the loss back
            outs = [potentials.get(v) if is_var(v) and v in dependent else None for v in eqn.outvars]
            if all(p is None for p in outs):
                continue
            eqn_labels = [labels.get(v, NO_LABELS) if is_var(v) else NO_LABELS for v in eqn.invars]
            used = self._equation(plan, i, eqn, outs, eqn_labels, in_scan)
            for (j, var), p in zip(enumerate(eqn.invars), used, strict=True):
                use(var, p, (i, j), eqn)
        plan.in_potentials = [potentials.get(v) for v in jaxpr.invars]
        return plan

    def _equation(
        self, plan: Plan, i: int, eqn: Any, outs: list, labels: list[Labels], in_scan: bool
    ) -> list[Potential | None]:
        """The potential at which each input of ``eqn`` (equation ``i``, its
        inputs labelled ``labels``) is used, given its outputs' (recording
        what its evaluation needs in ``plan``)."""
        name = marker_name(eqn)
        primitive = eqn.primitive.name
        if name is not None:
            if name not in self.index:
                raise errors.undeclared(self.names, name, eqn)
            plan.markers[i] = self.index[name]
            onehot = tuple(int(k == self.index[name]) for k in range(len(self.names)))
            return [None if p is None else self.add(p, onehot) for p in outs]
        bodies = sub_jaxprs(eqn.params)
        if primitive in CALLS | REMAT and len(bodies) == 1:
            return self._inner(plan, i, self._jaxpr(bodies[0], outs, labels, in_scan=in_scan), in_scan, eqn)
        if primitive == "cond" and bodies:
            return self._cond(plan, i, eqn, bodies, outs, labels, in_scan)
        if primitive == "scan" and has_marker(bodies[0]):
            if in_scan:
                raise SegmentError(
                    f"a boundary inside a lax.scan that runs inside another scan's body with boundaries "
                    f"({_describe(eqn, '')}): one level of scans with boundaries is supported; put the boundary "
                    "in the outer body"
                )
            return self._scan(plan, i, eqn, outs, labels)
        # Taken whole: every input meets the outputs' cotangents.
        for sub in bodies:
            if has_marker(sub):
                raise SegmentError(
                    f"a boundary (loss_scale.segment) inside {primitive} ({_describe(eqn, '')}), which per-segment "
                    "scaling takes whole: move the boundary outside it (boundaries work inside jax.jit, "
                    "jax.checkpoint, lax.cond and lax.scan bodies)"
                )
        live = {p for p in outs if p is not None}
        if len(live) > 1:
            first, second = sorted(live)[:2]
            raise SegmentError(
                f"the outputs of {primitive} ({_describe(eqn, '')}) reach the loss through segments of different "
                f"scales ({self.describe(first)}; {self.describe(second)}), so its inputs' cotangents would mix "
                "them: put a boundary on both outputs alike, or on its inputs instead"
            )
        (p,) = live
        if primitive == "scan" and not in_scan:
            # A scan without boundaries is bound whole, but a measuring step
            # looks inside it (a value inside can exceed its outputs': the
            # per-step gradient of a weight cast inside the body), every
            # step at the same potential as its outputs.
            (body_labels,) = Interpreter().body_labels(eqn, labels, Frame(), i)
            step = self._jaxpr(bodies[0], [p] * len(bodies[0].outvars), body_labels, in_scan=True)
            plan.inner[i] = ScanPlan([step] * scan_params(eqn.params).length, {})
        return [p] * len(eqn.invars)

    def _inner(self, plan: Plan, i: int, sub: Plan, in_scan: bool, eqn: Any) -> list[Potential | None]:
        if in_scan and sub.rewrites:
            raise SegmentError(
                f"a boundary (or a value used on both sides of one) inside {eqn.primitive.name} within a lax.scan "
                f"body with boundaries ({_describe(eqn, '')}): inside such a body, boundaries must be in the body "
                "itself"
            )
        plan.inner[i] = sub
        return list(sub.in_potentials)

    def _cond(
        self, plan: Plan, i: int, eqn: Any, bodies: list, outs: list, labels: list[Labels], in_scan: bool
    ) -> list[Potential | None]:
        branches = [self._jaxpr(b, outs, labels[1:], in_scan=in_scan) for b in bodies]
        potentials: list[Potential | None] = [None]  # the branch index
        for j, var in enumerate(eqn.invars[1:]):
            seen = [b.in_potentials[j] for b in branches if b.in_potentials[j] is not None]
            chosen = seen[0] if seen else None
            for b in branches:
                p = b.in_potentials[j]
                if p is not None and p != chosen:
                    if not _wide(var):
                        raise errors.mixed(self.describe, var, chosen, p, eqn, "value")
                    b.in_rescales[j] = self.sub(chosen, p)
            potentials.append(chosen)
        if in_scan and any(b.rewrites for b in branches):
            raise SegmentError(
                f"a boundary inside a lax.cond within a lax.scan body with boundaries ({_describe(eqn, '')}): "
                "inside such a body, boundaries must be in the body itself"
            )
        plan.inner[i] = branches
        return potentials

    def _scan(self, plan: Plan, i: int, eqn: Any, outs: list, labels: list[Labels]) -> list[Potential | None]:
        scan = scan_params(eqn.params)
        (body,) = sub_jaxprs(eqn.params)
        n_consts, n_carry, length = scan.num_consts, scan.num_carry, scan.length
        order = range(length) if scan.reverse else range(length - 1, -1, -1)
        (body_labels,) = Interpreter().body_labels(eqn, labels, Frame(), i)
        carry_out = list(outs[:n_carry])
        ys = list(outs[n_carry:])
        steps: list[Plan | None] = [None] * length
        for t in order:  # backwards through the iterations
            step = self._jaxpr(body, carry_out + ys, body_labels, in_scan=True)
            steps[t] = step
            carry_out = step.in_potentials[n_consts : n_consts + n_carry]
        first = steps[order[-1]]
        potentials: list[Potential | None] = []
        const_rescales = {}
        for j in range(n_consts):
            var = body.invars[j]
            seen = [(t, steps[t].in_potentials[j]) for t in order if steps[t].in_potentials[j] is not None]
            chosen = seen[0][1] if seen else None
            if any(p != chosen for _, p in seen):
                if not _wide(var):
                    t, p = next((t, p) for t, p in seen if p != chosen)
                    raise errors.mixed(self.describe, var, chosen, p, eqn, "value", step=t)
                table = np.zeros((length, len(self.names)), np.int32)
                for t, p in seen:
                    table[t] = self.sub(chosen, p)
                const_rescales[j] = table
            potentials.append(chosen)
        potentials += list(first.in_potentials[n_consts : n_consts + n_carry])
        for j in range(n_consts + n_carry, len(body.invars)):
            seen = {steps[t].in_potentials[j] for t in order} - {None}
            if len(seen) > 1:
                a, b = sorted(seen)[:2]
                raise SegmentError(
                    f"a per-step input (xs) of lax.scan ({_describe(eqn, '')}) reaches the loss through segments "
                    f"that change from step to step ({self.describe(a)}; {self.describe(b)}), and its cotangents "
                    "would be stacked at different scales: compute it inside the body from the scan's constants "
                    "(e.g. look the embedding up inside the body), or put the boundary outside the scan"
                )
            potentials.append(next(iter(seen)) if seen else None)
        plan.inner[i] = ScanPlan(steps, const_rescales)
        return potentials

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

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from loss_scale._jaxpr import sub_jaxprs
from loss_scale._probe import _describe
from loss_scale._segments.marker import call_site, marker_name

Potential = tuple[int, ...]

INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
REMAT = frozenset({"checkpoint", "remat", "remat2"})
# An output position of a jaxpr, in rescale keys: (OUT, j).
OUT = -1


class SegmentError(ValueError):
    """A loss function whose boundaries per-segment scaling cannot apply.

    Raised where the gradient functions (``loss_scale.value_and_grad``,
    ``loss_scale.value_grad_and_peak`` and their flax and Equinox versions)
    trace a loss function with the state of an optimizer built with
    ``segments``: a boundary whose name is not one of them (the message
    names the closest, and the error's traceback ends at the
    ``loss_scale.segment`` call), a 16-bit value used in two segments of
    different scales (a boundary inside one branch of a residual block), a
    boundary inside a ``while_loop``, a ``custom_vjp`` function or a nested
    ``scan``. The message names the value or the boundary, where the loss
    function makes it, and the fix. A ``ValueError``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.predictive(optax.sgd(0.1), segments=("encoder",))
      >>> params = {"w": jnp.ones(2)}
      >>> def loss_fn(p):
      ...     return jnp.sum(ls.segment(jnp.tanh(p["w"]), "encodr"))  # misspelt
      >>> try:
      ...     ls.value_and_grad(loss_fn)(tx.init(params), params)
      ... except ls.SegmentError as error:
      ...     print(error)
      <doctest ...>:2 (loss_fn): the loss function marks a boundary 'encodr' that
      is not one of the optimizer's segments ['encoder']. Did you mean 'encoder'?
      Otherwise add 'encodr' to the segments of loss_scale.predictive(...,
      segments=...).
    """


def _is_var(v: Any) -> bool:
    return not isinstance(v, jax.extend.core.Literal) and type(v).__name__ != "DropVar"


def _floating(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _wide(v: Any) -> bool:
    return jnp.finfo(v.aval.dtype).bits >= 32


def has_marker(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (open) holds a boundary at any depth."""
    for eqn in jaxpr.eqns:
        if marker_name(eqn) is not None:
            return True
        if any(has_marker(sub) for sub in sub_jaxprs(eqn.params)):
            return True
    return False


@dataclasses.dataclass
class Plan:
    """What the evaluation of one jaxpr needs, for given output potentials.

    Attributes:
      potentials: the potential of every value on a path from the
        differentiated inputs to the loss, by variable.
      in_potentials: the potential of each input (``None``: not on such a path).
      markers: boundary equations: equation index -> boundary index.
      rescales: ``(equation index, input index)`` (or ``(OUT, j)`` for
        output ``j``) -> the exponent vector by which that use's cotangent
        is rescaled (``2**(v @ e)``).
      in_rescales: input index -> exponent vector, applied to the input on
        entry (a ``cond`` branch whose input potential differs from the
        other branches').
      recasts: ``(equation index, input index)`` -> the equation that made
        that input, a cast of a wider value: the use reads a cast of its
        own, of the wider value rescaled (a float32 parameter cast to
        float16 once and used in two segments).
      inner: equation index -> the plan of a jaxpr evaluated inside (a call,
        ``jax.checkpoint``), a list of plans (``cond`` branches) or a
        ``ScanPlan``.
      dependent: the variables that depend on the differentiated inputs.
    """

    potentials: dict[Any, Potential]
    in_potentials: list[Potential | None]
    markers: dict[int, int]
    rescales: dict[tuple[int, int], Potential]
    in_rescales: dict[int, Potential]
    inner: dict[int, Any]
    dependent: set[Any]
    recasts: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)

    @property
    def rewrites(self) -> bool:
        """Whether evaluating the jaxpr differs from binding it whole."""
        return bool(self.markers or self.rescales or self.in_rescales or self.recasts) or any(
            _rewrites(inner) for inner in self.inner.values()
        )


def _rewrites(inner: Any) -> bool:
    if isinstance(inner, list):
        return any(p.rewrites for p in inner)
    return inner.rewrites


@dataclasses.dataclass
class ScanPlan:
    """A ``lax.scan`` body's plans, one per iteration (index ``t`` is the
    iteration, in the scan's own order), and what they share.

    Attributes:
      steps: the body's plan at each iteration.
      const_rescales: const index -> int array [T, n]: the exponent vector by
        which that const's cotangent is rescaled at each iteration (to the
        potential the scan's caller sees it at).
    """

    steps: list[Plan]
    const_rescales: dict[int, np.ndarray]

    @property
    def rewrites(self) -> bool:
        return bool(self.const_rescales) or any(p.rewrites for p in self.steps)


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
        return self._jaxpr(jaxpr, out, [bool(d) for d in differentiated], seeds, top=True)

    # -- one jaxpr -------------------------------------------------------------

    def _jaxpr(
        self,
        jaxpr: Any,
        out_potentials: Sequence[Potential | None],
        dependent_in: Sequence[bool],
        seeds: dict[int, Potential] | None = None,
        in_scan: bool = False,
        top: bool = False,
    ) -> Plan:
        dependent = _dependent(jaxpr, dependent_in)
        plan = Plan({}, [], {}, {}, {}, {}, dependent)
        potentials = plan.potentials
        for i, p in (seeds or {}).items():
            potentials[jaxpr.invars[i]] = p
        seeded = {jaxpr.invars[i] for i in (seeds or {})}
        # The casts that made 16-bit values from wider ones, by the value.
        casts = {
            e.outvars[0]: e
            for e in jaxpr.eqns
            if e.primitive.name == "convert_element_type" and _is_var(e.invars[0]) and _floating(e.invars[0])
        }

        def use(var: Any, p: Potential | None, position: tuple[int, int], eqn: Any) -> None:
            if p is None or not _is_var(var) or var not in dependent or not _floating(var):
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
                    raise self._mixed_error(var, q, p, eqn, _kind(var, jaxpr, seeded))

        for j, (v, p) in enumerate(zip(jaxpr.outvars, out_potentials, strict=True)):
            use(v, p, (OUT, j), None)
        for i in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[i]
            outs = [potentials.get(v) if _is_var(v) and v in dependent else None for v in eqn.outvars]
            if all(p is None for p in outs):
                continue
            for (j, var), p in zip(enumerate(eqn.invars), self._equation(plan, i, eqn, outs, in_scan), strict=True):
                use(var, p, (i, j), eqn)
        plan.in_potentials = [potentials.get(v) for v in jaxpr.invars]
        return plan

    def _equation(self, plan: Plan, i: int, eqn: Any, outs: list, in_scan: bool) -> list[Potential | None]:
        """The potential at which each input of ``eqn`` is used, given its
        outputs' (recording what its evaluation needs in ``plan``)."""
        name = marker_name(eqn)
        primitive = eqn.primitive.name
        dependent_in = [_is_var(v) and v in plan.dependent for v in eqn.invars]
        if name is not None:
            if name not in self.index:
                raise self._undeclared_error(name, eqn)
            plan.markers[i] = self.index[name]
            onehot = tuple(int(k == self.index[name]) for k in range(len(self.names)))
            return [None if p is None else self.add(p, onehot) for p in outs]
        if primitive in INLINED and INLINED[primitive] in eqn.params:
            inner = eqn.params[INLINED[primitive]]
            sub = self._jaxpr(inner.jaxpr, outs, dependent_in, in_scan=in_scan)
            return self._inner(plan, i, sub, in_scan, eqn)
        if primitive in REMAT and "jaxpr" in eqn.params:
            sub = self._jaxpr(eqn.params["jaxpr"], outs, dependent_in, in_scan=in_scan)
            return self._inner(plan, i, sub, in_scan, eqn)
        if primitive == "cond" and "branches" in eqn.params:
            return self._cond(plan, i, eqn, outs, dependent_in, in_scan)
        if primitive == "scan" and has_marker(eqn.params["jaxpr"].jaxpr):
            if in_scan:
                raise SegmentError(
                    f"a boundary inside a lax.scan that runs inside another scan's body with boundaries "
                    f"({_describe(eqn, '')}): one level of scans with boundaries is supported; put the boundary "
                    "in the outer body"
                )
            return self._scan(plan, i, eqn, outs, dependent_in)
        # Taken whole: every input meets the outputs' cotangents.
        for sub in sub_jaxprs(eqn.params):
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
            body = eqn.params["jaxpr"].jaxpr
            dependent_in = [_is_var(v) and v in plan.dependent for v in eqn.invars]
            dependent_body = _body_dependence(body, dependent_in, eqn.params["num_consts"], eqn.params["num_carry"])
            step = self._jaxpr(body, [p] * len(body.outvars), dependent_body, in_scan=True)
            plan.inner[i] = ScanPlan([step] * eqn.params["length"], {})
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
        self, plan: Plan, i: int, eqn: Any, outs: list, dependent_in: list[bool], in_scan: bool
    ) -> list[Potential | None]:
        branches = [self._jaxpr(b.jaxpr, outs, dependent_in[1:], in_scan=in_scan) for b in eqn.params["branches"]]
        potentials: list[Potential | None] = [None]  # the branch index
        for j, var in enumerate(eqn.invars[1:]):
            seen = [b.in_potentials[j] for b in branches if b.in_potentials[j] is not None]
            chosen = seen[0] if seen else None
            for b in branches:
                p = b.in_potentials[j]
                if p is not None and p != chosen:
                    if not _wide(var):
                        raise self._mixed_error(var, chosen, p, eqn, "value")
                    b.in_rescales[j] = self.sub(chosen, p)
            potentials.append(chosen)
        if in_scan and any(b.rewrites for b in branches):
            raise SegmentError(
                f"a boundary inside a lax.cond within a lax.scan body with boundaries ({_describe(eqn, '')}): "
                "inside such a body, boundaries must be in the body itself"
            )
        plan.inner[i] = branches
        return potentials

    def _scan(self, plan: Plan, i: int, eqn: Any, outs: list, dependent_in: list[bool]) -> list[Potential | None]:
        params = eqn.params
        body = params["jaxpr"].jaxpr
        n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
        order = range(length) if params["reverse"] else range(length - 1, -1, -1)
        dependent_body = _body_dependence(body, dependent_in, n_consts, n_carry)
        carry_out = list(outs[:n_carry])
        ys = list(outs[n_carry:])
        steps: list[Plan | None] = [None] * length
        for t in order:  # backwards through the iterations
            step = self._jaxpr(body, carry_out + ys, dependent_body, in_scan=True)
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
                    raise self._mixed_error(var, chosen, p, eqn, "value", step=t)
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

    def _undeclared_error(self, name: str, eqn: Any) -> SegmentError:
        """The error for a boundary whose name is not one of the optimizer's
        segments, at the user's ``segment`` call: named in the message, and
        the last frame of the error's traceback (the analysis runs after the
        loss function was traced, so the call is no longer on the stack)."""
        where, traceback = call_site(eqn)
        close = difflib.get_close_matches(name, self.names, n=1)
        fix = f"Did you mean {close[0]!r}? Otherwise add" if close else "Add"
        error = SegmentError(
            f"{where or _describe(eqn, '')}: the loss function marks a boundary {name!r} that is not one of the "
            f"optimizer's segments {list(self.names)}. {fix} {name!r} to the segments of "
            "loss_scale.predictive(..., segments=...)."
        )
        return error.with_traceback(traceback)

    def _mixed_error(
        self, var: Any, first: Potential, second: Potential, eqn: Any, kind: str, step: int | None = None
    ) -> SegmentError:
        """The error for a 16-bit ``var`` whose uses reach the loss through
        segments of different scales. ``kind`` is what ``var`` is:
        ``"parameter"`` (a differentiated input), ``"activation"`` (computed
        by the loss function) or ``"value"`` (an input of a function the
        loss calls, which may be either); the fix differs."""
        where = f" ({_describe(eqn, '')})" if eqn is not None else ""
        at = f" at scan step {step}" if step is not None else ""
        dtype, shape = var.aval.dtype, tuple(var.aval.shape)
        if kind == "parameter":
            used_in = self.describe(second if first == self.zero else first)
            return SegmentError(
                f"a parameter of dtype {dtype} and shape {shape} is used in segment {used_in}{at}{where}, and "
                f"per-segment scaling brings every parameter's gradient back to the global scale, which a {dtype} "
                "gradient cannot hold exactly. Keep parameters in float32 and cast them to float16 where they are "
                "used (the mixed-precision recipe)"
            )
        mixed = (
            f"of dtype {dtype} and shape {shape} is used in two segments of different scales{at} "
            f"({self.describe(first)}; {self.describe(second)}){where}: a boundary is on some of its paths to the "
            f"loss and not on others, so its cotangent would be the sum of cotangents of different scales, which a "
            f"{dtype} value cannot hold."
        )
        residual = (
            "put the boundary where every path from the value to the loss crosses it: for a boundary inside one "
            "branch of a residual block (h + f(h)), on the residual stream, after the residual addition "
            "(h = ls.segment(h + f(h), name)); or pass the value through the boundary with the branch's "
            "activations (ls.segment((out, h), name)) and use what it returns"
        )
        if kind == "activation":
            return SegmentError(
                f"an activation (a value the loss function computes, not a parameter) {mixed} "
                f"{residual[0].upper()}{residual[1:]}"
            )
        return SegmentError(
            f"a value {mixed} If it is an activation, {residual}. If it is a {dtype} parameter, keep it in float32 "
            "and cast it where it is used"
        )


def _kind(var: Any, jaxpr: Any, seeded: set) -> str:
    """What ``var`` of ``jaxpr`` is, for ``Analyser._mixed_error``: a
    parameter (seeded), an activation (computed in ``jaxpr``), or a value
    handed in to it."""
    if var in seeded:
        return "parameter"
    return "value" if var in jaxpr.invars else "activation"


def _dependent(jaxpr: Any, dependent_in: Sequence[bool]) -> set[Any]:
    """The variables of ``jaxpr`` that depend on its inputs marked in
    ``dependent_in``: an equation's outputs depend on it when any input
    does (over-approximating through jaxprs taken whole)."""
    dependent = {v for v, d in zip(jaxpr.invars, dependent_in, strict=True) if d}
    for eqn in jaxpr.eqns:
        if any(_is_var(v) and v in dependent for v in eqn.invars):
            dependent.update(v for v in eqn.outvars if _is_var(v))
    return dependent


def _body_dependence(body: Any, dependent_in: Sequence[bool], n_consts: int, n_carry: int) -> list[bool]:
    """Which inputs of a scan body depend on the differentiated inputs:
    those whose outer inputs do, and the carries that come to depend on
    them through the loop (a fixed point)."""
    dependent_body = list(dependent_in)
    for _ in range(n_carry + 1):
        out_dependent = _dependent_outputs(body, dependent_body)
        carry = [a or b for a, b in zip(dependent_body[n_consts : n_consts + n_carry], out_dependent, strict=False)]
        if carry == dependent_body[n_consts : n_consts + n_carry]:
            break
        dependent_body[n_consts : n_consts + n_carry] = carry
    return dependent_body


def _dependent_outputs(jaxpr: Any, dependent_in: Sequence[bool]) -> list[bool]:
    dependent = _dependent(jaxpr, dependent_in)
    return [_is_var(v) and v in dependent for v in jaxpr.outvars]


def all_potentials(plan: Plan) -> dict[Any, Potential]:
    """The potentials of the values of a plan's jaxpr and of the calls,
    checkpoints and ``cond`` branches evaluated inside it (a ``scan`` body's
    change from step to step, and are left out)."""
    found = dict(plan.potentials)
    for inner in plan.inner.values():
        for sub in inner if isinstance(inner, list) else [inner]:
            if isinstance(sub, Plan):
                found.update(all_potentials(sub))
    return found

"""Evaluating a loss function's jaxpr with its boundaries in force.

The evaluation follows a ``Plan`` (``analysis.py``) equation by equation:
a boundary becomes ``rescaled(x, 2**e[name])``; a use that the plan
rescales reads ``rescaled(x, 2**(v @ e))``; calls of jitted functions are
evaluated inside; ``jax.checkpoint``, ``lax.cond`` and ``lax.scan`` are
rebuilt with their public APIs around the evaluation of their jaxprs where
the plan changes something inside them, and bound as they are otherwise.
In a scan body the exponent vectors differ from step to step: they are
tables indexed by the step, which the rebuilt scan passes as a per-step
input.

When measuring, every value of the compute dtype on a path from the
parameters to the loss is also passed through ``probed``, whose backward
pass writes the largest magnitude and the flush counts of the value's
cotangent into the gradient of a small probe array; the probes are grouped
by the values' potentials (``keys``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._jaxpr import Equation, Frame, Hooks, Interpreter, Mode, bind, closed_parts, scan_params, walk
from loss_scale._segments.analysis import CALLS, OUT, REMAT, Plan, Potential, ScanPlan, is_var
from loss_scale._segments.marker import probed, rescaled
from loss_scale._sharding import vary_along, varying_axes

# What a probe records about its value's cotangent.
STATS = 3  # largest magnitude, zeros, below the smallest normal


@dataclasses.dataclass
class Site:
    """A probed value: its probe's shape (``(3,)``, or ``(T, 3)`` in a scan
    body), its key (an index into ``Evaluator.keys``; in a scan body, one per
    step, -1 where the value is not on a path to the loss at that step), and
    its number of elements."""

    shape: tuple[int, ...]
    key: int | np.ndarray
    size: int
    varying: frozenset


@dataclasses.dataclass(frozen=True)
class _Step:
    """``Frame.data`` of a scan body evaluated at one (traced) step: the
    plan evaluated (every step's boundaries), the step, the tables [T, n] of
    the rescaled uses, and the probed values with their step's probe slice
    and their keys."""

    plan: Plan
    step: jax.Array
    rescales: dict[tuple[int, int], np.ndarray]
    probes: dict[Any, jax.Array]
    keys: dict[Any, np.ndarray]


class Evaluator(Hooks):
    """Evaluates jaxprs under plans, with the boundary exponents
    ``exponents`` (int32[n]) in force, probing the values of
    ``compute_dtype`` when ``measure``: hooks of the package's jaxpr
    interpreter, ``Frame.data`` holding each jaxpr's ``Plan`` (a ``_Step``
    in a scan body).

    With ``probes=None`` and ``measure``, the evaluation only records the
    probe sites (``sites``; run it under ``jax.eval_shape``); with
    ``probes``, it consumes them in the same order."""

    def __init__(
        self,
        exponents: jax.Array,
        compute_dtype: Any = None,
        measure: bool = False,
        probes: Sequence[jax.Array] | None = None,
        keys: dict[Potential, int] | None = None,
        zero: Potential = (),
    ):
        self.exponents = exponents
        self.compute_dtype = compute_dtype
        self.measure = measure
        self.probes = probes
        self.sites: list[Site] = []
        self.keys: dict[Potential, int] = keys if keys is not None else {zero: 0}
        self._next = 0

    @property
    def used(self) -> int:
        """How many probes the evaluation has taken."""
        return self._next

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], plan: Plan) -> list[Any]:
        """Evaluates the open ``jaxpr`` under ``plan``."""
        return Interpreter(self).evaluate(jaxpr, consts, args, None, Frame(data=plan))[0]

    # -- factors -----------------------------------------------------------

    def factor(self, vector: Potential | np.ndarray, step: jax.Array | None = None) -> jax.Array:
        """``2**(vector @ e)`` in float32, exact; ``vector`` a potential, or
        a table [T, n] read at ``step``."""
        row = jnp.asarray(vector)[step] if isinstance(vector, np.ndarray) else jnp.asarray(vector, jnp.int32)
        if row.shape[-1] == 0:
            return jnp.float32(1.0)
        # Within float32's exponents (0 for a contribution too small for
        # float32, as its own arithmetic would give; never inf).
        power = jnp.clip(jnp.sum(row * self.exponents), -160, 127)
        return jnp.ldexp(jnp.float32(1.0), power.astype(jnp.int32))

    def key(self, potential: Potential) -> int:
        if potential not in self.keys:
            self.keys[potential] = len(self.keys)
        return self.keys[potential]

    # -- probes ------------------------------------------------------------

    def _worthy(self, var: Any, plan: Plan) -> bool:
        return (
            self.measure
            and is_var(var)
            and var in plan.dependent
            and var.aval.dtype == self.compute_dtype
            and var.aval.shape is not None
        )

    def probe(self, x: jax.Array, key: int | np.ndarray, probe: jax.Array | None = None) -> jax.Array:
        """``x`` with a probe; at top level the probe is the next one, in a
        scan body it is the step's slice, passed as ``probe``."""
        if probe is None:
            varying = varying_axes(jax.typeof(x))
            if self.probes is None:
                self.sites.append(Site((STATS,), key, int(np.prod(x.shape)), varying))
                return x
            probe = self.probes[self._next]
            self._next += 1
        return probed(x, probe)

    def _site_for_scan(self, size: int, keys: np.ndarray, varying: frozenset) -> jax.Array | None:
        """Records (or takes) the stacked probe of a value in a scan body."""
        if self.probes is None:
            self.sites.append(Site((len(keys), STATS), keys, size, varying))
            return None
        probe = self.probes[self._next]
        self._next += 1
        return probe

    # -- hooks -------------------------------------------------------------

    def mode_at(self, eqn: Any, index: int, labels: Any, frame: Frame) -> Mode:
        """Calls the plan analysed are entered; a checkpoint or ``cond`` is
        rebuilt where its plan changes something inside it, or to measure
        inside it; everything else (a scan body's equations included) is
        bound as it is."""
        del labels
        plan = frame.data
        inner = plan.inner.get(index) if isinstance(plan, Plan) else None
        name = eqn.primitive.name
        if inner is None or isinstance(inner, ScanPlan):
            return Mode.KEEP
        if isinstance(inner, list):
            return Mode.REBUILD if self.measure or any(b.rewrites for b in inner) else Mode.KEEP
        if name in CALLS:
            return Mode.ENTER
        if name in REMAT and (self.measure or inner.rewrites):
            return Mode.REBUILD
        return Mode.KEEP

    def rebuild_with_effects(self, eqn: Any, frame: Frame) -> bool:
        """A checkpoint or branch that also holds a callback is rebuilt all
        the same: bound as it is, its boundaries would do nothing."""
        del eqn, frame
        return True

    def child_data(self, eqn: Any, body: int, frame: Frame, index: int | None = None) -> Any:
        """The plan of the call or checkpoint ``index``, or of its branch
        ``body``."""
        inner = frame.data.inner[index]
        return inner[body] if isinstance(inner, list) else inner

    def inputs(self, jaxpr: Any, args: list[Any], frame: Frame) -> list[Any]:
        plan = _plan(frame)
        for j, vector in plan.in_rescales.items():
            args[j] = rescaled(args[j], self.factor(vector))
        return args

    def outputs(self, jaxpr: Any, outs: list[Any], frame: Frame) -> list[Any]:
        rescales, step = _rescales(frame)
        for j in range(len(outs)):
            vector = rescales.get((OUT, j))
            if vector is not None:
                outs[j] = rescaled(outs[j], self.factor(vector, step))
        return outs

    def equation(self, equation: Equation, invals: list[Any], bind_: Callable[[list], list]) -> list[Any]:
        """A use the plan rescales reads its value rescaled (a recast use
        its own cast of the wider value, rescaled); a boundary is
        ``rescaled`` by its factor; a scan the plan looks inside is rebuilt
        with per-step tables; the outputs worth it are probed."""
        i, eqn, frame = equation.index, equation.eqn, equation.frame
        plan = _plan(frame)
        rescales, step = _rescales(frame)
        for j in range(len(invals)):
            cast = plan.recasts.get((i, j))
            vector = rescales.get((i, j))
            if cast is not None:
                # Its own cast of the wider value, rescaled before the cast.
                wide = equation.read(cast.invars[0])
                if vector is not None:
                    wide = rescaled(wide, self.factor(vector, step))
                (invals[j],) = bind(cast, [wide])
            elif vector is not None:
                invals[j] = rescaled(invals[j], self.factor(vector, step))
        inner = plan.inner.get(i) if isinstance(frame.data, Plan) else None
        if i in plan.markers:
            factor = jnp.ldexp(jnp.float32(1.0), self.exponents[plan.markers[i]])
            outs = [rescaled(x, factor) for x in invals]
        elif isinstance(inner, ScanPlan) and (self.measure or inner.rewrites):
            # A scan rebuilt where a step changes, or to measure inside it.
            outs = self._scan(equation, invals, inner)
        else:
            outs = bind_(invals)
        for k, v in enumerate(eqn.outvars):
            if not is_var(v):
                continue
            if isinstance(frame.data, _Step):
                if v in frame.data.probes:
                    outs[k] = self.probe(outs[k], frame.data.keys[v], frame.data.probes[v])
            elif self._worthy(v, plan) and v in plan.potentials:
                outs[k] = self.probe(outs[k], self.key(plan.potentials[v]))
        return outs

    def _scan(self, equation: Equation, invals: list, scan: ScanPlan) -> list[Any]:
        """``lax.scan`` around the body evaluated at each step with that
        step's rescales (tables [T, n] indexed by the step, a per-step input)
        and probes (stacked [T, 3], sliced per step)."""
        eqn = equation.eqn
        params = scan_params(eqn.params)
        body_jaxpr, body_consts = closed_parts(params.jaxpr)
        n_consts, n_carry, length = params.num_consts, params.num_carry, params.length
        consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
        steps = scan.steps
        # The body's structure is the same at every step; a boundary may be
        # off the loss's paths at some steps (the last, say), so the plan
        # evaluated holds every step's boundaries.
        first = dataclasses.replace(steps[0], markers={k: v for s in steps for k, v in s.markers.items()})
        # One table [T, n] per rescaled use (zeros at the steps that do not rescale it).
        positions = sorted({pos for s in steps for pos in s.rescales})
        n = len(self.exponents)
        tables = {}
        for pos in positions:
            table = np.zeros((length, n), np.int32)
            for t, s in enumerate(steps):
                if pos in s.rescales:
                    table[t] = s.rescales[pos]
            tables[pos] = table
        # Probes: the body's values of the compute dtype, with a key per step.
        probe_vars, probe_keys, stacked = [], {}, []
        if self.measure:
            for _, body_eqn in walk(body_jaxpr):
                for v in body_eqn.outvars:
                    if not (is_var(v) and any(self._worthy(v, s) and v in s.potentials for s in steps)):
                        continue
                    keys = np.array([self.key(s.potentials[v]) if v in s.potentials else -1 for s in steps], np.int32)
                    varying = varying_axes(v.aval) if hasattr(v, "aval") else frozenset()
                    stacked.append(self._site_for_scan(int(np.prod(v.aval.shape)), keys, varying))
                    probe_vars.append(v)
                    probe_keys[v] = keys
        discovering = self.probes is None
        frame = equation.frame
        within = (*frame.within, (eqn.primitive.name, Mode.REBUILD))
        path = (*frame.path, equation.index, 0)

        def body_fn(carry, per_step):
            xs_t, step, probes_t = per_step
            cs = list(consts)
            for j, table in scan.const_rescales.items():
                cs[j] = rescaled(cs[j], self.factor(table, step))
            probes = {} if discovering else dict(zip(probe_vars, probes_t, strict=True))
            data = _Step(first, step, tables, probes, probe_keys)
            sub = Frame(scope=frame.scope, path=path, within=within, data=data)
            outs, _ = Interpreter(self).evaluate(body_jaxpr, body_consts, [*cs, *carry, *xs_t], None, sub)
            return outs[:n_carry], outs[n_carry:]

        probes_in = [] if discovering else stacked
        carry, ys = jax.lax.scan(
            body_fn,
            list(init),
            (list(xs), jnp.arange(length), probes_in),
            length=length,
            reverse=params.reverse,
            unroll=params.unroll,
            **params.options,
        )
        return [*carry, *ys]


def _plan(frame: Frame) -> Plan:
    """The plan of a frame's jaxpr (in a scan body, the one evaluated)."""
    return frame.data.plan if isinstance(frame.data, _Step) else frame.data


def _rescales(frame: Frame) -> tuple[dict[tuple[int, int], Any], jax.Array | None]:
    """The rescaled uses of a frame's jaxpr (in a scan body, tables indexed
    by the step) and the step."""
    if isinstance(frame.data, _Step):
        return frame.data.rescales, frame.data.step
    return frame.data.rescales, None


def new_probes(sites: Sequence[Site]) -> list[jax.Array]:
    """Zero probes of the sites' shapes, varying along their values'
    ``shard_map`` axes (or their gradients would be summed over them)."""
    return [vary_along(jnp.zeros(site.shape, jnp.float32), site.varying) for site in sites]

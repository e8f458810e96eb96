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
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from loss_scale._probe import _bind
from loss_scale._segments.analysis import INLINED, OUT, REMAT, Plan, Potential, ScanPlan, _is_var
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


class Evaluator:
    """Evaluates jaxprs under plans, with the boundary exponents
    ``exponents`` (int32[n]) in force, probing the values of
    ``compute_dtype`` when ``measure``.

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
            and _is_var(var)
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

    # -- evaluation --------------------------------------------------------

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        plan: Plan,
        step: jax.Array | None = None,
        body: dict | None = None,
    ) -> list[Any]:
        """Evaluates ``jaxpr`` under ``plan``. In a scan body, ``step`` is the
        step and ``body`` holds the body's tables (see ``_scan``)."""
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        args = list(args)
        for j, vector in plan.in_rescales.items():
            args[j] = rescaled(args[j], self.factor(vector))
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        rescales = body["rescales"] if body is not None else plan.rescales
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            for j in range(len(invals)):
                cast = plan.recasts.get((i, j))
                vector = rescales.get((i, j))
                if cast is not None:
                    # Its own cast of the wider value, rescaled before the cast.
                    wide = read(cast.invars[0])
                    if vector is not None:
                        wide = rescaled(wide, self.factor(vector, step))
                    invals[j] = _bind(cast, [wide])
                elif vector is not None:
                    invals[j] = rescaled(invals[j], self.factor(vector, step))
            outs = self._equation(i, eqn, invals, plan, step, body)
            for v, x in zip(eqn.outvars, outs, strict=True):
                if not _is_var(v):
                    continue
                if body is None and self._worthy(v, plan) and v in plan.potentials:
                    x = self.probe(x, self.key(plan.potentials[v]))
                elif body is not None and v in body["probes"]:
                    x = self.probe(x, body["keys"][v], body["probes"][v])
                env[v] = x
        outs = [read(v) for v in jaxpr.outvars]
        for j in range(len(outs)):
            vector = rescales.get((OUT, j))
            if vector is not None:
                outs[j] = rescaled(outs[j], self.factor(vector, step))
        return outs

    def _equation(self, i: int, eqn: Any, invals: list, plan: Plan, step: Any, body: dict | None) -> list[Any]:
        if i in plan.markers:
            factor = jnp.ldexp(jnp.float32(1.0), self.exponents[plan.markers[i]])
            return [rescaled(x, factor) for x in invals]
        inner = plan.inner.get(i)
        name = eqn.primitive.name
        if inner is not None and body is None:
            # A scan rebuilt where a step changes, or to measure inside it.
            if isinstance(inner, ScanPlan) and (self.measure or inner.rewrites):
                return self._scan(eqn, invals, inner)
            if isinstance(inner, list):
                # Rebuilt where a branch changes, or to measure inside it.
                if self.measure or any(b.rewrites for b in inner):
                    return self._cond(eqn, invals, inner)
            elif name in INLINED:
                closed = eqn.params[INLINED[name]]
                return self.run(closed.jaxpr, closed.consts, invals, inner)
            elif name in REMAT and (self.measure or inner.rewrites):
                params = eqn.params

                def remat_body(*args):
                    return self.run(params["jaxpr"], (), args, inner)

                checkpointed = jax.checkpoint(remat_body, prevent_cse=params["prevent_cse"], policy=params["policy"])
                return list(checkpointed(*invals))
        outs = _bind(eqn, invals)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def _cond(self, eqn: Any, invals: list, branches: list[Plan]) -> list[Any]:
        """``lax.switch`` over the branches evaluated under their plans. Each
        branch has probes of its own (``lax.switch`` traces the branches once
        each, in order, so both evaluations take them in the same order);
        the probes of a branch not taken see zero cotangents, which measure
        nothing."""
        index, operands = invals[0], invals[1:]
        jaxprs = eqn.params["branches"]

        def branch(closed, plan):
            return lambda *ops: self.run(closed.jaxpr, closed.consts, ops, plan)

        fns = [branch(closed, plan) for closed, plan in zip(jaxprs, branches, strict=True)]
        return list(jax.lax.switch(index, fns, *operands))

    def _scan(self, eqn: Any, invals: list, scan: ScanPlan) -> list[Any]:
        params = eqn.params
        closed = params["jaxpr"]
        body_jaxpr = closed.jaxpr
        n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
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
            for eqn_ in body_jaxpr.eqns:
                for v in eqn_.outvars:
                    if not (_is_var(v) and any(self._worthy(v, s) and v in s.potentials for s in steps)):
                        continue
                    keys = np.array([self.key(s.potentials[v]) if v in s.potentials else -1 for s in steps], np.int32)
                    varying = varying_axes(v.aval) if hasattr(v, "aval") else frozenset()
                    stacked.append(self._site_for_scan(int(np.prod(v.aval.shape)), keys, varying))
                    probe_vars.append(v)
                    probe_keys[v] = keys
        discovering = self.probes is None

        def body_fn(carry, per_step):
            xs_t, step, probes_t = per_step
            cs = list(consts)
            for j, table in scan.const_rescales.items():
                cs[j] = rescaled(cs[j], self.factor(table, step))
            body = {
                "rescales": tables,
                "probes": {} if discovering else dict(zip(probe_vars, probes_t, strict=True)),
                "keys": probe_keys,
            }
            outs = self.run(body_jaxpr, closed.consts, [*cs, *carry, *xs_t], first, step, body)
            return outs[:n_carry], outs[n_carry:]

        probes_in = [] if discovering else stacked
        carry, ys = jax.lax.scan(
            body_fn,
            list(init),
            (list(xs), jnp.arange(length), probes_in),
            length=length,
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*carry, *ys]


def new_probes(sites: Sequence[Site]) -> list[jax.Array]:
    """Zero probes of the sites' shapes, varying along their values'
    ``shard_map`` axes (or their gradients would be summed over them)."""
    return [vary_along(jnp.zeros(site.shape, jnp.float32), site.varying) for site in sites]

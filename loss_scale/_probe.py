"""Evaluating a jaxpr through the package's interpreter
(``loss_scale._jaxpr``) with a zero "probe" added to floating values the
equations produce (``v + p``, ``p`` all zeros of ``v``'s shape and dtype):
the forward pass is unchanged, and the gradient with respect to ``p`` is
exactly the cotangent that reaches ``v`` in the backward pass, in ``v``'s
dtype. ``range_report`` and ``value_grad_and_peak`` build on it.

Only the values whose cotangent ``jax.grad`` itself forms are probed
(``on_paths``): those on a path from the differentiated arguments to the
loss. A value that does not depend on the differentiated arguments under
JAX's own JVP rules (data, the output of ``stop_gradient``, ``floor`` or
``sign``, a data-only carry of a ``scan``) or that does not reach the loss
(one only the auxiliary output reads) is evaluated plainly: a probe there
would make differentiable what ``jax.grad`` never differentiates (a
``while_loop`` or ``pure_callback`` on data would then fail), and report a
"cotangent" the backward pass never has.

Calls of jitted functions and ``jax.checkpoint`` are entered (their
equations are probed one by one); ``custom_jvp``/``custom_vjp`` functions,
control flow (``scan``, ``while_loop``, ``cond``) and ``shard_map`` are
bound whole and their outputs probed, so a value inside them is not seen.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loss_scale._jaxpr import (
    CUSTOM_RULES,
    Equation,
    Frame,
    Hooks,
    Interpreter,
    Labels,
    Mode,
    bodies,
    structure_of,
    walk,
)
from loss_scale._sharding import vary_along, varying_axes

# Calls whose body is evaluated in place (its equations are probed one by
# one). A custom_jvp/custom_vjp call is kept whole: entering it would drop
# its rule, and the derivatives would then be those of its body.
_ENTERED = frozenset({"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat2"})


class Site(NamedTuple):
    where: str
    primitive: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    # The shard_map axes the value varies along: its probe must vary along
    # them too, or the probe's gradient would be summed over them.
    varying: frozenset = frozenset()
    # The library's file:line that made it, when not the user's (``_locate``).
    library: str = ""


def is_probed(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


# The libraries whose frames are not the user's: a row's printed location
# is the innermost frame of the equation's traceback outside them (and
# outside jax and the standard library, which jax's own filter skips).
_LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "optax", "chex", "jaxtyping", "orbax", "haiku", "loss_scale")


@functools.cache
def _library_dirs(loaded: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Each loaded library's directory (with a trailing separator) and the
    directory above it, from which its files are named."""
    dirs = []
    for name in loaded:
        file = getattr(sys.modules[name], "__file__", None)
        if file:
            here = os.path.dirname(os.path.abspath(file))
            dirs.append((here + os.sep, os.path.dirname(here) + os.sep))
    return tuple(dirs)


def _library_of(file_name: str) -> str | None:
    """``file_name`` relative to its library's parent (``flax/linen/linear.py``),
    or None when it is not in one of ``_LIBRARIES``."""
    for here, parent in _library_dirs(tuple(n for n in _LIBRARIES if n in sys.modules)):
        if file_name.startswith(here):
            return file_name[len(parent) :]
    return None


@functools.lru_cache(maxsize=1024)
def _locations(traceback: Any) -> tuple[str, str]:
    """The user's ``file:line (function)`` for an equation's traceback (the
    innermost frame outside ``_LIBRARIES``, jax and the standard library),
    and, when the innermost frame outside jax is a library's (the line of
    ``flax/linen/linear.py`` that made a ``Dense``'s product), that one."""
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(traceback))
    user = next((f for f in frames if _library_of(os.path.abspath(f.file_name)) is None), None)
    inner = frames[0] if frames else None
    library = ""
    if inner is not None and inner is not user:
        library = f"{_library_of(os.path.abspath(inner.file_name))}:{inner.start_line} ({_function(inner)})"
    shown = user or inner  # a program made by libraries alone: their line
    line = f"{os.path.basename(shown.file_name)}:{shown.start_line} ({_function(shown)})" if shown else ""
    return line, library


def _function(frame: Any) -> str:
    """The frame's function as its class names it (``Block.__call__`` for
    one defined inside a function, without ``f.<locals>.``)."""
    return frame.function_name.rpartition("<locals>.")[2]


def _locate(eqn: Any, prefix: str) -> tuple[str, str]:
    """The name stack (``jax.named_scope``, jitted functions, flax modules)
    and the user's ``file:line (function)``; and the library's line when the
    equation was made inside one (``""`` otherwise)."""
    name = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    try:
        line, library = _locations(eqn.source_info.traceback)
    except Exception:  # a private helper moved: the name alone
        line, library = "", ""
    return " ".join(p for p in (name, line) if p), library


def _describe(eqn: Any, prefix: str) -> str:
    """``_locate``'s name stack and the user's ``file:line (function)``."""
    return _locate(eqn, prefix)[0]


_NO_TRACE = object()


def _trace_of(x: Any) -> Any:
    """The JAX trace a tracer belongs to (``Tracer._trace``, the same from
    jax 0.4.36 to 0.10 at least); ``_NO_TRACE`` for a non-tracer."""
    return getattr(x, "_trace", _NO_TRACE)


class Evaluator(Hooks):
    """Hooks that evaluate a jaxpr with probes (``run``). Every floating
    value a kept equation produces is a candidate site (``sites``, in
    evaluation order); ``probes[i]`` is added to the ``i``-th candidate for
    which ``probed`` is true (every candidate when ``probed`` is None; none
    when ``probes`` is None). With ``trace``, a candidate is probed only
    when it is a tracer of that trace (its tangent under it is not
    symbolically zero), and ``dependent`` records which were.

    Calls (``_ENTERED``) are entered, so their equations are candidates one
    by one; every other equation holding a jaxpr is bound whole, and only
    its outputs are candidates."""

    def __init__(self, probes: Sequence[Any] | None = None, probed: Sequence[bool] | None = None, trace: Any = None):
        self.probes = probes
        self.probed = probed
        self.trace = trace
        self.sites: list[Site] = []
        # The jaxpr variable of each site (of the jaxpr or of a call evaluated inside).
        self.variables: list[Any] = []
        self.dependent: list[bool] = []
        self.values: list[jax.Array] = []  # the probed values, probe added
        self.inlined: set[str] = set()
        self.whole: set[str] = set()
        self._used = 0

    def run(self, closed: Any, args: Sequence[Any]) -> list[Any]:
        """The outputs of ``closed`` (a ``ClosedJaxpr``) on ``args``, probed."""
        return Interpreter(self).run(closed, args)

    def mode(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> Mode:
        del labels, frame
        return Mode.ENTER if eqn.primitive.name in _ENTERED else Mode.KEEP

    def equation(self, equation: Equation, invals: list[Any], bind: Any) -> list[Any]:
        eqn, name = equation.eqn, equation.eqn.primitive.name
        outs = bind(invals)
        if equation.mode is Mode.ENTER:
            self.inlined.add(name)
            return outs
        if structure_of(eqn) is not None:
            single = _single_operation(eqn)
            if single is None:
                self.whole.add(name)
            else:
                name = single
        where, library = _locate(eqn, equation.frame.scope)
        return [self.probe(x, where, name, v, library) for x, v in zip(outs, eqn.outvars, strict=True)]

    def probe(self, x: Any, where: str, primitive: str, var: Any = None, library: str = "") -> Any:
        if not is_probed(x):
            return x
        index = len(self.sites)
        self.sites.append(Site(where, primitive, tuple(x.shape), x.dtype, varying_axes(jax.typeof(x)), library))
        self.variables.append(var)
        if self.trace is not None:
            dependent = _trace_of(x) is self.trace
            self.dependent.append(dependent)
            if not dependent:
                return x
        if self.probed is not None and not self.probed[index]:
            return x
        if self.probes is not None:
            x = x + self.probes[index if self.probed is None else self._used]
            self._used += 1
        self.values.append(x)
        return x


def _single_operation(eqn: Any) -> str | None:
    """The primitive of a custom_jvp/custom_vjp function whose body is one
    operation (``ls.autocast``'s logits product, which returns float32 and
    differentiates in half precision): its row is that operation's, and
    keeping it whole hides nothing. None for anything else."""
    if eqn.primitive.name not in CUSTOM_RULES:
        return None
    found = bodies(eqn)
    inside = [e for body in found for _, e in walk(body.jaxpr)]
    if len(found) != 1 or len(inside) != 1 or bodies(inside[0]):
        return None
    return inside[0].primitive.name


class Paths(NamedTuple):
    """What ``on_paths`` found: every candidate site, which of them are on a
    path from the differentiated inputs to the loss (``probed``), the
    equations evaluated inside and kept whole, and each candidate's jaxpr
    variable."""

    candidates: list[Site]
    probed: list[bool]
    inlined: set[str]
    whole: set[str]
    variables: list[Any] = []

    @property
    def sites(self) -> list[Site]:
        return [s for s, p in zip(self.candidates, self.probed, strict=True) if p]


def on_paths(closed: Any, leaves: Sequence[Any], differentiated: Sequence[bool], loss: int = 0) -> Paths:
    """Which floating values of ``closed`` (a ``ClosedJaxpr`` of
    ``leaves``) have a cotangent in ``jax.grad`` of its output ``loss``
    with respect to the leaves where ``differentiated`` is true.

    A value qualifies when (forward) its tangent under ``jax.linearize`` of
    those leaves is not symbolically zero, i.e. it is a tracer of that
    linearization's own trace (an outer ``jax.grad``, ``jvp`` or ``vmap``
    of the caller has traces of its own), and (backward) the loss's tangent
    depends on it: a probe added to it is an input that JAX's dead-code
    elimination of the linear (tangent) program keeps, as the backward pass,
    the transpose of that program, reads it. Abstract evaluation only."""
    discover = Evaluator()
    jax.eval_shape(lambda leaves: discover.run(closed, leaves), list(leaves))
    candidates = discover.sites
    positions = [i for i, (x, d) in enumerate(zip(leaves, differentiated, strict=True)) if d and is_probed(x)]
    probed = [False] * len(candidates)
    if positions and candidates:

        def analyse(leaves):
            def loss_of(diff, probes):
                call = list(leaves)
                for i, x in zip(positions, diff, strict=True):
                    call[i] = x
                evaluator = Evaluator(probes, trace=_trace_of(diff[0]))
                out = evaluator.run(closed, call)[loss]
                dependent[:] = evaluator.dependent
                return out

            diff = [leaves[i] for i in positions]
            probes = [vary_along(jnp.zeros(s.shape, s.dtype), s.varying) for s in candidates]
            _, linear = jax.linearize(loss_of, diff, probes)
            used[:] = _used_inputs(jax.make_jaxpr(linear)(diff, probes))[len(diff) :]

        dependent: list[bool] = []
        used: list[bool] = []
        jax.eval_shape(analyse, list(leaves))
        probed = [d and u for d, u in zip(dependent, used, strict=True)]
    return Paths(candidates, probed, discover.inlined, discover.whole, discover.variables)


def _used_inputs(closed: Any) -> list[bool]:
    """Which inputs of ``closed`` its outputs depend on, by JAX's own
    dead-code elimination (it sees into ``scan``, ``cond`` and ``jit``
    carry by carry). Were that private function to move, every input
    counts as used: values the loss does not read would then get rows of
    zero cotangent, which does not change a peak."""
    n = len(closed.jaxpr.invars)
    try:
        from jax._src.interpreters import partial_eval as pe

        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
        _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        return list(used[len(closed.jaxpr.constvars) :])
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a jax without it
        return [True] * n

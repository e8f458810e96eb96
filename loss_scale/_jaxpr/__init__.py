"""One interpreter for jaxprs: a closed jaxpr evaluated equation by
equation, with per-equation hooks, owning once what every walker of the
package needs (issue 32): entering or rebuilding the primitives that hold
jaxprs, literals and constants, effects, and the differences between the
jax versions the package declares (0.8.0 to 0.12.x).

Usage::

    outs = Interpreter(hooks).run(closed_jaxpr, args)

with ``hooks`` a ``Hooks`` subclass (every default evaluates the program
as it is):

* ``mode(eqn, labels, frame) -> Mode``: for an equation that holds a jaxpr,
  ``Mode.KEEP`` (bound as it is), ``Mode.ENTER`` (its body evaluated
  inline, in the caller's trace, with the same hooks) or ``Mode.REBUILD``
  (its body traced through the interpreter into a new body and the
  primitive bound again: control flow stays control flow, a checkpoint
  keeps its policy and ``prevent_cse``, a custom_jvp/custom_vjp its rule).
  ``mode_at(eqn, index, labels, frame)`` is what the interpreter asks (by
  default ``mode``), for a client whose choice depends on the equation's
  index (a plan keyed by it); ``rebuild_with_effects(eqn, frame)`` makes a
  ``REBUILD`` of an equation with effects a rebuild after all.
* ``equation(Equation, invals, bind) -> outs``: called for every equation
  of every jaxpr evaluated (the structured equation itself, then, when
  entered or rebuilt, the equations of its body); ``bind(invals)`` is the
  default behaviour in the equation's mode. ``Equation`` carries the
  equation, its index, its ``Frame`` (scope, path, enclosing primitives,
  the client's ``data``), its mode, its inputs' labels and ``read``.
* ``propagate(eqn, labels, frame) -> labels``: the outputs' labels of an
  equation bound as it is (default: the union of the inputs'). Labels are
  frozensets of client tags; bodies entered or rebuilt propagate equation
  by equation, loops to a fixed point (``Interpreter.labels`` does it
  without evaluating anything).
* ``inputs``/``outputs(jaxpr, values, frame)``: a jaxpr's values on the
  way in and out (a rescale on entering a branch, on leaving a body).
* ``child_data(eqn, body, frame, index)``: ``Frame.data`` of a body (a
  plan), for body ``body`` of equation ``index`` of ``frame``'s jaxpr.
* ``const_labels(value)``: the labels of a jaxpr's constant (a literal or
  a closed-over array, known while tracing), from its value.

For a client that reads a program without evaluating it (a backward pass
over its structure): ``walk(jaxpr, reverse)`` gives one jaxpr's equations
with their indices in either order, ``sub_jaxprs``/``structure_of`` an
equation's bodies, ``bodies`` the same with which operand each body input
receives and which output (or, for a loop's carry, which operand) each
body output becomes, ``equations`` every equation at any depth, and
``Interpreter.variable_labels``/``body_labels`` the labels of every
variable of a jaxpr and of a structured equation's bodies' inputs (a
loop's carries at their fixed point).

What each primitive supports (``KEEP`` always; ``REBUILD`` of an
equation with effects binds it as it is, so that its effects keep their
place among the program's, unless ``rebuild_with_effects`` says
otherwise):

==========================  =====  =======  ==========================
primitive                   ENTER  REBUILD  rebuilt with
==========================  =====  =======  ==========================
``pjit``/``jit``            yes    yes      ``jax.jit`` (inline,
                                            keep_unused; shardings
                                            inferred again)
``closed_call``/            yes    no       (entering gives its values)
``core_call``
``checkpoint``/``remat2``   yes    yes      ``jax.checkpoint`` (policy,
                                            prevent_cse)
``custom_jvp_call``         yes    yes      the equation, new body,
                                            same rule
``custom_vjp_call``         yes    yes      the equation, new body,
(``custom_vjp_call_jaxpr``)                 same fwd/bwd
``cond``                    no     yes      ``lax.switch``
``scan``                    no     yes      ``lax.scan`` (length,
                                            reverse, unroll)
``while``                   no     yes      ``lax.while_loop``
``shard_map``               no     yes      ``jax.shard_map`` (mesh,
                                            specs, check_vma, axes)
==========================  =====  =======  ==========================

Entering a ``custom_jvp``/``custom_vjp`` drops its rule: derivatives are
then those of its body. Rebuilding one traces its body apart from the
caller, so hooks must not make it read the caller's traced values (the
interpreter raises; enter it instead).

Its clients (no other module of the package walks a jaxpr or binds an
equation: ``tests/test_engine_walkers.py``):

* ``_probe.Evaluator`` (``value_grad_and_peak``, ``range_report``): mode
  ENTER for jit/closed_call/checkpoint, KEEP for the rest; ``equation``
  probes the outputs of every kept equation (``bind`` then ``v + p``),
  the site described by ``Frame.scope`` and the name stack; the
  dependence on the differentiated inputs stays a tracer test.
* ``_segments.analysis`` (a backward pass over the structure, not an
  evaluation): ``walk(jaxpr, reverse=True)`` from the loss back,
  ``sub_jaxprs`` for the bodies, ``equations`` to find a boundary at any
  depth, and ``Interpreter.variable_labels`` with a label per
  differentiated input for the dependence (``body_labels`` for a scan
  body's, the carries at their fixed point).
* ``_segments.evaluate.Evaluator``: ``Frame.data`` holds the ``Plan`` of
  each body (``child_data`` picks ``plan.inner[index]``); ``inputs``/
  ``outputs`` apply ``in_rescales`` and the ``(OUT, j)`` rescales;
  ``equation`` rewrites markers and rescales/recasts inputs (``read``)
  and probes outputs; ``mode_at`` ENTER for calls, REBUILD for a
  checkpoint or ``cond`` whose plan rewrites (or when measuring; with
  effects too), KEEP otherwise; a scan with per-step tables is the
  client's own ``equation`` that calls ``lax.scan`` around
  ``Interpreter.evaluate`` of the body, its ``Frame.data`` the step's.
* ``_segments.marker``: ``marker_name`` stays a predicate on an
  equation, used by the two above.
* ``_skip._SelectPath`` (``_evaluate_selecting``): labels
  ``{"suspect"}`` on the gradients; ``mode`` ENTER for jitted and
  checkpointed calls that read a suspect value; ``equation`` guards
  ``GUARDED`` operations on suspect inputs, lets ``FINITE`` ones through,
  gives up on any other that reads a suspect value (a solve, a
  decomposition, a ``custom_jvp``/``custom_vjp`` function: the step then
  takes the ``lax.cond``) and, at the top frame, selects the outputs that
  are state leaves; ``relabel`` marks selected outputs suspect.
* ``_autocast._rewrite.Autocast`` (``ls.autocast``): ``mode`` ENTER for
  jit/closed_call, REBUILD for every other structured primitive (KEEP
  inside ``full_precision``); ``equation`` casts each equation's inputs
  to the dtype its list gives it; ``propagate`` labels float32 results;
  ``outputs`` casts a loop's, a branch's and a custom rule's body back to
  its declared dtypes.
"""

from loss_scale._jaxpr._compat import (
    ScanParams,
    bind,
    closed_parts,
    equations,
    is_dropped,
    is_literal,
    scan_params,
    sub_jaxprs,
    walk,
)
from loss_scale._jaxpr._hooks import NO_LABELS, Equation, Frame, Hooks, Labels, Mode
from loss_scale._jaxpr._interpreter import Interpreter
from loss_scale._jaxpr._structured import CUSTOM_RULES, TABLE, Body, Structure, bodies, structure_of

__all__ = [
    "CUSTOM_RULES",
    "NO_LABELS",
    "TABLE",
    "Body",
    "Equation",
    "Frame",
    "Hooks",
    "Interpreter",
    "Labels",
    "Mode",
    "ScanParams",
    "Structure",
    "bind",
    "bodies",
    "closed_parts",
    "equations",
    "is_dropped",
    "is_literal",
    "scan_params",
    "structure_of",
    "sub_jaxprs",
    "walk",
]

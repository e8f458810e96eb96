"""The protocol between the interpreter and its clients: how a structured
equation is evaluated (``Mode``), where an equation sits (``Frame``), what
a hook is told about it (``Equation``), and the hooks themselves
(``Hooks``, whose defaults evaluate the program as it is)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

# A value's labels: client-defined tags (``"suspect"``, an input's index)
# that flow from an equation's inputs to its outputs. A set, so that the
# join of two paths (a sum, a ``cond``'s branches, a loop's carry) is a
# union and a loop's fixed point is reached in at most as many passes as
# there are labels.
Labels = frozenset

NO_LABELS: Labels = frozenset()


class Mode(enum.Enum):
    """How the interpreter evaluates an equation that holds a jaxpr."""

    # Bound as it is: the hooks see the equation, not its body.
    KEEP = "keep"
    # Its body evaluated inline, in the caller's trace, with the same hooks;
    # the primitive itself disappears (a custom_jvp/custom_vjp its rule).
    ENTER = "enter"
    # Its body evaluated with the same hooks into a new body, and the
    # primitive bound again around it: control flow stays control flow, a
    # checkpoint keeps its policy, a custom_jvp/custom_vjp keeps its rule.
    REBUILD = "rebuild"


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where a jaxpr being evaluated sits in the program.

    Attributes:
      scope: the names of the structured equations around it,
        ``"outer/jit(f)/checkpoint"`` (name stacks and call names), for a
        client's messages.
      path: the equation indices (and, after each, the index of the body:
        a ``cond`` branch, a ``while`` body's cond or body) leading from the
        top jaxpr to this one; ``()`` at the top.
      within: the primitives of the structured equations around it, and
        how each was evaluated.
      data: the client's own state for this jaxpr (a plan, a scan step);
        ``Hooks.child_data`` chooses it for a body.
    """

    scope: str = ""
    path: tuple[int, ...] = ()
    within: tuple[tuple[str, Mode], ...] = ()
    data: Any = None

    @property
    def depth(self) -> int:
        return len(self.within)

    @property
    def rebuilt(self) -> bool:
        """Whether this jaxpr is traced into a new body (a rebuilt loop's
        body runs once per trace, not once per iteration)."""
        return any(mode is Mode.REBUILD for _, mode in self.within)


@dataclasses.dataclass(frozen=True)
class Equation:
    """What the equation hook is told about one equation.

    Attributes:
      eqn: the equation.
      index: its position in its jaxpr's ``eqns``.
      frame: where its jaxpr sits.
      mode: how it is evaluated (``KEEP`` for a primitive without a body).
      labels: its inputs' labels.
      read: the current value of any variable of its jaxpr evaluated so far
        (a client that reads an earlier value again, e.g. to re-cast it).
    """

    eqn: Any
    index: int
    frame: Frame
    mode: Mode
    labels: tuple[Labels, ...]
    read: Callable[[Any], Any]


class Hooks:
    """The interpreter's hooks. Every default evaluates the program as it
    is, so a client overrides only what it changes; an instance may keep
    what it records (sites, counts) as attributes.

    The interpreter calls, for every jaxpr it evaluates (the top one, an
    entered body, a rebuilt body): ``inputs`` on the way in, ``equation``
    once per equation (structured ones included: ``bind`` then enters or
    rebuilds), ``propagate`` for the labels of every equation it binds, and
    ``outputs`` on the way out. ``mode`` decides, per structured equation,
    between ``Mode.KEEP``, ``Mode.ENTER`` and ``Mode.REBUILD``; it must pick
    a mode the primitive supports (``SUPPORTED``), or the interpreter
    raises."""

    def mode(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> Mode:
        """How to evaluate a structured equation (its inputs' labels given,
        e.g. to enter only calls that read a suspect value)."""
        del eqn, labels, frame
        return Mode.KEEP

    def mode_at(self, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame) -> Mode:
        """``mode`` for equation ``index`` of its jaxpr: what the interpreter
        asks. A client whose choice depends on where the equation sits (a
        plan keyed by equation index) overrides this one instead."""
        del index
        return self.mode(eqn, labels, frame)

    def rebuild_with_effects(self, eqn: Any, frame: Frame) -> bool:
        """Whether ``Mode.REBUILD`` rebuilds ``eqn`` although it has effects.
        By default it is bound as it is instead, its effects where they
        were; a client whose rebuilt body must differ (a boundary inside a
        checkpoint that also holds a callback) says True: the body is
        traced again in the caller's trace, its effects with it, in their
        order."""
        del eqn, frame
        return False

    def equation(self, equation: Equation, invals: list[Any], bind: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """The equation's outputs. ``bind(invals)`` is the default
        behaviour in the equation's mode; a hook may change the inputs
        before (a guard, a rescale), the outputs after (a probe, a select),
        or replace it (a boundary marker evaluated as something else)."""
        del equation
        return bind(invals)

    def propagate(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> list[Labels]:
        """The labels of the outputs of an equation bound as it is (kept
        structured equations included): by default each output carries every
        input's labels. Entered and rebuilt bodies propagate equation by
        equation instead."""
        del frame
        joined = NO_LABELS.union(*labels)
        return [joined] * len(eqn.outvars)

    def relabel(self, equation: Equation, labels: list[Labels]) -> list[Labels]:
        """The labels of an equation's outputs as later equations read
        them, once they are known however it was evaluated (a client that
        changed the outputs, e.g. selected them against old values, marks
        them here)."""
        del equation
        return labels

    def const_labels(self, value: Any) -> Labels:
        """The labels of a constant of a jaxpr, from its value, which is
        known while tracing (a constant beyond a range, say): a literal
        written into an equation, or an array the traced function closed
        over. Static label passes (``Interpreter.labels``) see literals but
        not a body's own closed-over arrays: they give those none."""
        del value
        return NO_LABELS

    def inputs(self, jaxpr: Any, args: list[Any], frame: Frame) -> list[Any]:
        """A jaxpr's inputs as its equations will read them."""
        del jaxpr, frame
        return args

    def outputs(self, jaxpr: Any, outs: list[Any], frame: Frame) -> list[Any]:
        """A jaxpr's outputs as its caller will read them."""
        del jaxpr, frame
        return outs

    def child_data(self, eqn: Any, body: int, frame: Frame, index: int | None = None) -> Any:
        """``Frame.data`` for body ``body`` of a structured equation that is
        entered or rebuilt, equation ``index`` of ``frame``'s jaxpr (by
        default the enclosing jaxpr's data)."""
        del eqn, body, index
        return frame.data

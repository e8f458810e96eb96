"""The interpreter: a closed jaxpr evaluated equation by equation, with
the client's hooks called at every equation and structured equations
kept, entered or rebuilt as the hooks choose."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loss_scale._jaxpr import _structured as structured
from loss_scale._jaxpr._compat import bind, has_effects, is_dropped, is_literal
from loss_scale._jaxpr._hooks import NO_LABELS, Equation, Frame, Hooks, Labels, Mode


class Interpreter:
    """Evaluates jaxprs with ``hooks`` (the defaults when None: the program
    as it is).

    ``run`` is the entry point; ``evaluate`` and ``labels`` are what a
    structured primitive's evaluation (``_structured``) or a client's own
    rebuild (a scan with per-step inputs of its own) calls for a body."""

    def __init__(self, hooks: Hooks | None = None):
        self.hooks = hooks if hooks is not None else Hooks()

    def run(
        self, closed: Any, args: Sequence[Any], labels: Sequence[Labels] | None = None, data: Any = None
    ) -> list[Any]:
        """The outputs of ``closed`` (a ``ClosedJaxpr``) on ``args``;
        ``labels`` tags the inputs, ``data`` is the top frame's
        ``Frame.data``."""
        outs, _ = self.evaluate(closed.jaxpr, closed.consts, args, labels, Frame(data=data))
        return outs

    def mode_of(self, eqn: Any, labels: Sequence[Labels], frame: Frame, index: int = -1) -> Mode:
        """The mode the hooks choose for ``eqn`` (equation ``index`` of its
        jaxpr), checked against what the primitive supports; ``KEEP`` for a
        primitive without a body, and for a rebuild of an equation with
        effects (binding it as it is keeps the order of its effects among
        the program's) unless the hooks' ``rebuild_with_effects`` says
        otherwise."""
        table = structured.structure_of(eqn)
        if table is None:
            return Mode.KEEP
        mode = self.hooks.mode_at(eqn, index, labels, frame)
        if mode not in table.modes:
            raise ValueError(
                f"{eqn.primitive.name} cannot be evaluated in mode {mode.value}: it supports "
                f"{', '.join(m.value for m in table.modes)}"
            )
        if mode is Mode.REBUILD and has_effects(eqn) and not self.hooks.rebuild_with_effects(eqn, frame):
            return Mode.KEEP
        return mode

    def evaluate(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        labels: Sequence[Labels] | None,
        frame: Frame,
    ) -> tuple[list[Any], list[Labels]]:
        """The outputs of the open ``jaxpr`` on ``consts`` and ``args``, and
        their labels."""
        env: dict[Any, Any] = {}
        tags: dict[Any, Labels] = {}

        def read(v: Any) -> Any:
            return v.val if is_literal(v) else env[v]

        def tags_of(v: Any) -> Labels:
            return self.hooks.const_labels(v.val) if is_literal(v) else tags.get(v, NO_LABELS)

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
            tags[v] = self.hooks.const_labels(x)
        args = self.hooks.inputs(jaxpr, list(args), frame)
        in_labels = list(labels) if labels is not None else [NO_LABELS] * len(jaxpr.invars)
        for v, x, tag in zip(jaxpr.invars, args, in_labels, strict=True):
            env[v] = x
            tags[v] = tag
        for index, eqn in enumerate(jaxpr.eqns):
            eqn_labels = tuple(tags_of(v) for v in eqn.invars)
            outs, out_labels = self._equation(eqn, index, [read(v) for v in eqn.invars], eqn_labels, frame, read)
            for v, x, tag in zip(eqn.outvars, outs, out_labels, strict=True):
                if not is_dropped(v):
                    env[v] = x
                    tags[v] = tag
        outs = self.hooks.outputs(jaxpr, [read(v) for v in jaxpr.outvars], frame)
        return outs, [tags_of(v) for v in jaxpr.outvars]

    def _equation(
        self, eqn: Any, index: int, invals: list[Any], labels: tuple[Labels, ...], frame: Frame, read: Any
    ) -> tuple[list[Any], list[Labels]]:
        """One equation through the hooks: its outputs and their labels."""
        mode = self.mode_of(eqn, labels, frame, index)
        out_labels: list[Labels] = []

        def default(vals: list[Any]) -> list[Any]:
            if mode is Mode.KEEP:
                out_labels[:] = self.hooks.propagate(eqn, labels, frame)
                return bind(eqn, vals)
            table = structured.structure_of(eqn)
            assert table is not None  # mode_of gives KEEP to any other
            run = table.enter if mode is Mode.ENTER else table.rebuild
            assert run is not None  # mode_of checked the mode is supported
            outs, tags = run(self, eqn, index, list(vals), labels, frame)
            out_labels[:] = tags
            return outs

        equation = Equation(eqn, index, frame, mode, labels, read)
        outs = list(self.hooks.equation(equation, invals, default))
        if not out_labels:  # a hook that did not call ``bind``
            out_labels = self.hooks.propagate(eqn, labels, frame)
        return outs, list(self.hooks.relabel(equation, list(out_labels)))

    def labels(self, jaxpr: Any, labels: Sequence[Labels], frame: Frame) -> list[Labels]:
        """The labels of ``jaxpr``'s outputs, without evaluating it: the
        same propagation as ``evaluate`` (bodies entered or rebuilt are
        followed equation by equation, loops to their fixed point), for the
        carries of a loop before its body is traced and for clients that
        only need the dependence (which values depend on which inputs)."""
        tags = self.variable_labels(jaxpr, labels, frame)
        return [self.hooks.const_labels(v.val) if is_literal(v) else tags.get(v, NO_LABELS) for v in jaxpr.outvars]

    def variable_labels(self, jaxpr: Any, labels: Sequence[Labels], frame: Frame) -> dict[Any, Labels]:
        """The labels of every variable of ``jaxpr`` (its inputs and its
        equations' outputs; a constant's are empty and left out), as
        ``labels`` propagates them: for a client that asks which values
        depend on which inputs anywhere in the jaxpr, not only at its
        outputs."""
        tags: dict[Any, Labels] = dict(zip(jaxpr.invars, labels, strict=True))

        def tags_of(v: Any) -> Labels:
            return self.hooks.const_labels(v.val) if is_literal(v) else tags.get(v, NO_LABELS)

        for index, eqn in enumerate(jaxpr.eqns):
            eqn_labels = tuple(tags_of(v) for v in eqn.invars)
            mode = self.mode_of(eqn, eqn_labels, frame, index)
            table = structured.structure_of(eqn)
            if mode is Mode.KEEP or table is None:
                out_labels = self.hooks.propagate(eqn, eqn_labels, frame)
            else:
                _, out_labels = table.body_labels(self, eqn, index, eqn_labels, frame, mode)
            for v, tag in zip(eqn.outvars, out_labels, strict=True):
                if not is_dropped(v):
                    tags[v] = tag
        return tags

    def body_labels(self, eqn: Any, labels: Sequence[Labels], frame: Frame, index: int = -1) -> list[list[Labels]]:
        """The labels the inputs of each body of the structured ``eqn``
        (equation ``index`` of ``frame``'s jaxpr) take, its inputs labelled
        ``labels``: a loop's carries at their fixed point, for a client that
        walks a body itself (a backward pass over the structure)."""
        table = structured.structure_of(eqn)
        if table is None:
            raise ValueError(f"{eqn.primitive.name} holds no jaxpr the interpreter knows")
        mode = self.mode_of(eqn, labels, frame, index)
        bodies, _ = table.body_labels(self, eqn, index, labels, frame, mode)
        return bodies

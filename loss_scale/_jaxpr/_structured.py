"""Entering and rebuilding the primitives that hold jaxprs, one
``Structure`` per primitive (``structure_of``).

A rebuild goes through JAX's public API (``jax.jit``,
``jax.checkpoint``, ``lax.switch``, ``lax.scan``, ``lax.while_loop``,
``jax.shard_map``) wherever one exists: the body is then traced in the
caller's trace, so a hook may close over the caller's values (a probe, a
skip's decision) and JAX turns them into operands itself. A
``custom_jvp``/``custom_vjp`` call has no public form that takes its rule
as it is in the equation, so its body is traced on its own
(``trace_closed``) and the equation is bound again with the new body and
the old rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from loss_scale._jaxpr._compat import bind, closed_parts, scan_params, trace_closed
from loss_scale._jaxpr._hooks import NO_LABELS, Frame, Labels, Mode

if TYPE_CHECKING:
    from loss_scale._jaxpr._interpreter import Interpreter

# (input labels of each body, output labels of the equation)
BodyLabels = tuple[list[list[Labels]], list[Labels]]
Evaluated = tuple[list[Any], list[Labels]]


@dataclasses.dataclass(frozen=True)
class Structure:
    """How one primitive that holds jaxprs is evaluated.

    Attributes:
      modes: the modes it supports (``KEEP`` always).
      body_labels: the labels its bodies' inputs take and its outputs' (a
        loop's carries at their fixed point).
      enter: evaluates its body inline (absent where ``ENTER`` is not
        supported: a loop or a branch cannot run in the caller's trace).
      rebuild: traces its bodies through the interpreter and binds it again.
    """

    modes: frozenset[Mode]
    body_labels: Callable[..., BodyLabels]
    rebuild: Callable[..., Evaluated]
    enter: Callable[..., Evaluated] | None = None


def scope_part(eqn: Any) -> str:
    """How a structured equation is named in a scope: ``jit(log_softmax)``,
    or the primitive's name where the equation has no name of its own."""
    name = eqn.primitive.name
    label = eqn.params.get("name")
    return f"{name}({label})" if isinstance(label, str) else name


def child(interp: Interpreter, eqn: Any, index: int, body: int, mode: Mode, frame: Frame) -> Frame:
    """The frame of body ``body`` of equation ``index`` of ``frame``'s jaxpr."""
    name = eqn.primitive.name
    scope = "/".join(p for p in (frame.scope, str(eqn.source_info.name_stack), scope_part(eqn)) if p)
    return Frame(
        scope=scope,
        path=(*frame.path, index, body),
        within=(*frame.within, (name, mode)),
        data=interp.hooks.child_data(eqn, body, frame, index=index),
    )


def _union(*groups: Sequence[Labels]) -> list[Labels]:
    return [NO_LABELS.union(*tags) for tags in zip(*groups, strict=True)]


# -- calls: jit, closed_call, checkpoint, custom_jvp, custom_vjp ---------------

_CALL_BODY = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _call_body(eqn: Any) -> tuple[str, Any]:
    key = next(k for k in _CALL_BODY if k in eqn.params)
    return key, eqn.params[key]


def _call_labels(interp: Interpreter, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame, mode: Mode):
    jaxpr, _ = closed_parts(_call_body(eqn)[1])
    out = interp.labels(jaxpr, labels, child(interp, eqn, index, 0, mode, frame))
    return [list(labels)], out


def _enter_call(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    jaxpr, consts = closed_parts(_call_body(eqn)[1])
    return interp.evaluate(jaxpr, consts, invals, labels, child(interp, eqn, index, 0, Mode.ENTER, frame))


def _body_fn(interp: Interpreter, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame) -> Callable:
    """The call's body as a function of its inputs, evaluated with the hooks."""
    jaxpr, consts = closed_parts(_call_body(eqn)[1])
    sub = child(interp, eqn, index, 0, Mode.REBUILD, frame)

    def body(*args: Any) -> list[Any]:
        return interp.evaluate(jaxpr, consts, args, labels, sub)[0]

    body.__name__ = str(eqn.params.get("name", eqn.primitive.name))
    return body


def _rebuild_jit(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    params = eqn.params
    body = _body_fn(interp, eqn, index, labels, frame)
    _, out_labels = _call_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    # Shardings, layouts and donation are those JAX infers again for the
    # rebuilt call; in a jaxpr made from jitted code they are unspecified.
    jitted = jax.jit(body, inline=params.get("inline", False), keep_unused=params.get("keep_unused", False))
    return list(jitted(*invals)), out_labels


def _rebuild_checkpoint(
    interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame
):
    params = eqn.params
    body = _body_fn(interp, eqn, index, labels, frame)
    _, out_labels = _call_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    checkpointed = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    return list(checkpointed(*invals)), out_labels


def _rebuild_custom(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    """A ``custom_jvp``/``custom_vjp`` call bound again with its body traced
    through the interpreter and its rule as it was (the rule reads the
    primal inputs, whose number and types do not change)."""
    key, closed = _call_body(eqn)
    jaxpr, _ = closed_parts(closed)
    body = _body_fn(interp, eqn, index, labels, frame)
    _, out_labels = _call_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    new = trace_closed(body, [v.aval for v in jaxpr.invars])
    if any(isinstance(c, jax.core.Tracer) for c in new.consts):
        # The rule would not see them (a custom_jvp's JVP differentiates
        # its operands only): their derivatives would be silently dropped.
        raise ValueError(
            f"rebuilding {eqn.primitive.name}: the hooks made its body read values of the calling trace; "
            "enter it instead, or pass those values as inputs"
        )
    return bind(eqn.replace(params={**eqn.params, key: new}), invals), out_labels


# -- control flow: cond, scan, while -------------------------------------------


def _cond_labels(interp: Interpreter, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame, mode: Mode):
    ops = list(labels[1:])
    outs = [
        interp.labels(closed_parts(b)[0], ops, child(interp, eqn, index, k, mode, frame))
        for k, b in enumerate(eqn.params["branches"])
    ]
    # Which branch ran depends on the index: every output carries its labels.
    joined = _union(*outs)
    return [ops] * len(outs), [tag | labels[0] for tag in joined]


def _rebuild_cond(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    body_in, out_labels = _cond_labels(interp, eqn, index, labels, frame, Mode.REBUILD)

    def branch(k: int, closed: Any) -> Callable:
        jaxpr, consts = closed_parts(closed)
        sub = child(interp, eqn, index, k, Mode.REBUILD, frame)
        return lambda *ops: interp.evaluate(jaxpr, consts, ops, body_in[k], sub)[0]

    fns = [branch(k, b) for k, b in enumerate(eqn.params["branches"])]
    return list(jax.lax.switch(invals[0], fns, *invals[1:])), out_labels


def _scan_labels(interp: Interpreter, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame, mode: Mode):
    scan = scan_params(eqn.params)
    n_consts, n_carry = scan.num_consts, scan.num_carry
    jaxpr, _ = closed_parts(scan.jaxpr)
    sub = child(interp, eqn, index, 0, mode, frame)
    body_in = list(labels)
    # The carries take the labels their own updates give them: a fixed
    # point, reached when no carry gains a label.
    while True:
        outs = interp.labels(jaxpr, body_in, sub)
        carry = _union(body_in[n_consts : n_consts + n_carry], outs[:n_carry])
        if carry == body_in[n_consts : n_consts + n_carry]:
            return [body_in], outs
        body_in[n_consts : n_consts + n_carry] = carry


def _rebuild_scan(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    scan = scan_params(eqn.params)
    n_consts, n_carry = scan.num_consts, scan.num_carry
    jaxpr, body_consts = closed_parts(scan.jaxpr)
    (body_in,), out_labels = _scan_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    sub = child(interp, eqn, index, 0, Mode.REBUILD, frame)
    consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]

    def step(carry: list, x: list) -> tuple[list, list]:
        outs = interp.evaluate(jaxpr, body_consts, [*consts, *carry, *x], body_in, sub)[0]
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(
        step, list(init), list(xs), length=scan.length, reverse=scan.reverse, unroll=scan.unroll, **scan.options
    )
    return [*carry, *ys], out_labels


def _while_labels(interp: Interpreter, eqn: Any, index: int, labels: Sequence[Labels], frame: Frame, mode: Mode):
    params = eqn.params
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_jaxpr, _ = closed_parts(params["cond_jaxpr"])
    body_jaxpr, _ = closed_parts(params["body_jaxpr"])
    cond_consts, body_consts, carry = (
        list(labels[:n_cond]),
        list(labels[n_cond : n_cond + n_body]),
        list(labels[n_cond + n_body :]),
    )
    cond_frame = child(interp, eqn, index, 0, mode, frame)
    body_frame = child(interp, eqn, index, 1, mode, frame)
    while True:
        (predicate,) = interp.labels(cond_jaxpr, [*cond_consts, *carry], cond_frame)
        outs = interp.labels(body_jaxpr, [*body_consts, *carry], body_frame)
        # How many times the body ran depends on the predicate: every carry
        # carries its labels.
        new = [tag | predicate for tag in _union(carry, outs)]
        if new == carry:
            return [[*cond_consts, *carry], [*body_consts, *carry]], carry
        carry = new


def _rebuild_while(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    params = eqn.params
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_jaxpr, cond_closed = closed_parts(params["cond_jaxpr"])
    body_jaxpr, body_closed = closed_parts(params["body_jaxpr"])
    (cond_in, body_in), out_labels = _while_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    cond_frame = child(interp, eqn, index, 0, Mode.REBUILD, frame)
    body_frame = child(interp, eqn, index, 1, Mode.REBUILD, frame)
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]

    def cond_fn(carry: list) -> Any:
        return interp.evaluate(cond_jaxpr, cond_closed, [*cond_consts, *carry], cond_in, cond_frame)[0][0]

    def body_fn(carry: list) -> list:
        return interp.evaluate(body_jaxpr, body_closed, [*body_consts, *carry], body_in, body_frame)[0]

    return list(jax.lax.while_loop(cond_fn, body_fn, list(invals[n_cond + n_body :]))), out_labels


# -- shard_map -------------------------------------------------------------------


def _rebuild_shard_map(interp: Interpreter, eqn: Any, index: int, invals: list, labels: Sequence[Labels], frame: Frame):
    """``jax.shard_map`` again around the body: the body then sees the
    per-device shapes and varying axes it was traced with."""
    params = eqn.params
    jaxpr, consts = closed_parts(params["jaxpr"])
    _, out_labels = _call_labels(interp, eqn, index, labels, frame, Mode.REBUILD)
    sub = child(interp, eqn, index, 0, Mode.REBUILD, frame)

    def body(*args: Any) -> tuple:
        return tuple(interp.evaluate(jaxpr, consts, args, labels, sub)[0])

    # jax 0.8 to 0.12 name these parameters alike; older ones used
    # check_rep and auto (the axes left automatic) instead.
    check = params.get("check_vma", params.get("check_rep", True))
    manual = params.get("manual_axes")
    options = {"axis_names": set(manual)} if manual is not None else {}
    mapped = jax.shard_map(
        body,
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        check_vma=check,
        **options,
    )
    return list(mapped(*invals)), out_labels


_KEEP_ENTER_REBUILD = frozenset({Mode.KEEP, Mode.ENTER, Mode.REBUILD})
_KEEP_REBUILD = frozenset({Mode.KEEP, Mode.REBUILD})

_JIT = Structure(_KEEP_ENTER_REBUILD, _call_labels, _rebuild_jit, _enter_call)
_CHECKPOINT = Structure(_KEEP_ENTER_REBUILD, _call_labels, _rebuild_checkpoint, _enter_call)
_CUSTOM = Structure(_KEEP_ENTER_REBUILD, _call_labels, _rebuild_custom, _enter_call)


def _no_rebuild(*args: Any) -> Evaluated:  # pragma: no cover - excluded by modes
    raise AssertionError("not rebuilt")


TABLE: dict[str, Structure] = {
    "pjit": _JIT,
    "jit": _JIT,
    # core_call/closed_call have no public API to rebuild them with, and
    # entering them gives the same values.
    "closed_call": Structure(frozenset({Mode.KEEP, Mode.ENTER}), _call_labels, _no_rebuild, _enter_call),
    "core_call": Structure(frozenset({Mode.KEEP, Mode.ENTER}), _call_labels, _no_rebuild, _enter_call),
    "checkpoint": _CHECKPOINT,
    "remat2": _CHECKPOINT,
    "custom_jvp_call": _CUSTOM,
    "custom_vjp_call": _CUSTOM,
    "custom_vjp_call_jaxpr": _CUSTOM,
    "cond": Structure(_KEEP_REBUILD, _cond_labels, _rebuild_cond),
    "scan": Structure(_KEEP_REBUILD, _scan_labels, _rebuild_scan),
    "while": Structure(_KEEP_REBUILD, _while_labels, _rebuild_while),
    "shard_map": Structure(_KEEP_REBUILD, _call_labels, _rebuild_shard_map),
}

# The calls of functions with their own derivative rule (``jax.custom_jvp``,
# ``jax.custom_vjp``): entering one evaluates its body, whose derivatives
# are the body's, not the rule's.
CUSTOM_RULES = frozenset(name for name, structure in TABLE.items() if structure is _CUSTOM)


@dataclasses.dataclass(frozen=True)
class Body:
    """One body of a structured equation and how its values connect to the
    equation's, for a client that follows values across the boundary
    without evaluating anything (which operations feed which).

    Attributes:
      jaxpr: the body (an open jaxpr; its consts, if any, are not operands).
      inputs: for each of the body's inputs, the index of the equation's
        operand it receives (None where it receives none).
      outputs: for each of the body's outputs, the index of the equation's
        output it becomes (None: a ``while`` loop's predicate).
      feedback: for each of the body's outputs, the index of the operand it
        becomes at the next iteration (a loop's carry), or None.
    """

    jaxpr: Any
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    feedback: tuple[int | None, ...]


def _same(body: Any, n_outs: int) -> Body:
    jaxpr, _ = closed_parts(body)
    none = (None,) * len(jaxpr.outvars)
    return Body(jaxpr, tuple(range(len(jaxpr.invars))), tuple(range(n_outs)), none)


def bodies(eqn: Any) -> list[Body]:
    """The bodies of a structured equation with the correspondence between
    their inputs and outputs and the equation's (empty for an equation
    without a body): calls and ``shard_map`` pass operands and outputs
    through in order, a ``cond``'s branches skip the index, a ``scan``'s
    and a ``while``'s carries come back as operands."""
    table = structure_of(eqn)
    if table is None:
        return []
    params, n_outs = eqn.params, len(eqn.outvars)
    name = eqn.primitive.name
    if name == "cond":
        found = []
        for branch in params["branches"]:
            jaxpr, _ = closed_parts(branch)
            n = len(jaxpr.invars)
            found.append(Body(jaxpr, tuple(range(1, n + 1)), tuple(range(n_outs)), (None,) * n_outs))
        return found
    if name == "scan":
        scan = scan_params(params)
        body = _same(scan.jaxpr, n_outs)
        n_consts, n_carry = scan.num_consts, scan.num_carry
        feedback = tuple(n_consts + j if j < n_carry else None for j in range(n_outs))
        return [dataclasses.replace(body, feedback=feedback)]
    if name == "while":
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        carry = n_cond + n_body
        cond_jaxpr, _ = closed_parts(params["cond_jaxpr"])
        body_jaxpr, _ = closed_parts(params["body_jaxpr"])
        cond_in = tuple(j if j < n_cond else carry + j - n_cond for j in range(len(cond_jaxpr.invars)))
        body_in = tuple(n_cond + j if j < n_body else carry + j - n_body for j in range(len(body_jaxpr.invars)))
        return [
            Body(cond_jaxpr, cond_in, (None,), (None,)),
            Body(body_jaxpr, body_in, tuple(range(n_outs)), tuple(carry + j for j in range(n_outs))),
        ]
    key = "jaxpr" if name == "shard_map" else _call_body(eqn)[0]
    return [_same(params[key], n_outs)]


def structure_of(eqn: Any) -> Structure | None:
    """The structure of ``eqn``'s primitive; None for one without a body
    (or one whose parameters are not those this module knows)."""
    table = TABLE.get(eqn.primitive.name)
    if table is None:
        return None
    if table.enter is _enter_call and not any(k in eqn.params for k in _CALL_BODY):
        return None
    return table

"""The engine's read-only view of structured equations, ``bodies``: which
operand each body input receives, which output each body output becomes
and, for a loop, which operand it becomes at the next iteration; and the
``const_labels`` hook, which labels literals and closed-over arrays from
their values. Every operand and carry of the programs below has a shape of
its own, so a wrong index shows as a wrong shape; the operands' labels as
the interpreter propagates them are a second, independent oracle."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from loss_scale._jaxpr import NO_LABELS, Frame, Hooks, Interpreter, Mode, bodies, equations, scan_params, structure_of

A, B, C, D = jnp.ones(1), jnp.ones(2), jnp.ones(3), jnp.ones((5, 4))


@jax.custom_jvp
def custom(a, b):
    return jnp.sin(a) * 2.0, b


custom.defjvp(lambda p, t: (custom(*p), (jnp.cos(p[0]) * 2.0 * t[0], t[1])))


@jax.custom_vjp
def custom_vjp(a, b):
    return a * 3.0, jnp.cos(b)


custom_vjp.defvjp(lambda a, b: (custom_vjp(a, b), (a, b)), lambda r, g: (g[0] * 3.0, -jnp.sin(r[1]) * g[1]))


def program(a, b, c, d):
    p = jax.jit(lambda b, a: (a + 1.0, b * 2.0, jnp.sum(a)))(b, a)
    q = jax.checkpoint(lambda c, a: (jnp.sum(c), a))(c, a)
    r = custom(a, c)
    s = custom_vjp(b, a)
    t = lax.cond(a[0] > 0, lambda c, b: (b, c), lambda c, b: (b * 2, c * 2), c, b)
    u = lax.scan(lambda carry, x: ((carry[0] + x[:1], carry[1] * b), x.sum() + c), (a, b), d)
    v = lax.while_loop(lambda k: k[0] < 3, lambda k: (k[0] + 1, k[1] + c, k[2] * a), (0, c, a))
    return p, q, r, s, t, u, v


def structured(jaxpr: Any) -> list[Any]:
    return [e for e in equations(jaxpr) if structure_of(e) is not None]


def aval(v: Any) -> Any:
    return (tuple(v.aval.shape), np.dtype(v.aval.dtype))


@pytest.fixture(scope="module")
def jaxpr():
    return jax.make_jaxpr(program)(A, B, C, D).jaxpr


def test_every_structured_primitive_is_described(jaxpr):
    names = {e.primitive.name for e in structured(jaxpr)}
    assert {"jit", "remat2", "custom_jvp_call", "custom_vjp_call", "cond", "scan", "while"} <= names
    for eqn in equations(jaxpr):
        assert bool(bodies(eqn)) == (structure_of(eqn) is not None), eqn.primitive.name


def sliced(eqn: Any, var: Any, index: int, output: bool) -> Any:
    """The aval a body sees of ``var``: a scan's ``xs`` and ``ys`` one
    iteration at a time (without their leading axis)."""
    shape, dtype = aval(var)
    if eqn.primitive.name == "scan":
        scan = scan_params(eqn.params)
        first = scan.num_carry if output else scan.num_consts + scan.num_carry
        if index >= first:
            return shape[1:], dtype
    return shape, dtype


def test_inputs_outputs_and_carries_have_the_shapes_of_what_they_connect(jaxpr):
    for eqn in structured(jaxpr):
        for body in bodies(eqn):
            assert len(body.inputs) == len(body.jaxpr.invars)
            assert len(body.outputs) == len(body.feedback) == len(body.jaxpr.outvars)
            for var, source in zip(body.jaxpr.invars, body.inputs, strict=True):
                assert source is not None, eqn.primitive.name
                assert aval(var) == sliced(eqn, eqn.invars[source], source, False), eqn.primitive.name
            for var, out, back in zip(body.jaxpr.outvars, body.outputs, body.feedback, strict=True):
                if out is not None:
                    assert aval(var) == sliced(eqn, eqn.outvars[out], out, True), eqn.primitive.name
                if back is not None:
                    assert aval(var) == aval(eqn.invars[back]), eqn.primitive.name


def test_a_loop_carry_comes_back_as_its_operand_and_nothing_else_does(jaxpr):
    by_name = {e.primitive.name: e for e in structured(jaxpr)}
    (scan,) = bodies(by_name["scan"])
    scan_eqn = scan_params(by_name["scan"].params)
    n_consts, n_carry = scan_eqn.num_consts, scan_eqn.num_carry
    assert scan.feedback == tuple(n_consts + j for j in range(n_carry)) + (None,) * (len(scan.feedback) - n_carry)
    cond_body, loop_body = bodies(by_name["while"])
    assert cond_body.outputs == (None,) and cond_body.feedback == (None,)
    carry = by_name["while"].params["cond_nconsts"] + by_name["while"].params["body_nconsts"]
    assert loop_body.feedback == tuple(carry + j for j in range(len(loop_body.jaxpr.outvars)))
    for name in ("jit", "remat2", "cond", "custom_jvp_call", "custom_vjp_call"):
        assert all(back is None for body in bodies(by_name[name]) for back in body.feedback)
    # A branch receives the operands after the index.
    assert all(body.inputs[0] == 1 for body in bodies(by_name["cond"]))


class Rebuild(Hooks):
    """Every body rebuilt (entered where a primitive cannot be)."""

    def mode(self, eqn, labels, frame):
        return Mode.REBUILD if Mode.REBUILD in structure_of(eqn).modes else Mode.ENTER


def test_the_interpreters_labels_agree_with_the_inputs(jaxpr):
    interp = Interpreter(Rebuild())
    for eqn in structured(jaxpr):
        labels = [frozenset({i}) for i in range(len(eqn.invars))]
        seen = interp.body_labels(eqn, labels, Frame())
        for body, body_labels in zip(bodies(eqn), seen, strict=True):
            for source, tags in zip(body.inputs, body_labels, strict=True):
                # A loop's carries also take their updates' labels; every
                # other input has exactly its operand's.
                assert source in tags, eqn.primitive.name
                if eqn.primitive.name not in ("scan", "while"):
                    assert tags == frozenset({source}), eqn.primitive.name


# -- const_labels ----------------------------------------------------------------------

LARGE = np.full(3, 1e9, np.float32)


class Large(Rebuild):
    """Labels constants with a value above 1e6 ``"large"``; every body is
    rebuilt, so the label must travel into them."""

    def __init__(self):
        self.seen = []

    def const_labels(self, value):
        values = np.asarray(value)
        return frozenset({"large"}) if values.dtype.kind == "f" and np.any(np.abs(values) > 1e6) else NO_LABELS

    def equation(self, equation, invals, bind):
        if equation.eqn.primitive.name == "mul":
            self.seen.append(("large" in NO_LABELS.union(*equation.labels), equation.frame.depth))
        return bind(invals)


def test_const_labels_reach_literals_and_closed_over_arrays_inside_bodies():
    def fn(x):
        a = jax.checkpoint(lambda x, k: x * k)(x, LARGE)  # a closed-over array, passed into a body
        b = jax.jit(lambda x, k: x * k)(x, 2e9)  # a literal, passed into a body
        c = lax.cond(True, lambda x: x * 3.0, lambda x: x, x)  # neither
        return a + b + c

    closed = jax.make_jaxpr(fn)(C)
    hooks = Large()
    outs = Interpreter(hooks).run(closed, [C])
    np.testing.assert_array_equal(outs[0], fn(C))
    assert [large for large, depth in hooks.seen if depth > 0] == [True, True, False]
    # The static pass sees the literal and the top-level constant as well.
    tags = Interpreter(hooks).variable_labels(closed.jaxpr, [NO_LABELS], Frame())
    assert any("large" in t for t in tags.values())

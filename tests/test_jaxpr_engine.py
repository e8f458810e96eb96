"""The jaxpr interpreter (``loss_scale._jaxpr``) evaluates a program as
the program itself does: on a corpus of programs that nest every
structured primitive two deep, with and without effects, under ``vmap``,
under ``shard_map`` (two host devices, in a subprocess) and with x64, the
identity interpretation is bit-identical to the original in values and in
``jax.grad``/``jax.jvp``/``jax.vjp``, in every mode the primitives
support. A hook sees every equation, and a hook that perturbs one value
deep inside is caught by the same comparison."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_scale._jaxpr import (
    NO_LABELS,
    Equation,
    Frame,
    Hooks,
    Interpreter,
    Mode,
    closed_parts,
    scan_params,
    structure_of,
    sub_jaxprs,
    walk,
)

# -- the corpus -----------------------------------------------------------------


@jax.custom_jvp
def smooth(x):
    return jnp.sin(jax.jit(jnp.tanh)(x))


@smooth.defjvp
def _smooth_jvp(primals, tangents):
    # The derivative autodiff of the body gives, written as it writes it,
    # so that entering (which drops the rule) gives the same bits.
    (x,), (t,) = primals, tangents
    inner = jnp.tanh(x)
    return smooth(x), t * (1 - inner**2) * jnp.cos(inner)


@jax.custom_vjp
def remat_inside(x):
    return jax.checkpoint(lambda y: jnp.sin(y) * y)(x)


def _remat_fwd(x):
    return remat_inside(x), x


def _remat_bwd(x, ct):
    return (ct * (jnp.cos(x) * x + jnp.sin(x)),)


remat_inside.defvjp(_remat_fwd, _remat_bwd)


def scan_cond_jit(x):
    """A scan whose body has a cond with a jitted call in one branch."""

    def body(c, xs):
        c = jax.lax.cond(xs > 0.5, jax.jit(lambda v: jnp.sin(v) * 1.5), jnp.cos, c)
        return c + xs, c * 2

    carry, ys = jax.lax.scan(body, x, jnp.linspace(0.0, 1.0, 3))
    return jnp.sum(carry) + jnp.sum(ys)


def jit_of_cond_of_scan(x):
    @jax.jit
    def inner(v):
        def branch(u):
            return jax.lax.scan(lambda c, _: (c * 0.9 + 0.1, None), u, length=4)[0]

        return jax.lax.cond(jnp.sum(v) > 0, branch, jnp.exp, v)

    return jnp.sum(inner(x) ** 2)


def custom_functions(x):
    """A checkpoint inside a custom_vjp; a jit inside a custom_jvp."""
    return jnp.sum(remat_inside(x) + smooth(x * 2.0))


def custom_functions_entered(x):
    """``custom_functions`` with its custom functions' bodies in their
    place: entering them drops their rules, so this is the reference of
    their derivatives."""
    y = jax.checkpoint(lambda v: jnp.sin(v) * v)(x)
    return jnp.sum(y + jnp.sin(jax.jit(jnp.tanh)(x * 2.0)))


# The reference where calls are entered, for programs whose custom rules
# differ in rounding from their bodies' derivatives.
ENTERED_REFERENCE = {"custom_functions": custom_functions_entered}


def checkpoint_of_scan(x):
    policy = jax.checkpoint_policies.nothing_saveable

    @jax.checkpoint
    def block(v):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c * w), None), v, jnp.ones(2))[0]

    f = jax.checkpoint(lambda v: block(v) * v, policy=policy, prevent_cse=False)
    return jnp.sum(f(x))


def while_in_jit(x):
    """Forward-mode only (``while_loop`` has no reverse-mode derivative)."""

    @jax.jit
    def loop(v):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1]) + c[1]), (0, v))[1]

    return jnp.sum(loop(x))


def scan_of_while(x):
    def body(c, _):
        return jax.lax.while_loop(lambda d: jnp.sum(d) < 10.0, lambda d: d * 2.0 + 1.0, c), c

    return jnp.sum(jax.lax.scan(body, x, length=2)[0])


def literals_and_dropped(x):
    """Literals, an integer path, an unused output of a scan (``_``)."""
    _, ys = jax.lax.scan(lambda c, v: (c + 1, v * 3.0 + 1.0), 0, x)
    return jnp.sum(ys) + jnp.sum(jnp.where(x > 0, x, 2.0))


TABLE = jnp.linspace(0.5, 2.0, 4, dtype=jnp.float32)


def jit_with_consts(x):
    """A jitted function that closes over an array: its ``ClosedJaxpr``
    holds consts (which also answers ``eqns``, like an open jaxpr)."""
    return jnp.sum(jax.jit(lambda v: jnp.sin(v * TABLE) + TABLE)(x))


LOG: list[Any] = []


def _record(v):
    LOG.append(np.asarray(v).tolist())


def effects(x):
    """Callbacks inside a scan body and a cond, and an ordered print in a jit."""

    def body(c, _):
        jax.debug.callback(_record, c)
        return c * 1.1, None

    c = jax.lax.scan(body, x, length=2)[0]
    c = jax.lax.cond(jnp.sum(c) > 0, lambda v: (jax.debug.callback(_record, v), v * 2)[1], lambda v: v, c)

    @jax.jit
    def printed(v):
        jax.debug.print("engine {}", jnp.sum(v), ordered=True)
        return v + 1

    return jnp.sum(printed(c))


# name -> (program, differentiable in reverse mode, in forward mode)
CORPUS: dict[str, tuple[Callable, bool, bool]] = {
    "scan_cond_jit": (scan_cond_jit, True, True),
    "jit_of_cond_of_scan": (jit_of_cond_of_scan, True, True),
    # A custom_vjp function has no forward-mode derivative.
    "custom_functions": (custom_functions, True, False),
    "checkpoint_of_scan": (checkpoint_of_scan, True, True),
    # A while_loop has no reverse-mode derivative.
    "while_in_jit": (while_in_jit, False, True),
    "scan_of_while": (scan_of_while, False, True),
    "literals_and_dropped": (literals_and_dropped, True, True),
    "jit_with_consts": (jit_with_consts, True, True),
    "effects": (effects, True, True),
}

# -- hooks ------------------------------------------------------------------------


class Uniform(Hooks):
    """Every structured equation in ``mode`` where the primitive supports
    it, ``fallback`` where not; records every equation it sees."""

    def __init__(self, mode: Mode, fallback: Mode = Mode.KEEP):
        self.chosen, self.fallback = mode, fallback
        self.seen: list[tuple[tuple[int, ...], int]] = []

    def mode(self, eqn, labels, frame):
        modes = structure_of(eqn).modes
        return self.chosen if self.chosen in modes else self.fallback if self.fallback in modes else Mode.KEEP

    def equation(self, equation: Equation, invals, bind):
        self.seen.append((equation.frame.path, equation.index))
        return bind(invals)


MODES = {
    "keep": lambda: Uniform(Mode.KEEP),
    "enter": lambda: Uniform(Mode.ENTER),
    "rebuild": lambda: Uniform(Mode.REBUILD),
    # Calls entered inside rebuilt control flow.
    "enter_in_rebuilt": lambda: Uniform(Mode.ENTER, Mode.REBUILD),
}


def interpreted(f: Callable, hooks: Hooks, *example: Any) -> Callable:
    closed = jax.make_jaxpr(f)(*example)

    def g(*args):
        outs = Interpreter(hooks).run(closed, jax.tree.leaves(args))
        return outs[0]

    return g


def assert_identical(a: Any, b: Any) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def check_identity(f: Callable, g: Callable, x: jax.Array, reverse: bool, forward: bool = True) -> None:
    """``g`` equals ``f`` bit for bit: values (eager and jitted), under
    ``vmap``, and derivatives."""
    t = jnp.linspace(-1.0, 1.0, x.size, dtype=x.dtype).reshape(x.shape)
    assert_identical(g(x), f(x))
    assert_identical(jax.jit(g)(x), jax.jit(f)(x))
    batch = jnp.stack([x, x * 0.5 - 1.0])
    assert_identical(jax.vmap(g)(batch), jax.vmap(f)(batch))
    if forward:
        assert_identical(jax.jvp(g, (x,), (t,)), jax.jvp(f, (x,), (t,)))
    if reverse:
        assert_identical(jax.grad(g)(x), jax.grad(f)(x))
        assert_identical(jax.jit(jax.grad(g))(x), jax.jit(jax.grad(f))(x))
        out_g, vjp_g = jax.vjp(g, x)
        out_f, vjp_f = jax.vjp(f, x)
        assert_identical((out_g, vjp_g(jnp.ones_like(out_g))), (out_f, vjp_f(jnp.ones_like(out_f))))
        assert_identical(jax.vmap(jax.grad(g))(batch), jax.vmap(jax.grad(f))(batch))


def _enable_x64() -> Any:
    """x64 within a block (``jax.enable_x64`` from jax 0.9; before, in
    ``jax.experimental``)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(True)


X = jnp.array([0.3, -0.7, 1.2, 0.05], jnp.float32)

# -- identity ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_identity_is_bit_identical(name, mode):
    f, reverse, forward = CORPUS[name]
    g = interpreted(f, MODES[mode](), X)
    if mode.startswith("enter") and name in ENTERED_REFERENCE:
        # Entering evaluates a custom function's body op by op where the
        # call ran it as one computation, and drops its rules: values and
        # derivatives are those of another program, fused differently
        # (with XLA_FLAGS=--xla_cpu_max_isa=AVX2 the values differ by an
        # ulp), so equal within rounding only.
        np.testing.assert_allclose(g(X), f(X), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(g)(X), jax.grad(ENTERED_REFERENCE[name])(X), rtol=1e-6)
        return
    assert_identical(g(X), f(X))
    check_identity(f, g, X, reverse, forward)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", ["scan_cond_jit", "custom_functions", "checkpoint_of_scan", "while_in_jit"])
def test_identity_with_x64(name, mode):
    f, reverse, forward = CORPUS[name]
    with _enable_x64():
        x = X.astype(jnp.float64)
        g = interpreted(f, MODES[mode](), x)
        assert g(x).dtype == jnp.float64
        if mode.startswith("enter") and name in ENTERED_REFERENCE:
            np.testing.assert_allclose(g(x), f(x), rtol=1e-12)
            np.testing.assert_allclose(jax.grad(g)(x), jax.grad(ENTERED_REFERENCE[name])(x), rtol=1e-12)
            return
        assert_identical(g(x), f(x))
        check_identity(f, g, x, reverse, forward)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_identity_under_vmap_of_traced_program(mode):
    """The program traced under ``vmap`` (batched cond, scan, while)."""

    def f(x):
        return jnp.sum(jax.vmap(lambda r: scan_cond_jit(r) + while_in_jit(r))(x))

    x = jnp.stack([X, -X, X * 3])
    g = interpreted(f, MODES[mode](), x)
    assert_identical(g(x), f(x))
    assert_identical(jax.jvp(g, (x,), (x,)), jax.jvp(f, (x,), (x,)))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_effects_run_in_the_same_order(mode):
    LOG.clear()
    jax.block_until_ready(jax.jit(effects)(X))
    jax.effects_barrier()
    expected = list(LOG)
    LOG.clear()
    jax.block_until_ready(jax.jit(interpreted(effects, MODES[mode](), X))(X))
    jax.effects_barrier()
    assert expected == LOG and len(expected) == 3


class RebuildEffects(Uniform):
    """``Uniform`` that rebuilds equations with effects too."""

    def rebuild_with_effects(self, eqn, frame):
        return True


@pytest.mark.parametrize("mode", [Mode.REBUILD, Mode.ENTER])
def test_equations_with_effects_are_rebuilt_where_the_hooks_ask(mode):
    """By default an equation with effects is bound as it is; hooks whose
    ``rebuild_with_effects`` says so have it rebuilt (they see its body),
    with the same values and its effects in the same order."""
    closed = jax.make_jaxpr(effects)(X)
    kept, rebuilt = Uniform(mode, Mode.REBUILD), RebuildEffects(mode, Mode.REBUILD)
    for hooks in (kept, rebuilt):
        jax.eval_shape(lambda x, hooks=hooks: Interpreter(hooks).run(closed, [x]), X)
    structured = {i for i, e in enumerate(closed.jaxpr.eqns) if structure_of(e) is not None}
    # Entering is not rebuilding: a call with effects is entered all the same.
    entered = {i for i in structured if Mode.ENTER in structure_of(closed.jaxpr.eqns[i]).modes}
    assert {path[0] for path, _ in kept.seen if path} == (entered if mode is Mode.ENTER else set())
    assert {path[0] for path, _ in rebuilt.seen if path} == structured and len(structured) == 3
    LOG.clear()
    expected = jax.block_until_ready(jax.jit(effects)(X))
    jax.effects_barrier()
    logged = list(LOG)
    LOG.clear()
    assert_identical(
        jax.block_until_ready(jax.jit(interpreted(effects, RebuildEffects(mode, Mode.REBUILD), X))(X)), expected
    )
    jax.effects_barrier()
    assert logged == LOG and len(logged) == 3


def test_rebuilding_keeps_rules_policies_and_effects():
    @jax.custom_vjp
    def tripled_gradient(x):
        return x * 2.0

    tripled_gradient.defvjp(lambda x: (x * 2.0, None), lambda _, ct: (ct * 3.0,))

    def f(x):
        y = jax.checkpoint(jnp.sin, prevent_cse=False, policy=jax.checkpoint_policies.dots_saveable)(x)
        jax.debug.callback(_record, y)
        return jnp.sum(tripled_gradient(y))

    rebuilt = interpreted(f, Uniform(Mode.REBUILD), X)
    entered = interpreted(f, Uniform(Mode.ENTER), X)
    assert_identical(jax.grad(rebuilt)(X), jax.grad(f)(X))
    # Entering drops the rule: the derivative is the body's (2, not 3).
    np.testing.assert_allclose(jax.grad(entered)(X), jax.grad(f)(X) * 2.0 / 3.0, rtol=1e-6)
    eqns = {e.primitive.name: e for e in jax.make_jaxpr(rebuilt)(X).jaxpr.eqns}
    assert eqns["remat2"].params["prevent_cse"] is False
    assert eqns["remat2"].params["policy"] is jax.checkpoint_policies.dots_saveable
    assert "custom_vjp_call" in eqns or "custom_vjp_call_jaxpr" in eqns
    assert any(e.effects for e in eqns.values())


def test_unsupported_mode_is_refused():
    closed = jax.make_jaxpr(scan_cond_jit)(X)

    class EnterAll(Hooks):
        def mode(self, eqn, labels, frame):
            return Mode.ENTER

    with pytest.raises(ValueError, match="scan cannot be evaluated in mode enter"):
        Interpreter(EnterAll()).run(closed, [X])


# -- every equation is seen --------------------------------------------------------


def all_equations(jaxpr: Any, hooks: Uniform, path: tuple[int, ...] = ()) -> set:
    """``(frame path, index)`` of every equation the interpreter evaluates
    with ``hooks``: nested ones where their equation is entered or rebuilt."""
    found = set()
    for index, eqn in enumerate(jaxpr.eqns):
        found.add((path, index))
        structure = structure_of(eqn)
        mode = Mode.KEEP if structure is None else hooks.mode(eqn, (), Frame())
        # A rebuild of an equation with effects binds it as it is.
        if mode is Mode.KEEP or (mode is Mode.REBUILD and eqn.effects):
            continue
        params = eqn.params
        if eqn.primitive.name == "cond":
            bodies = params["branches"]
        elif eqn.primitive.name == "while":
            bodies = (params["cond_jaxpr"], params["body_jaxpr"])
        else:
            bodies = (next(params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params),)
        for k, body in enumerate(bodies):
            found |= all_equations(closed_parts(body)[0], hooks, (*path, index, k))
    return found


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_hook_sees_every_equation(name, mode):
    f, _, _ = CORPUS[name]
    closed = jax.make_jaxpr(f)(X)
    hooks = MODES[mode]()
    jax.eval_shape(lambda x: Interpreter(hooks).run(closed, [x]), X)
    expected = all_equations(closed.jaxpr, hooks)
    assert set(hooks.seen) == expected
    if mode == "keep":
        assert len(hooks.seen) == len(closed.jaxpr.eqns)
    if mode == "enter":  # entered bodies are evaluated once each
        assert len(hooks.seen) == len(expected)


# -- the tests can fail ------------------------------------------------------------


class Perturb(Uniform):
    """Adds a small amount to the output of one nested ``primitive``."""

    def __init__(self, mode: Mode, primitive: str, fallback: Mode = Mode.KEEP):
        super().__init__(mode, fallback)
        self.primitive = primitive

    def equation(self, equation, invals, bind):
        outs = super().equation(equation, invals, bind)
        if equation.eqn.primitive.name == self.primitive and equation.frame.depth >= 2:
            outs = [outs[0] + jnp.asarray(1e-3, outs[0].dtype)] + outs[1:]
        return outs


@pytest.mark.parametrize(
    ("name", "mode", "primitive"),
    [
        ("scan_cond_jit", Mode.REBUILD, "sin"),
        ("scan_cond_jit", Mode.ENTER, "sin"),  # the jit entered inside the rebuilt scan and cond
        ("custom_functions", Mode.REBUILD, "sin"),
        ("jit_of_cond_of_scan", Mode.REBUILD, "mul"),
        ("while_in_jit", Mode.REBUILD, "sin"),
    ],
)
def test_a_perturbed_value_is_caught(name, mode, primitive):
    f, reverse, forward = CORPUS[name]
    hooks = Perturb(mode, primitive, fallback=Mode.REBUILD)
    g = interpreted(f, hooks, X)
    with pytest.raises(AssertionError):
        check_identity(f, g, X, reverse, forward)


def test_a_changed_derivative_is_caught():
    """A rebuilt custom_vjp whose body is right but whose derivative is not
    (entering drops a rule that differs from the body's derivative)."""

    @jax.custom_vjp
    def f_inner(x):
        return jnp.sin(x)

    f_inner.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x) * 1.0001,))

    def f(x):
        return jnp.sum(f_inner(x))

    g = interpreted(f, Uniform(Mode.ENTER), X)
    assert_identical(g(X), f(X))
    with pytest.raises(AssertionError):
        check_identity(f, g, X, True, forward=False)


# -- labels ------------------------------------------------------------------------


def test_labels_reach_a_fixed_point_through_loops_and_branches():
    def f(a, b, c):
        def body(carry, _):
            first, second = carry
            return (second, jax.lax.cond(first > 0, lambda: b, lambda: first)), None

        (first, second), _ = jax.lax.scan(body, (a, a * 0), None, length=3)
        return first, second, c + 1.0

    closed = jax.make_jaxpr(f)(1.0, 2.0, 3.0)
    tags = [frozenset({"a"}), frozenset({"b"}), NO_LABELS]
    for mode in (Mode.KEEP, Mode.REBUILD):
        labels = Interpreter(Uniform(mode)).labels(closed.jaxpr, tags, Frame())
        assert labels[2] == NO_LABELS
        if mode is Mode.REBUILD:  # b reaches both carries only through the loop
            assert labels[0] == labels[1] == frozenset({"a", "b"})
        else:
            assert labels[0] == frozenset({"a", "b"})


def test_labels_of_every_variable_and_of_a_loop_body():
    def f(a, b, c):
        def body(carry, _):
            first, second = carry
            return (second, jax.lax.cond(first > 0, lambda: b, lambda: first)), None

        (first, second), _ = jax.lax.scan(body, (a, a * 0), None, length=3)
        return first, second, c + 1.0

    jaxpr = jax.make_jaxpr(f)(1.0, 2.0, 3.0).jaxpr
    tags = [frozenset({"a"}), frozenset({"b"}), NO_LABELS]
    interp = Interpreter()
    every = interp.variable_labels(jaxpr, tags, Frame())
    assert [every[v] for v in jaxpr.invars] == tags
    assert [every.get(v, NO_LABELS) for v in jaxpr.outvars] == interp.labels(jaxpr, tags, Frame())
    ((index, scan),) = [(i, e) for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    eqn_tags = [every.get(v, NO_LABELS) for v in scan.invars]
    (body,) = interp.body_labels(scan, eqn_tags, Frame(), index)
    # b (a const of the body) reaches both carries through the loop.
    n_consts = scan_params(scan.params).num_consts
    assert body[n_consts:] == [frozenset({"a", "b"})] * 2
    with pytest.raises(ValueError, match="holds no jaxpr"):
        interp.body_labels(jaxpr.eqns[-1], [NO_LABELS, NO_LABELS], Frame())


def test_walk_reads_one_jaxpr_in_either_order():
    jaxpr = jax.make_jaxpr(scan_cond_jit)(X).jaxpr
    forward = list(walk(jaxpr))
    assert [i for i, _ in forward] == list(range(len(jaxpr.eqns)))
    assert all(eqn is jaxpr.eqns[i] for i, eqn in forward)
    assert list(walk(jaxpr, reverse=True)) == forward[::-1]
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    (body,) = sub_jaxprs(scan.params)
    assert body is scan.params["jaxpr"].jaxpr  # the open jaxpr of a ClosedJaxpr


class ByIndex(Uniform):
    """``Frame.data`` of a body: the indices of the equations leading to it,
    chosen by ``child_data`` from the equation's index."""

    def child_data(self, eqn, body, frame, index=None):
        return (*(frame.data or ()), index)

    def mode_at(self, eqn, index, labels, frame):
        self.asked.append((frame.path, index))
        return super().mode_at(eqn, index, labels, frame)

    def equation(self, equation, invals, bind):
        assert (equation.frame.data or ()) == equation.frame.path[::2]
        return super().equation(equation, invals, bind)


@pytest.mark.parametrize("mode", ["enter_in_rebuilt", "rebuild"])
@pytest.mark.parametrize("name", ["scan_cond_jit", "jit_of_cond_of_scan", "checkpoint_of_scan"])
def test_hooks_are_told_the_equation_index(name, mode):
    f, _, _ = CORPUS[name]
    closed = jax.make_jaxpr(f)(X)
    hooks = ByIndex(MODES[mode]().chosen, Mode.REBUILD)
    hooks.asked = []
    jax.eval_shape(lambda x: Interpreter(hooks).run(closed, [x]), X)
    structured = {(path, index) for path, index in hooks.seen if structure_of(_at(closed.jaxpr, path, index))}
    assert structured <= set(hooks.asked)


def _at(jaxpr: Any, path: tuple[int, ...], index: int) -> Any:
    """Equation ``index`` of the jaxpr at ``path`` (equation, body, ...)."""
    for eqn_index, body in zip(path[::2], path[1::2], strict=True):
        jaxpr = sub_jaxprs(jaxpr.eqns[eqn_index].params)[body]
    return jaxpr.eqns[index]


# -- shard_map ----------------------------------------------------------------------

SHARD_MAP = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from loss_scale._jaxpr import Interpreter, Hooks, Mode, structure_of

    assert len(jax.devices()) == 2
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    class Uniform(Hooks):
        def __init__(self, mode):
            self.chosen = mode
        def mode(self, eqn, labels, frame):
            modes = structure_of(eqn).modes
            return self.chosen if self.chosen in modes else Mode.REBUILD if Mode.REBUILD in modes else Mode.KEEP

    def local(w, x):
        def body(c, _):
            # The predicate agrees across devices: a branch whose derivative
            # holds a collective (the psum of w's cotangent) must be taken
            # by every device, or their rendezvous never completes.
            agreed = jax.lax.pmax(jax.lax.stop_gradient(jnp.sum(c)), "d") > 0
            c = jax.lax.cond(agreed, jax.jit(lambda v: jnp.sin(v) * w), jnp.cos, c)
            return c, None
        h = jax.lax.scan(body, x, length=2)[0]
        return jax.lax.psum(jnp.sum(h * w), "d"), jax.lax.pmean(h, "d")

    def f(w, x):
        out, h = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()))(w, x)
        return out + jnp.sum(h)

    w, x = jnp.float32(1.5), jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
    closed = jax.make_jaxpr(f)(w, x)
    assert any(e.primitive.name == "shard_map" for e in closed.jaxpr.eqns)
    def same(a, b):
        for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            p, q = np.atleast_1d(np.asarray(p)), np.atleast_1d(np.asarray(q))
            np.testing.assert_array_equal(p.view(np.uint8), q.view(np.uint8))
    for mode in (Mode.KEEP, Mode.ENTER, Mode.REBUILD):
        g = lambda w, x: Interpreter(Uniform(mode)).run(closed, [w, x])[0]
        same(jax.jit(g)(w, x), jax.jit(f)(w, x))
        same(jax.jit(jax.grad(g, argnums=(0, 1)))(w, x), jax.jit(jax.grad(f, argnums=(0, 1)))(w, x))
        same(jax.jit(lambda *p: jax.jvp(g, p, p))(w, x), jax.jit(lambda *p: jax.jvp(f, p, p))(w, x))
        ws = jnp.stack([w, -w])
        same(jax.jit(jax.vmap(g, in_axes=(0, None)))(ws, x), jax.jit(jax.vmap(f, in_axes=(0, None)))(ws, x))
        if mode is Mode.REBUILD:
            rebuilt = jax.make_jaxpr(g)(w, x).jaxpr.eqns
            assert any(e.primitive.name == "shard_map" for e in rebuilt)
    print("shard_map identity OK")
    """
)


def test_identity_under_shard_map_on_two_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", SHARD_MAP], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "shard_map identity OK" in result.stdout

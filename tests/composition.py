"""The composition matrix: every public entry point x every JAX feature that
a user combines it with, each cell compared with the unscaled reference.

The entry points come in three kinds, each with a driver the cells call:

* steppers (``STEPPERS``): every transformation factory, every preset,
  ``for_dtype`` per dtype, the fused ``apply_gradients``, flax's
  ``TrainState`` and ``Optimizer`` and Equinox's ``apply_gradients``. A cell
  runs three steps of known unscaled gradients (clean, overflowing, clean),
  multiplied by the scale the state holds, and compares the parameters with
  the bare optimizer fed the unscaled gradients that skips the overflow
  (``reference_params``).
* gradient functions (``GRADIENTS``): ``value_and_grad``,
  ``value_grad_and_peak``, flax's ``nnx_value_and_grad`` and Equinox's
  ``filter_value_and_grad``, compared with ``jax.value_and_grad`` of
  ``loss * scale`` on a float16 model.
* ``range_report``, whose ``max_safe_scale`` is compared with ``jax.grad``
  run at every power of two.

``FEATURES`` lists the JAX features; ``EXCLUDED`` holds, in one place, every
(entry, feature) cell that does not apply and why. The test modules
``test_composition_*.py`` run the cells; ``test_composition_matrix.py``
checks that every cell is run or excluded, never both.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls

HAVE_FLAX = importlib.util.find_spec("flax") is not None
HAVE_EQUINOX = importlib.util.find_spec("equinox") is not None
HAVE_ORBAX = importlib.util.find_spec("orbax") is not None
HAVE_CLOUDPICKLE = importlib.util.find_spec("cloudpickle") is not None


def enable_x64(on: bool = True):
    """``jax.enable_x64`` (a context manager), or its older home in
    ``jax.experimental`` on the oldest supported jax."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(on)
    from jax.experimental import enable_x64 as older

    return older(on)


# Features of the call (how the entry point is run) and of the loss function
# (what the differentiated function contains).
CALL_FEATURES = (
    "eager",
    "jit",
    "vmap",
    "scan",
    "while_loop",
    "cond",
    "grad",
    "jvp",
    "remat",
    "shard_map",
    "pmap",
    "donation",
    "eval_shape",
    "copy",
    "deepcopy",
    "pickle",
    "checkpoint",
    "x64",
)
LOSS_FEATURES = (
    "loss_custom_vjp",
    "loss_while_loop",
    "loss_cond",
    "loss_pure_callback",
    "loss_scan",
    "loss_remat",
)
FEATURES = CALL_FEATURES + LOSS_FEATURES

_NOT_A_LOSS = "a stepper sees only gradients; what the loss function contains is a cell of the gradient functions"
_FUNCTION = "a function of arrays holding no state: copying or restoring it is Python's; its state is the steppers'"
_NO_BUFFERS = "returns new arrays and updates none in place: there is nothing to donate"
_NNX = (
    "NNX objects are mutable Python objects: JAX transformations take them through flax's own nnx.* "
    "transforms (nnx.jit is checked); the functional steppers cover the rest"
)
_REPORT_HOST = "range_report runs several programs and returns Python floats: it is called outside JAX transformations"

# Every cell that does not apply, with the reason (entry "*" of a kind: all of
# that kind).
EXCLUDED: dict[tuple[str, str], str] = {
    **{("stepper:*", f): _NOT_A_LOSS for f in LOSS_FEATURES},
    **{("gradient:*", f): _FUNCTION for f in ("copy", "deepcopy", "pickle", "checkpoint")},
    ("gradient:*", "donation"): _NO_BUFFERS,
    **{
        ("stepper:flax.Optimizer", f): _NNX
        for f in CALL_FEATURES
        if f not in ("eager", "jit", "copy", "deepcopy", "checkpoint", "eval_shape")
    },
    ("stepper:flax.Optimizer", "eval_shape"): "an NNX optimizer is built eagerly; nnx.eval_shape is flax's to test",
    **{("gradient:flax.nnx_value_and_grad", f): _NNX for f in CALL_FEATURES if f not in ("eager", "jit", "x64")},
    **{("report:range_report", f): _REPORT_HOST for f in CALL_FEATURES if f not in ("eager", "x64")},
}


def kind_of(entry: str) -> str:
    return entry.split(":", 1)[0]


def excluded(entry: str, feature: str) -> str | None:
    """Why the cell does not apply, or ``None`` when it runs."""
    return EXCLUDED.get((entry, feature)) or EXCLUDED.get((f"{kind_of(entry)}:*", feature))


# ---------------------------------------------------------------- steppers

PARAMS = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], jnp.float32), "b": jnp.array([0.1, -0.2])}


def inner() -> optax.GradientTransformation:
    """Stateful (a momentum trace a skipped step must not touch) and sensitive
    to the gradients' scale (so a wrong unscale shows)."""
    return optax.sgd(0.1, momentum=0.9)


def unscaled_grads(run: int = 0, overflow: bool = True) -> list[dict[str, jax.Array]]:
    """Three steps of unscaled gradients; the second overflows (an inf in
    ``b``) when ``overflow``."""
    rng = np.random.default_rng(run)
    steps = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.05, p.dtype), PARAMS) for _ in range(3)]
    if overflow:
        steps[1]["b"] = steps[1]["b"].at[0].set(jnp.inf)
    return steps


def digest(tree: Any) -> tuple:
    """A hashable fingerprint of a tree of concrete arrays, for caching the
    references that many cells share."""
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef), *((np.asarray(x).dtype.str, np.asarray(x).shape, np.asarray(x).tobytes()) for x in leaves))


_REFERENCES: dict[tuple, Any] = {}


def reference_params(grads: list, skips: bool = True, params: Any = PARAMS) -> Any:
    """The bare optimizer on the unscaled gradients, skipping non-finite
    steps when ``skips`` (as a loss-scaling transformation does); computed
    once per gradient sequence, and shared by the cells."""
    concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((grads, params)))
    key = (digest(grads), skips, digest(params)) if concrete else None
    if key in _REFERENCES:
        return _REFERENCES[key]
    result = _reference_params(grads, skips, params)
    if key is not None:
        _REFERENCES[key] = result
    return result


def _reference_params(grads: list, skips: bool, params: Any) -> Any:
    tx = inner()
    state = tx.init(params)
    for g in grads:
        if skips and not bool(ls.all_finite(g)):
            continue
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


class Stepper(NamedTuple):
    """How a cell drives one entry point: ``init(params) -> carry``,
    ``step(carry, scaled_grads) -> carry``, and how to read the parameters
    and the loss scale off the carry. ``skips``: whether a non-finite
    step is skipped (``no_op`` applies it by default)."""

    init: Callable[[Any], Any]
    step: Callable[[Any, Any], Any]
    params: Callable[[Any], Any]
    scale: Callable[[Any], jax.Array]
    skips: bool = True
    mutable: bool = False


def _optax_stepper(make_tx: Callable[[], Any], fused: bool = False, skips: bool = True):
    def build(tweak=lambda tx: tx):
        tx = tweak(make_tx())

        def step(carry, grads):
            params, opt_state = carry
            if fused:
                return ls.apply_gradients(tx, grads, opt_state, params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return Stepper(lambda p: (p, tx.init(p)), step, lambda c: c[0], lambda c: ls.get_scale(c[1]), skips)

    return build


def _train_state_stepper(tweak=lambda tx: tx):
    from loss_scale.flax import TrainState

    tx = tweak(ls.dynamic(inner()))
    return Stepper(
        lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
        lambda state, grads: state.apply_gradients(grads=grads),
        lambda state: state.params,
        lambda state: ls.get_scale(state.opt_state),
    )


def _equinox_stepper(tweak=lambda tx: tx):
    from loss_scale import equinox as lsq

    tx = tweak(ls.dynamic(inner()))

    def step(carry, grads):
        model, opt_state = carry
        return lsq.apply_gradients(tx, grads, opt_state, model)

    return Stepper(lambda p: (p, tx.init(p)), step, lambda c: c[0], lambda c: ls.get_scale(c[1]))


def _nnx_stepper(tweak=lambda tx: tx):
    from flax import nnx

    from loss_scale.flax import Optimizer, get_scale

    class Model(nnx.Module):
        def __init__(self, params):
            self.w = nnx.Param(params["w"])
            self.b = nnx.Param(params["b"])

    tx = tweak(ls.dynamic(inner()))

    def init(params):
        model = Model(params)
        return model, Optimizer(model, tx, wrt=nnx.Param)

    def step(carry, grads):
        model, optimizer = carry
        grads = nnx.State({"w": nnx.Param(grads["w"]), "b": nnx.Param(grads["b"])})
        optimizer.update(model, grads)
        return model, optimizer

    return Stepper(
        init,
        step,
        lambda c: {"w": c[0].w[...], "b": c[0].b[...]},
        lambda c: get_scale(c[1]),
        mutable=True,
    )


def _options_tx():
    # Every option on, none changing the update: a norm bound far above the
    # gradients' norm clips nothing.
    return ls.dynamic(
        inner(),
        max_grad_norm=1e6,
        track_grad_norm=True,
        locate_overflows=True,
        track_underflow=True,
        hysteresis=2,
        max_consecutive_skips=10,
    )


def _preset(name: str) -> Callable[[], Any]:
    return lambda: getattr(ls.presets, name)(inner())


STEPPERS: dict[str, Callable[..., Stepper]] = {
    "stepper:dynamic": _optax_stepper(lambda: ls.dynamic(inner())),
    "stepper:dynamic(all options)": _optax_stepper(_options_tx),
    "stepper:predictive": _optax_stepper(lambda: ls.predictive(inner())),
    "stepper:static": _optax_stepper(lambda: ls.static(inner(), 1024.0)),
    "stepper:no_op": _optax_stepper(lambda: ls.no_op(inner()), skips=False),
    "stepper:no_op(skip_nonfinite)": _optax_stepper(lambda: ls.no_op(inner(), skip_nonfinite=True)),
    **{
        f"stepper:for_dtype({d})": _optax_stepper(lambda d=d: ls.for_dtype(inner(), d), skips=d == "float16")
        for d in ("float16", "bfloat16", "float32")
    },
    **{f"stepper:presets.{name}": _optax_stepper(_preset(name)) for name in ls.presets.__all__},
    "stepper:apply_gradients": _optax_stepper(lambda: ls.dynamic(inner()), fused=True),
    "stepper:apply_gradients(predictive)": _optax_stepper(lambda: ls.predictive(inner()), fused=True),
}
if HAVE_FLAX:
    STEPPERS["stepper:flax.TrainState"] = _train_state_stepper
    STEPPERS["stepper:flax.Optimizer"] = _nnx_stepper
if HAVE_EQUINOX:
    STEPPERS["stepper:equinox.apply_gradients"] = _equinox_stepper


def one_step(stepper: Stepper, carry: Any, grads: Any) -> Any:
    """One step on ``grads * scale``, the scale read from the carry (as
    ``value_and_grad`` gives gradients of ``loss * scale``)."""
    scale = stepper.scale(carry)
    return stepper.step(carry, jax.tree.map(lambda g: g * scale.astype(g.dtype), grads))


def stack(trees: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def copier(feature: str) -> Callable[[Any], Any]:
    if feature == "copy":
        return copy.copy
    if feature == "deepcopy":
        return copy.deepcopy
    import cloudpickle

    return lambda obj: cloudpickle.loads(cloudpickle.dumps(obj))


# How close a cell's float32 parameters after a few optimizer steps are to the
# reference's (``assert_trees_close(..., **PARAMS_CLOSE)``): the bare optimizer
# runs unfused op by op, the cell's program may fuse and contract (FMA), so they
# agree to a few float32 roundings; a skipped step applied, or a wrong unscale,
# moves them by about the learning rate times a gradient (>1e-3).
PARAMS_CLOSE = {"rtol": 2e-6, "atol": 2e-7}


# ------------------------------------------------------- gradient functions

SCALE = 2.0**10
X = jnp.asarray(np.random.default_rng(7).normal(size=(6, 3)), jnp.float32)
GPARAMS = {"w": jnp.asarray(np.random.default_rng(8).normal(size=(3, 2)) * 0.5, jnp.float32), "b": jnp.ones(2) * 0.1}


def _layer(p, h):
    return jnp.tanh(h @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)[None])


@jax.custom_vjp
def _custom_square(h):
    return h * h


def _custom_square_fwd(h):
    return h * h, h


def _custom_square_bwd(h, ct):
    return (2 * h * ct,)


_custom_square.defvjp(_custom_square_fwd, _custom_square_bwd)


def _halve_until_small(x):
    # Data only: a while_loop that jax.grad never differentiates.
    return jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 1.0, lambda v: v / 2, x)


def _host_sort(x):
    # Data only: a host callback that jax.grad never differentiates.
    return jax.pure_callback(lambda v: np.sort(np.asarray(v), axis=-1), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _loss_plain(p, x):
    h = _layer(p, x.astype(jnp.float16))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _loss_custom_vjp(p, x):
    h = _layer(p, x.astype(jnp.float16))
    return jnp.mean(_custom_square(h).astype(jnp.float32))


def _loss_while_loop(p, x):
    return _loss_plain(p, _halve_until_small(x))


def _loss_cond(p, x):
    h16 = x.astype(jnp.float16)
    h = jax.lax.cond(jnp.sum(x) > 0, lambda: _layer(p, h16), lambda: -_layer(p, h16))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _loss_pure_callback(p, x):
    return _loss_plain(p, _host_sort(x))


def _loss_scan(p, x):
    # A param-dependent carry through three steps of a scan.
    def body(h, _):
        out = jnp.tanh(h @ p["w"].astype(jnp.float16)[:2, :] + p["b"].astype(jnp.float16)[None])
        return out, None

    h0 = _layer(p, x.astype(jnp.float16))
    h, _ = jax.lax.scan(body, h0, None, length=3)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _loss_remat(p, x):
    h = jax.checkpoint(_layer)(p, x.astype(jnp.float16))
    return jnp.mean(h.astype(jnp.float32) ** 2)


LOSSES: dict[str, Callable] = {
    "plain": _loss_plain,
    "loss_custom_vjp": _loss_custom_vjp,
    "loss_while_loop": _loss_while_loop,
    "loss_cond": _loss_cond,
    "loss_pure_callback": _loss_pure_callback,
    "loss_scan": _loss_scan,
    "loss_remat": _loss_remat,
}


def opt_state() -> Any:
    return ls.dynamic(optax.sgd(0.1), initial_scale=SCALE).init(GPARAMS)


def _value_and_grad(loss):
    return lambda state, params, x: ls.value_and_grad(loss)(state, params, x)


def _value_grad_and_peak(loss):
    def call(state, params, x):
        value, grads, peak = ls.value_grad_and_peak(loss)(state, params, x)
        return value, grads

    return call


def _filter_value_and_grad(loss):
    from loss_scale import equinox as lsq

    return lambda state, params, x: lsq.filter_value_and_grad(loss)(state, params, x)


def _nnx_value_and_grad(loss):
    from flax import nnx

    from loss_scale.flax import nnx_value_and_grad

    class Model(nnx.Module):
        def __init__(self, params):
            self.w = nnx.Param(params["w"])
            self.b = nnx.Param(params["b"])

    def call(state, params, x):
        model = Model(params)
        value, grads = nnx_value_and_grad(lambda m, x: loss({"w": m.w[...], "b": m.b[...]}, x))(state, model, x)
        return value, {"w": grads["w"][...], "b": grads["b"][...]}

    return call


GRADIENTS: dict[str, Callable[[Callable], Callable]] = {
    "gradient:value_and_grad": _value_and_grad,
    "gradient:value_grad_and_peak": _value_grad_and_peak,
}
if HAVE_EQUINOX:
    GRADIENTS["gradient:equinox.filter_value_and_grad"] = _filter_value_and_grad
if HAVE_FLAX:
    GRADIENTS["gradient:flax.nnx_value_and_grad"] = _nnx_value_and_grad


def reference_value_and_grad(loss):
    """``jax.value_and_grad`` of ``loss * scale``, returning the unscaled loss
    as the entry points do."""

    def call(state, params, x):
        scale = ls.get_scale(state)
        value, grads = jax.value_and_grad(lambda p: loss(p, x) * scale)(params)
        return value / scale, grads

    return call


# How close the values of a float16 model from two different programs (the
# entry point's and ``jax.value_and_grad``'s) are
# (``assert_trees_close_to_largest(..., **FLOAT16_CLOSE)``): XLA may fuse them
# differently, and on CPUs with AVX512-FP16 float16 rounds differently eagerly
# and under jit, so they agree to a few float16 roundings (2**-11 each,
# relative to the largest element), not bit for bit. A missing or doubled
# scale is a factor of 2**10.
FLOAT16_CLOSE = {"rtol": 8 * 2.0**-11, "floor": 1e-30}


def excluded_cells() -> list[tuple[str, str, str]]:
    """Every cell that does not apply: (entry, feature, reason)."""
    entries = [*STEPPERS, *GRADIENTS, "report:range_report"]
    return [(e, f, r) for e in entries for f in FEATURES if (r := excluded(e, f))]


def run_cells(kind: str) -> list[tuple[str, str]]:
    entries = {"stepper": STEPPERS, "gradient": GRADIENTS, "report": {"report:range_report": None}}[kind]
    return [(e, f) for e in entries for f in FEATURES if not excluded(e, f)]

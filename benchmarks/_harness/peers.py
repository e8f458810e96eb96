"""The training variants: one function per way of training with (or without)
a loss scaler, each as a full train step and as the update alone.

The state threaded through a variant is ``(params, opt_state, extra)``:
``params`` is the model's params (an ``eqx.Module`` for the Equinox family),
``extra`` a peer's own loss-scale arrays (``None`` where the scale lives in
the optimizer state). Every variant trains with ``optax.adam(1e-3)`` and
scales the loss by the same power of two, so the scaled variants must
reproduce bare Adam's update to float32 rounding (``check_updates``).

Variants, by key (``ALL``, in table order):

* ``bare``: plain Adam, unscaled loss, no check: the baseline;
* ``ls``: ``loss_scale.dynamic``, ``tx.update`` + ``optax.apply_updates``;
* ``ls-fused``: the same transformation with ``ls.apply_gradients``;
* ``ls-static``, ``ls-no-op``, ``ls-bf16``: ``loss_scale.static`` at the
  same scale, ``loss_scale.no_op`` and ``loss_scale.for_dtype(bfloat16)``
  (no scaling: the no-op's cost is the one to compare with bare Adam);
* ``ls-trainstate``: ``loss_scale.flax.TrainState.apply_gradients``;
* ``nnx-bare``, ``ls-nnx``: the same params held by an NNX module and
  trained by ``nnx.Optimizer(adam)``, and by ``loss_scale.flax.Optimizer``
  with ``nnx_value_and_grad`` (both against the plain bare step);
* ``apply-if-finite``: ``optax.apply_if_finite`` (a check, no scaling);
* ``jmp``: ``jmp.DynamicLossScale`` + ``jmp.select_tree``, as jmp's README;
* ``flax``: flax's ``DynamicScale.value_and_grad`` + ``jnp.where``;
* ``eqx-bare``, ``eqx-ls``, ``mpx``: the Equinox MLP trained bare, with
  ``loss_scale.equinox`` and with MPX (``mixed-precision-for-JAX``);
* ``*-overflow``: a variant's own executables fed so that every step
  overflows and is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls

from .models import Model

PyTree = Any
State = tuple[PyTree, PyTree, PyTree]  # (params, opt_state, extra)

LEARNING_RATE = 1e-3
# The same power of two for every scaler: dividing by it is exact.
LOSS_SCALE = 2.0**15
# optax.apply_if_finite's limit; it only matters after that many consecutive
# non-finite steps, which the benchmark never reaches.
MAX_CONSECUTIVE_ERRORS = 5

BARE = "adam (bare)"
LS = "ls.dynamic"
LS_OVERFLOW = "ls.dynamic overflow"
LS_FUSED = "ls.dynamic + ls.apply_gradients"
LS_STATIC = "ls.static"
LS_NO_OP = "ls.no_op"
LS_BF16 = "ls.for_dtype(bfloat16)"
LS_FUSED_OVERFLOW = "ls.dynamic + ls.apply_gradients overflow"
LS_TRAIN_STATE = "ls.dynamic + loss_scale.flax.TrainState"
NNX_BARE = "nnx: adam (bare), nnx.Optimizer"
LS_NNX = "nnx: ls.dynamic + loss_scale.flax.Optimizer"
APPLY_IF_FINITE = "optax.apply_if_finite"
JMP = "jmp DynamicLossScale"
FLAX = "flax DynamicScale"
EQX_BARE = "eqx: adam (bare)"
EQX_LS = "eqx: ls.dynamic + loss_scale.equinox"
EQX_LS_OVERFLOW = "eqx: ls.dynamic + loss_scale.equinox overflow"
MPX = "eqx: MPX DynamicLossScaling"
MPX_OVERFLOW = "eqx: MPX DynamicLossScaling overflow"

PYTREE, EQUINOX = "pytree", "equinox"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of training, as a full train step and as the update alone.

    Attributes:
      name: the row label.
      family: ``"pytree"`` (params are a pytree of arrays) or ``"equinox"``
        (params are an ``eqx.Module``); a variant runs on its family's model.
      init: params -> (opt_state, extra).
      train_step: (params, opt_state, extra, batch) -> (params, opt_state,
        extra, loss): forward, backward, update and apply.
      update: (params, opt_state, extra, grads) -> (params, opt_state, extra),
        given gradients of the loss multiplied by ``grad_scale``.
      applied: (opt_state, extra) -> whether the last step applied its update.
      grad_scale: the scale of the gradients ``update`` expects.
      baseline: the variant whose time this one's ratios divide by (``None``
        for a baseline itself).
      overflow_inputs: (state, batch) -> (state, batch) on which every full
        step overflows; ``None`` where the variant has no overflow row.
      same_as: the variant whose executables this one runs (overflow rows).
      overflow: every step of this variant must be skipped.
    """

    name: str
    family: str
    init: Callable[[PyTree], tuple[PyTree, PyTree]]
    train_step: Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree, PyTree, jax.Array]]
    update: Callable[[PyTree, PyTree, PyTree, PyTree], State]
    applied: Callable[[PyTree, PyTree], jax.Array]
    grad_scale: float = 1.0
    baseline: str | None = BARE
    overflow_inputs: Callable[[State, PyTree], tuple[State, PyTree]] | None = None
    same_as: str | None = None
    overflow: bool = False


def adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def _applied_from_state(opt_state: PyTree, extra: PyTree) -> jax.Array:
    del extra
    if isinstance(opt_state, ls.LossScaleState):
        return jnp.logical_not(opt_state.skipped)
    if isinstance(opt_state, optax.ApplyIfFiniteState):
        return opt_state.last_finite
    return jnp.array(True)


def _scale_to_inf(state: State, batch: PyTree) -> tuple[State, PyTree]:
    """The state on which every full ``ls.dynamic`` step overflows: a scale
    of inf turns the backward pass into inf/nan (as a too-large scale
    overflows float16, only certain) and is a fixed point of the backoff, so
    every round runs the normal step's executable on the same state."""
    params, opt_state, extra = state
    return (params, opt_state._replace(scale=jnp.asarray(jnp.inf, jnp.float32)), extra), batch


def _poison_batch(state: State, batch: PyTree) -> tuple[State, PyTree]:
    """An MLP batch with one inf input: the loss and every gradient are
    non-finite at any scale (for scalers whose scale is not a fixed point
    at inf, such as MPX's, which clips it to float16's maximum)."""
    return state, {**batch, "x": poison(batch["x"])}


def poison(tree: PyTree) -> PyTree:
    """``tree`` with one inf, in the first element of its first leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    first = leaves[0]
    leaves[0] = first.reshape(-1).at[0].set(jnp.inf).reshape(first.shape)
    return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------
# Plain pytrees: bare, loss_scale's paths, optax, jmp, flax
# ---------------------------------------------------------------------------


def _optax_variant(
    name: str,
    tx: optax.GradientTransformation,
    model: Model,
    *,
    scaled: bool,
    fused: bool = False,
    scale: float = LOSS_SCALE,
) -> Variant:
    """A variant whose whole logic is one optax transformation: ``scaled``
    takes the gradients of the scaled loss with ``ls.value_and_grad``;
    ``fused`` applies them with ``ls.apply_gradients`` instead of
    ``tx.update`` + ``optax.apply_updates``; ``scale``: the scale of
    ``tx``'s state (1 for the unscaled ones, which have no overflow row)."""

    def init(params):
        return tx.init(params), None

    def update(params, opt_state, extra, grads):
        if fused:
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, extra
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, extra

    def train_step(params, opt_state, extra, batch):
        if scaled:
            loss, grads = ls.value_and_grad(model.loss_fn)(opt_state, params, batch)
        else:
            loss, grads = jax.value_and_grad(model.loss_fn)(params, batch)
        return *update(params, opt_state, extra, grads), loss

    return Variant(
        name,
        PYTREE,
        init,
        train_step,
        update,
        _applied_from_state,
        grad_scale=scale if scaled else 1.0,
        baseline=None if name == BARE else BARE,
        overflow_inputs=_scale_to_inf if scaled and scale != 1.0 else None,
    )


def bare(model: Model) -> Variant:
    """Adam on the unscaled loss: the baseline."""
    return _optax_variant(BARE, adam(), model, scaled=False)


def ls_update(model: Model) -> Variant:
    """``ls.dynamic(adam)`` through the optax API: ``tx.update``, then
    ``optax.apply_updates`` outside."""
    return _optax_variant(LS, ls.dynamic(adam(), initial_scale=LOSS_SCALE), model, scaled=True)


def ls_static(model: Model) -> Variant:
    """``ls.static(adam)`` at the benchmark's scale, through the optax API."""
    return _optax_variant(LS_STATIC, ls.static(adam(), scale=LOSS_SCALE), model, scaled=True)


def ls_no_op(model: Model) -> Variant:
    """``ls.no_op(adam)``: scale 1, nothing checked, the same state layout."""
    return _optax_variant(LS_NO_OP, ls.no_op(adam()), model, scaled=True, scale=1.0)


def ls_bf16(model: Model) -> Variant:
    """``ls.for_dtype(adam, bfloat16)``: what a bfloat16 run gets."""
    return _optax_variant(LS_BF16, ls.for_dtype(adam(), jnp.bfloat16), model, scaled=True, scale=1.0)


def ls_fused(model: Model) -> Variant:
    """``ls.dynamic(adam)`` with ``ls.apply_gradients`` (the update added to
    the params inside the taken branch)."""
    return _optax_variant(LS_FUSED, ls.dynamic(adam(), initial_scale=LOSS_SCALE), model, scaled=True, fused=True)


def ls_train_state(model: Model) -> Variant | str:
    """``loss_scale.flax.TrainState.apply_gradients`` (the fused step behind
    flax's TrainState API); the state's ``step`` is the extra array."""
    try:
        from loss_scale.flax import TrainState
    except ImportError:
        return f"{LS_TRAIN_STATE}: skipped (flax not installed)"
    tx = ls.dynamic(adam(), initial_scale=LOSS_SCALE)

    def init(params):
        return tx.init(params), jnp.zeros((), jnp.int32)

    def update(params, opt_state, step, grads):
        state = TrainState(step=step, apply_fn=None, params=params, tx=tx, opt_state=opt_state)
        state = state.apply_gradients(grads=grads)
        return state.params, state.opt_state, state.step

    def train_step(params, opt_state, step, batch):
        loss, grads = ls.value_and_grad(model.loss_fn)(opt_state, params, batch)
        return *update(params, opt_state, step, grads), loss

    return Variant(
        LS_TRAIN_STATE, PYTREE, init, train_step, update, _applied_from_state, LOSS_SCALE, overflow_inputs=None
    )


def _nnx_variant(name: str, model: Model, *, scaled: bool) -> Variant | str:
    """An NNX training loop on the model's params: each leaf an ``nnx.Param``
    of one module, trained by an optimizer that ``nnx.split`` turns into the
    threaded state and ``nnx.merge`` rebuilds inside the step (the functional
    form of ``nnx.jit``: the graph work happens while tracing, not per step).
    ``scaled``: ``loss_scale.flax.Optimizer(ls.dynamic(adam))`` with
    ``nnx_value_and_grad``; else ``nnx.Optimizer(adam)`` with ``nnx.value_and_grad``."""
    try:
        from flax import nnx

        from loss_scale import flax as lsf
    except ImportError:
        return f"{name}: skipped (flax not installed)"

    class Params(nnx.Module):
        def __init__(self, params: PyTree):
            self.params = nnx.data(jax.tree.map(nnx.Param, params))

        def tree(self) -> PyTree:
            return jax.tree.map(lambda v: v[...], self.params, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def loss_fn(module, batch):
        return model.loss_fn(module.tree(), batch)

    def optimizer(module):
        if scaled:
            return lsf.Optimizer(module, ls.dynamic(adam(), initial_scale=LOSS_SCALE), wrt=nnx.Param)
        return nnx.Optimizer(module, adam(), wrt=nnx.Param)

    # The optimizer's graph: the same for every params of the model's structure.
    graph = nnx.split(optimizer(Params(model.params)))[0]

    def init(params):
        return nnx.split(optimizer(Params(params)))[1], None

    def run(params, opt_state, batch=None, grads=None):
        module, opt = Params(params), nnx.merge(graph, opt_state)
        loss = None
        if grads is None:
            if scaled:
                loss, grads = lsf.nnx_value_and_grad(loss_fn)(opt, module, batch)
            else:
                loss, grads = nnx.value_and_grad(loss_fn)(module, batch)
        else:
            grads = nnx.state(Params(grads), nnx.Param)
        opt.update(module, grads)
        return module.tree(), nnx.split(opt)[1], loss

    def update(params, opt_state, extra, grads):
        params, opt_state, _ = run(params, opt_state, grads=grads)
        return params, opt_state, extra

    def train_step(params, opt_state, extra, batch):
        params, opt_state, loss = run(params, opt_state, batch=batch)
        return params, opt_state, extra, loss

    def applied(opt_state, extra):
        return _applied_from_state(nnx.as_pure(nnx.merge(graph, opt_state).opt_state), extra)

    return Variant(name, PYTREE, init, train_step, update, applied, grad_scale=LOSS_SCALE if scaled else 1.0)


def nnx_bare(model: Model) -> Variant | str:
    """``nnx.Optimizer(adam)`` on an NNX module holding the params."""
    return _nnx_variant(NNX_BARE, model, scaled=False)


def ls_nnx(model: Model) -> Variant | str:
    """``loss_scale.flax.Optimizer(ls.dynamic(adam))`` (the fused step behind
    NNX's optimizer API) with ``nnx_value_and_grad``."""
    return _nnx_variant(LS_NNX, model, scaled=True)


def apply_if_finite(model: Model) -> Variant:
    """``optax.apply_if_finite(adam)``: checks, does not scale."""
    tx = optax.apply_if_finite(adam(), max_consecutive_errors=MAX_CONSECUTIVE_ERRORS)
    return _optax_variant(APPLY_IF_FINITE, tx, model, scaled=False)


def jmp_dynamic(model: Model) -> Variant | str:
    """jmp's README recipe: scale the loss, unscale the grads, check them with
    ``all_finite``, adjust the scale, and ``select_tree`` between the new and
    the old (params, opt_state).

    The step takes the scale's arrays ``(loss_scale, counter)`` and rebuilds
    the ``jmp.DynamicLossScale`` inside: jmp 0.0.4 validates its fields in
    ``__post_init__``, which breaks when ``jit(...).lower`` unflattens it
    around placeholder leaves; its default ``min_loss_scale`` of 1 is what its
    own unflatten would restore anyway.
    """
    try:
        import jmp
    except ImportError:
        return f"{JMP}: skipped (not installed; pip install jmp)"
    tx = adam()

    def init(params):
        return tx.init(params), (jnp.asarray(LOSS_SCALE, jnp.float32), jnp.zeros((), jnp.int32))

    def update(params, opt_state, scale_arrays, grads):
        loss_scale = jmp.DynamicLossScale(*scale_arrays)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, (loss_scale.loss_scale, loss_scale.counter)

    def train_step(params, opt_state, scale_arrays, batch):
        loss_scale = jmp.DynamicLossScale(*scale_arrays)
        loss, grads = jax.value_and_grad(lambda p, b: loss_scale.scale(model.loss_fn(p, b)))(params, batch)
        return *update(params, opt_state, scale_arrays, grads), loss_scale.unscale(loss)

    def applied(opt_state, scale_arrays):
        # The counter counts clean steps modulo the period and resets on overflow.
        return scale_arrays[1] > 0

    return Variant(JMP, PYTREE, init, train_step, update, applied, grad_scale=LOSS_SCALE)


@jax.custom_vjp
def _inject_grads(params: PyTree, grads: PyTree) -> jax.Array:
    """A zero "loss" whose gradient with respect to ``params`` is ``grads``.

    Lets the update-only benchmark run flax's own ``DynamicScale.value_and_grad``
    (which unscales, checks and adjusts inside it) on precomputed gradients
    without re-deriving flax's logic here. The cotangent is ignored, so the
    gradients pass through untouched and XLA sees no extra arithmetic.
    """
    del params, grads
    return jnp.zeros((), jnp.float32)


def _inject_fwd(params: PyTree, grads: PyTree) -> tuple[jax.Array, PyTree]:
    del params
    return jnp.zeros((), jnp.float32), grads


def _inject_bwd(grads: PyTree, cotangent: jax.Array) -> tuple[PyTree, PyTree]:
    del cotangent
    return grads, jax.tree.map(jnp.zeros_like, grads)


_inject_grads.defvjp(_inject_fwd, _inject_bwd)


def flax_dynamic_scale(model: Model) -> Variant | str:
    """flax's recipe: ``DynamicScale.value_and_grad`` (scaled loss; returns
    unscaled grads, an ``is_fin`` flag and the adjusted scale), the update,
    then ``jnp.where(is_fin, new, old)`` over params and optimizer state, as
    in flax's ImageNet example."""
    try:
        from flax.training.dynamic_scale import DynamicScale
    except ImportError:
        return f"{FLAX}: skipped (flax not installed)"
    tx = adam()

    def init(params):
        # Explicit dtypes, so that the state that comes out of a step has the
        # avals of the state that went in (no weak types).
        return tx.init(params), DynamicScale(
            fin_steps=jnp.zeros((), jnp.int32), scale=jnp.asarray(LOSS_SCALE, jnp.float32)
        )

    def finish(params, opt_state, dynamic_scale, is_fin, grads):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(select, new_params, params)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return params, opt_state, dynamic_scale

    def update(params, opt_state, dynamic_scale, grads):
        new_scale, is_fin, _, grads = dynamic_scale.value_and_grad(_inject_grads)(params, grads)
        return finish(params, opt_state, new_scale, is_fin, grads)

    def train_step(params, opt_state, dynamic_scale, batch):
        new_scale, is_fin, loss, grads = dynamic_scale.value_and_grad(model.loss_fn)(params, batch)
        return *finish(params, opt_state, new_scale, is_fin, grads), loss

    def applied(opt_state, dynamic_scale):
        return dynamic_scale.fin_steps > 0

    return Variant(FLAX, PYTREE, init, train_step, update, applied, grad_scale=LOSS_SCALE)


# ---------------------------------------------------------------------------
# Equinox: bare, loss_scale.equinox, MPX
# ---------------------------------------------------------------------------


def eqx_bare(model: Model) -> Variant | str:
    """Adam on an ``eqx.Module`` the Equinox way: ``eqx.filter_value_and_grad``,
    ``tx.update``, ``eqx.apply_updates``. Its own ratio is to the plain
    pytree bare step (what Equinox itself costs); the Equinox rows' ratios
    are to it."""
    try:
        import equinox as eqx
    except ImportError:
        return f"{EQX_BARE}: skipped (equinox not installed)"
    tx = adam()

    def init(module):
        return tx.init(eqx.filter(module, eqx.is_inexact_array)), None

    def update(module, opt_state, extra, grads):
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(module, eqx.is_inexact_array))
        return eqx.apply_updates(module, updates), opt_state, extra

    def train_step(module, opt_state, extra, batch):
        loss, grads = eqx.filter_value_and_grad(model.loss_fn)(module, batch)
        return *update(module, opt_state, extra, grads), loss

    return Variant(EQX_BARE, EQUINOX, init, train_step, update, _applied_from_state, baseline=BARE)


def eqx_ls(model: Model) -> Variant | str:
    """``ls.dynamic(adam)`` on an ``eqx.Module``:
    ``loss_scale.equinox.filter_value_and_grad`` + ``apply_gradients``."""
    try:
        import equinox as eqx

        from loss_scale import equinox as lsq
    except ImportError:
        return f"{EQX_LS}: skipped (equinox not installed)"
    tx = ls.dynamic(adam(), initial_scale=LOSS_SCALE)

    def init(module):
        return tx.init(eqx.filter(module, eqx.is_inexact_array)), None

    def update(module, opt_state, extra, grads):
        module, opt_state = lsq.apply_gradients(tx, grads, opt_state, module)
        return module, opt_state, extra

    def train_step(module, opt_state, extra, batch):
        loss, grads = lsq.filter_value_and_grad(model.loss_fn)(opt_state, module, batch)
        return *update(module, opt_state, extra, grads), loss

    return Variant(
        EQX_LS,
        EQUINOX,
        init,
        train_step,
        update,
        _applied_from_state,
        LOSS_SCALE,
        baseline=EQX_BARE,
        overflow_inputs=_poison_batch,
    )


def mpx_dynamic(model: Model) -> Variant | str:
    """MPX (``pip install mixed-precision-for-JAX``, ``import mpx``) as its
    README trains an ``eqx.Module``: ``mpx.filter_value_and_grad`` (casts
    every argument to float16, scales the loss, differentiates, checks,
    adjusts the scale, unscales) and ``mpx.optimizer_update`` (runs the
    update, then ``select``s new or old model and optimizer state).

    ``mpx.filter_value_and_grad`` always casts to half precision, so in
    float32 the step runs the same MPX calls without the cast
    (``mpx.scaled``, ``mpx.all_finite``, ``adjust``, ``unscale``). The
    update-only step is that same sequence on precomputed gradients. Like
    jmp's, the scale's arrays ``(loss_scaling, counter)`` are the extra state
    and the ``DynamicLossScaling`` is rebuilt inside the step (minimum 1,
    factor 2, period 2000: MPX's README settings).
    """
    try:
        import equinox as eqx
        import mpx
    except ImportError:
        return f"{MPX}: skipped (not installed; pip install mixed-precision-for-JAX)"
    tx = adam()

    def scaling(arrays):
        loss_scaling, counter = arrays
        return mpx.DynamicLossScaling(
            loss_scaling=loss_scaling,
            min_loss_scaling=jnp.ones((), jnp.float32),
            factor=2,
            period=2000,
            counter=counter,
        )

    def init(module):
        return tx.init(eqx.filter(module, eqx.is_array)), (
            jnp.asarray(LOSS_SCALE, jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def after_grad(scale, grads):
        # mpx.filter_value_and_grad's steps after differentiating; it unscales
        # with the adjusted scale, as here.
        finite = mpx.all_finite(grads)
        new_scale = scale.adjust(finite)
        return new_scale, finite, new_scale.unscale(grads)

    def apply(module, opt_state, new_scale, finite, grads):
        module, opt_state = mpx.optimizer_update(module, tx, opt_state, grads, finite)
        return module, opt_state, (new_scale.loss_scaling, new_scale.counter)

    def update(module, opt_state, arrays, grads):
        return apply(module, opt_state, *after_grad(scaling(arrays), grads))

    def train_step(module, opt_state, arrays, batch):
        scale = scaling(arrays)
        if model.precision == "mixed":
            loss, new_scale, finite, grads = mpx.filter_value_and_grad(model.loss_fn, scale)(module, batch)
        else:
            scaled_loss, grads = eqx.filter_value_and_grad(mpx.scaled(model.loss_fn, scale))(module, batch)
            new_scale, finite, grads = after_grad(scale, grads)
            loss = new_scale.unscale(scaled_loss)
        return *apply(module, opt_state, new_scale, finite, grads), loss

    def applied(opt_state, arrays):
        # The counter counts clean steps modulo the period and resets on overflow.
        return arrays[1] > 0

    return Variant(
        MPX,
        EQUINOX,
        init,
        train_step,
        update,
        applied,
        LOSS_SCALE,
        baseline=EQX_BARE,
        overflow_inputs=_poison_batch,
    )


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[Model], Variant | str]] = {
    "bare": bare,
    "ls": ls_update,
    "ls-fused": ls_fused,
    "ls-static": ls_static,
    "ls-no-op": ls_no_op,
    "ls-bf16": ls_bf16,
    "ls-trainstate": ls_train_state,
    "nnx-bare": nnx_bare,
    "ls-nnx": ls_nnx,
    "apply-if-finite": apply_if_finite,
    "jmp": jmp_dynamic,
    "flax": flax_dynamic_scale,
    "eqx-bare": eqx_bare,
    "eqx-ls": eqx_ls,
    "mpx": mpx_dynamic,
}
# overflow key -> (the variant whose executables it runs, its row name)
OVERFLOWS = {
    "ls-overflow": ("ls", LS_OVERFLOW),
    "ls-fused-overflow": ("ls-fused", LS_FUSED_OVERFLOW),
    "eqx-ls-overflow": ("eqx-ls", EQX_LS_OVERFLOW),
    "mpx-overflow": ("mpx", MPX_OVERFLOW),
}
ALL = (
    "bare", "ls", "ls-overflow", "ls-fused", "ls-fused-overflow", "ls-static", "ls-no-op", "ls-bf16",
    "ls-trainstate", "nnx-bare", "ls-nnx",
    "apply-if-finite", "jmp", "flax",
    "eqx-bare", "eqx-ls", "eqx-ls-overflow", "mpx", "mpx-overflow",
)  # fmt: skip
# The flax paths (two compiles each) run when asked for by name.
DEFAULT = tuple(
    key for key in ALL if key not in ("ls-static", "ls-no-op", "ls-bf16", "ls-trainstate", "nnx-bare", "ls-nnx")
)
EQUINOX_KEYS = ("eqx-bare", "eqx-ls", "eqx-ls-overflow", "mpx", "mpx-overflow")


def resolve(keys: Sequence[str]) -> list[str]:
    """``keys`` in table order, with what they need added: ``bare`` always,
    ``eqx-bare`` for any Equinox variant, an overflow row's variant."""
    unknown = [key for key in keys if key not in ALL]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(ALL)}")
    wanted = {"bare", *keys}
    wanted |= {OVERFLOWS[key][0] for key in keys if key in OVERFLOWS}
    if wanted & set(EQUINOX_KEYS):
        wanted.add("eqx-bare")
    return [key for key in ALL if key in wanted]


def build(keys: Sequence[str], models: dict[str, Model | None]) -> tuple[list[Variant], list[str]]:
    """The variants of ``resolve(keys)`` on ``models`` (family -> model; an
    Equinox variant is left out, with a note, where there is no Equinox
    model), and notes on the ones left out."""
    variants: dict[str, Variant] = {}
    notes = []
    for key in resolve(keys):
        if key in OVERFLOWS:
            base, name = OVERFLOWS[key]
            if base in variants and variants[base].overflow_inputs is not None:
                variants[key] = dataclasses.replace(
                    variants[base], name=name, same_as=variants[base].name, overflow=True
                )
            continue
        family = EQUINOX if key in EQUINOX_KEYS else PYTREE
        model = models.get(family)
        if model is None:
            if family == EQUINOX and key == "eqx-bare":
                notes.append("Equinox variants: left out (only the MLP has an Equinox version)")
            continue
        variant = BUILDERS[key](model)
        if isinstance(variant, str):
            notes.append(variant)
        else:
            variants[key] = variant
    if "eqx-bare" not in variants:
        for key in EQUINOX_KEYS:
            variants.pop(key, None)
    return list(variants.values()), notes


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def copy(tree: PyTree) -> PyTree:
    """Fresh buffers, one per leaf: donation deletes the arrays a step is
    given, and refuses a buffer that two donated leaves share (an optimizer's
    ``init`` may put one array, say a zero counter, in several leaves)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def check_updates(
    variants: Sequence[Variant],
    update: Callable[[Variant, State, PyTree], State],
    params: dict[str, PyTree],
    feeds: dict[str, PyTree],
) -> None:
    """One update of each variant from the same params and fresh state.

    Scaled variants receive ``LOSS_SCALE * g`` and must reproduce their
    family's bare Adam to float32 rounding (the scale is a power of two, so
    unscaling is exact); overflow rows must leave the params bit for bit as
    they were and report the step as skipped.

    Args:
      variants: the variants.
      update: runs one compiled update: (variant, state, grads) -> state.
      params: family -> the initial params.
      feeds: variant name -> the gradients its update is given.
    """
    results = {}
    for v in variants:
        start = params[v.family]
        opt_state, extra = copy(v.init(start))
        new_params, new_opt_state, new_extra = update(v, (copy(start), opt_state, extra), feeds[v.name])
        results[v.name] = new_params
        applied = bool(v.applied(new_opt_state, new_extra))
        if v.overflow:
            if applied:
                raise AssertionError(f"{v.name}: the overflow step was not skipped")
            for old, new in zip(jax.tree.leaves(start), jax.tree.leaves(new_params), strict=True):
                np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=f"{v.name} moved params")
        elif not applied:
            raise AssertionError(f"{v.name}: a finite step was skipped")
    bares = {v.family: v.name for v in variants if v.name in (BARE, EQX_BARE)}
    for v in variants:
        if v.overflow or v.name in bares.values():
            continue
        reference = jax.tree.leaves(results[bares[v.family]])
        for ref, got in zip(reference, jax.tree.leaves(results[v.name]), strict=True):
            np.testing.assert_allclose(
                np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-9, err_msg=f"{v.name} differs from bare Adam"
            )


def check_applied(variants: Sequence[Variant], states: dict[str, State]) -> None:
    """After warm-up: normal variants applied their last step, overflow rows
    skipped it (else a row would time the other branch)."""
    for v in variants:
        _, opt_state, extra = states[v.name]
        applied = bool(v.applied(opt_state, extra))
        if applied == v.overflow:
            what = "applied an update" if applied else "skipped its step (the gradients overflowed)"
            raise AssertionError(f"{v.name} {what} during the full-step warm-up; its timing would be meaningless")

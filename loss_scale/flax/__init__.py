"""Loss scaling with flax: NNX gradients, fused optimizers for linen and NNX,
and reading the scaler's state.

An optional module: it imports flax, which the core package never does.

**NNX.** ``nnx.Optimizer`` takes a loss-scaled optimizer as it is; this
module's ``Optimizer`` is the same with the fused step (the update added to
the params before the skip keeps or drops it, see ``loss_scale.apply_gradients``):

```python
optimizer = Optimizer(model, ls.dynamic(optax.adamw(1e-3)), wrt=nnx.Param)

@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx_value_and_grad(loss_fn)(optimizer, model, x, y)  # grads of loss * scale
    optimizer.update(model, grads)       # unscale, check, skip or apply, adjust the scale
    return loss
```

For ``loss_scale.predictive`` with measured backward peaks,
``nnx_value_grad_and_peak`` is ``nnx_value_and_grad`` with the peak as a
third output, for ``optimizer.update(model, grads, backward_peak=peak)``.

``nnx.Optimizer`` keeps its state as ``nnx.Variable`` objects, so the core
``loss_scale.get_scale(optimizer.opt_state)`` returns a ``Variable``;
``get_scale``, ``find_state`` and ``metrics`` here return plain arrays.
On a skipped step the params and the optax state stay as they were, but
``optimizer.step`` still counts the attempt: read the applied steps from the
inner optimizer's own count, or ``step - find_state(optimizer).skipped_steps``.

**linen.** ``flax.training.train_state.TrainState(tx=ls.dynamic(...))`` works
as it is, with ``loss_scale.value_and_grad(loss_fn)(state.opt_state,
state.params, batch)`` and ``state.apply_gradients(grads=grads)``; as with
NNX, ``state.step`` counts skipped steps too. This module's ``TrainState`` is
flax's with the fused step in ``apply_gradients`` (one write and one read of
a parameter-sized buffer less, see the Performance guide); the function
``apply_gradients(state, grads)`` does the same for any ``TrainState``. The
functions here accept a ``TrainState`` as well.

For mixed precision, give flax layers ``dtype=policy.compute_dtype,
param_dtype=policy.param_dtype`` (see ``loss_scale.Policy``): the params stay
float32 and the layers compute in float16 or bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from flax.training import train_state

from loss_scale._find import find_state as _find_state
from loss_scale._find import state_argument as _state_argument
from loss_scale._fused import apply_gradients as _apply_gradients
from loss_scale._grad import scaled_objective
from loss_scale._metrics import metrics as _metrics
from loss_scale._peak import value_grad_and_peak as _value_grad_and_peak
from loss_scale._segments import segment_names as _segment_names
from loss_scale._signatures import named_after as _named_after
from loss_scale._signatures import need_arguments as _need_arguments
from loss_scale._signatures import takes_first as _takes_first
from loss_scale._state import LossScaleState
from loss_scale._types import PyTree
from loss_scale.flax._helpers import loss_of as _loss_of
from loss_scale.flax._helpers import nnx_segmented as _nnx_segmented

__all__ = [
    "Optimizer",
    "TrainState",
    "apply_gradients",
    "find_state",
    "get_scale",
    "metrics",
    "nnx_value_and_grad",
    "nnx_value_grad_and_peak",
]


def find_state(obj: Any) -> LossScaleState:
    """The ``LossScaleState`` of an ``nnx.Optimizer``, with plain arrays.

    Args:
      obj: an ``nnx.Optimizer``, its ``opt_state``, a linen ``TrainState``,
        or any optax state that holds one loss-scale state.

    Returns:
      The loss-scale state, its ``nnx.Variable`` wrappers removed (so its
      fields are ``jax.Array`` values that loggers and ``float()`` take).

    Examples:
      >>> import optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import find_state
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, ls.dynamic(optax.sgd(0.1)), wrt=nnx.Param)
      >>> find_state(optimizer).skipped_steps
      Array(0, dtype=int32)
    """
    return nnx.as_pure(_find_state(obj))


def get_scale(obj: Any) -> jax.Array:
    """The current loss scale (a float32 scalar) of an ``nnx.Optimizer``,
    its ``opt_state``, a linen ``TrainState`` or any optax state.

    Examples:
      >>> import optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import get_scale
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, ls.dynamic(optax.sgd(0.1), initial_scale=256.0), wrt=nnx.Param)
      >>> get_scale(optimizer)
      Array(256., dtype=float32)
    """
    return find_state(obj).scale


def metrics(obj: Any, prefix: str = "loss_scale/") -> dict[str, jax.Array]:
    """``loss_scale.metrics`` for an ``nnx.Optimizer`` (or anything
    ``find_state`` here accepts): a flat dict of scalar arrays for a logger.

    Examples:
      >>> import optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import metrics
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, ls.dynamic(optax.sgd(0.1)), wrt=nnx.Param)
      >>> float(metrics(optimizer)["loss_scale/scale"])
      32768.0
    """
    return _metrics(find_state(obj), prefix=prefix)


def nnx_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    wrt: Any = None,
) -> Callable[..., tuple[Any, nnx.State]]:
    """The NNX analogue of ``loss_scale.value_and_grad``.

    Differentiates ``loss_fn(model, *args, **kwargs) * scale`` with respect
    to the model's variables selected by ``wrt``, with the scale read from
    the optimizer. As in ``loss_scale.value_and_grad``, the optimizer comes
    first and ``loss_fn``'s own arguments follow.

    The scaled loss is computed in float32 (or float64), so a large scale
    cannot overflow a float16 loss; the cotangent that flows back into
    float16 layers is ``scale`` times larger, which is what keeps their small
    gradients from flushing to zero. Variable updates that ``loss_fn`` makes
    (batch statistics, RNG counters) are kept, as with ``nnx.grad``.

    Args:
      loss_fn: ``(model, *args, **kwargs) -> loss``, or ``-> (loss, aux)``
        with ``has_aux=True``; ``loss`` a scalar.
      has_aux: whether ``loss_fn`` returns auxiliary data.
      wrt: an NNX filter (``nnx.Param``, ``nnx.All(...)``...) selecting the
        variables to differentiate; by default the ``wrt`` filter
        of the ``nnx.Optimizer`` passed in, or ``nnx.Param`` when an optax
        state is passed instead.

    Returns:
      ``(optimizer, model, *args, **kwargs) -> (value, grads)``: ``optimizer``
      is an ``nnx.Optimizer`` (or any optimizer state holding a loss-scale
      state), ``value`` is ``loss_fn``'s own, unscaled output and ``grads``
      (an ``nnx.State``) are the gradients of ``loss * scale``, ready for
      ``optimizer.update(model, grads)``, which unscales them. Called
      without the optimizer (``(model, x)``), it raises an error that says
      so.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import find_state, get_scale, nnx_value_and_grad
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=1024.0)
      >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> def loss_fn(model, x, y):
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x, y):
      ...     loss, grads = nnx_value_and_grad(loss_fn)(optimizer, model, x, y)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
      >>> first = train_step(model, optimizer, x, y)
      >>> bool(train_step(model, optimizer, x, y) < first), float(get_scale(optimizer))
      (True, 1024.0)
      >>> train_step(model, optimizer, x * jnp.inf, y)   # overflow: skipped
      Array(nan, dtype=float32)
      >>> float(get_scale(optimizer)), int(find_state(optimizer).skipped_steps), int(optimizer.step[...])
      (512.0, 1, 3)
    """

    call = "loss_scale.flax.nnx_value_and_grad(loss_fn)(optimizer, model, *args, **kwargs)"

    @_named_after(loss_fn)
    def wrapped(*args, **kwargs):
        _need_arguments(args, ["optimizer", "model"], call)
        optimizer, model, *args = args
        diff_filter = wrt if wrt is not None else getattr(optimizer, "wrt", nnx.Param)
        state = _state_argument(optimizer, call, "the nnx.Optimizer (or its opt_state)")
        scale = jax.lax.stop_gradient(nnx.as_pure(state.scale))
        scaled = scaled_objective(loss_fn, has_aux, scale)
        if _segment_names(state) is not None:
            segmented = _nnx_segmented(scaled, diff_filter, model, args, kwargs, nnx.as_pure(state))
            if segmented is not None:
                return segmented
        grad_fn = nnx.grad(scaled, argnums=nnx.DiffState(0, diff_filter), has_aux=True)
        grads, out = grad_fn(model, *args, **kwargs)
        return out, grads

    return _takes_first(wrapped, ["optimizer", "model"])


def nnx_value_grad_and_peak(
    loss_fn: Callable[..., Any],
    every: int = 16,
    *,
    has_aux: bool = False,
    wrt: Any = None,
    compute_dtype: Any = "float16",
) -> Callable[..., tuple[Any, nnx.State, Any]]:
    """The NNX analogue of ``loss_scale.value_grad_and_peak``: the scaled
    gradients of an NNX model and, every ``every`` steps, the largest value
    of the backward pass, for ``loss_scale.predictive``.

    ``nnx_value_and_grad`` with a third output: on a measuring step (the
    ``good_steps`` of the loss-scale state a multiple of ``every``),
    ``backward_peak`` is the largest magnitude of any ``compute_dtype``
    cotangent of the backward pass of ``loss * scale``, measured as
    ``loss_scale.value_grad_and_peak`` measures it (see there what is and
    is not seen), and 0 on the other steps. Pass it on as
    ``optimizer.update(model, grads, backward_peak=peak)``. With
    ``ls.segment`` boundaries in the model and ``ls.predictive(...,
    segments=...)``, each segment is measured on its own, as there.

    The model is split into the variables ``wrt`` selects, which are
    differentiated, and the rest; updates that ``loss_fn`` makes to the rest
    (batch statistics, RNG counters) are written back to the model, as
    ``nnx_value_and_grad`` does.

    Args:
      loss_fn: ``(model, *args, **kwargs) -> loss``, or ``-> (loss, aux)``
        with ``has_aux=True``; ``loss`` a scalar.
      every: measure on steps whose ``good_steps`` is a multiple of it, >= 1.
      has_aux: whether ``loss_fn`` returns auxiliary data.
      wrt: an NNX filter selecting the variables to differentiate; by
        default the ``wrt`` filter of the ``nnx.Optimizer`` passed in, or
        ``nnx.Param`` when an optax state is passed instead.
      compute_dtype: the dtype whose values can overflow: only cotangents
        of this dtype count.

    Returns:
      ``(optimizer, model, *args, **kwargs) -> (value, grads,
      backward_peak)``: ``optimizer`` is an ``nnx.Optimizer`` (or any
      optimizer state holding a loss-scale state); ``value`` is
      ``loss_fn``'s own, unscaled output, ``grads`` (an ``nnx.State``) the
      gradients of ``loss * scale``, ready for ``optimizer.update(model,
      grads, backward_peak=backward_peak)``, and ``backward_peak`` a float32
      scalar, 0 on a step that does not measure (an ``ls.SegmentPeaks``
      with segments, as ``ls.value_grad_and_peak`` returns it). Called
      without the optimizer (``(model, x)``), it raises an error that says
      so.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import get_scale, nnx_value_grad_and_peak
      >>> model = nnx.Linear(4, 1, use_bias=False, dtype=jnp.float16,
      ...                    kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
      >>> def loss_fn(model, x):  # a float16 intermediate 64x larger than the gradient
      ...     return jnp.mean((model(x) / 64).astype(jnp.float32))
      >>> optimizer = nnx.Optimizer(model, ls.predictive(optax.sgd(0.1), initial_scale=1.0), wrt=nnx.Param)
      >>> loss, grads, peak = nnx_value_grad_and_peak(loss_fn)(optimizer, model, jnp.ones((8, 4)))
      >>> float(peak), float(grads["kernel"][...].max())  # the cotangent of model(x) / 64 is 1/8
      (0.125, 0.015625)
      >>> _ = optimizer.update(model, grads, backward_peak=peak)
      >>> float(get_scale(optimizer))  # moved to the measured target at once
      131072.0
    """
    # The function measured is made per call (it closes over the split
    # model): its arguments are checked here, when wrapped, as
    # ls.value_grad_and_peak checks them.
    _value_grad_and_peak(loss_fn, every, compute_dtype=compute_dtype)
    call = "loss_scale.flax.nnx_value_grad_and_peak(loss_fn)(optimizer, model, *args, **kwargs)"

    @_named_after(loss_fn)
    def wrapped(*args, **kwargs):
        _need_arguments(args, ["optimizer", "model"], call)
        optimizer, model, *args = args
        diff_filter = wrt if wrt is not None else getattr(optimizer, "wrt", nnx.Param)
        state = nnx.as_pure(_state_argument(optimizer, call, "the nnx.Optimizer (or its opt_state)"))
        graphdef, diff, rest = nnx.split(model, diff_filter, ...)

        def objective(diff, *args, **kwargs):
            # Fresh variables of this trace for the rest too (the model's own
            # may not be mutated from inside it); the rest as loss_fn left it
            # comes out with the auxiliary output.
            copy = nnx.merge(graphdef, diff, jax.tree.map(lambda x: x, rest))
            out = loss_fn(copy, *args, **kwargs)
            loss = _loss_of(out, has_aux)
            return loss, (out, nnx.state(copy, nnx.Not(diff_filter)))

        measure = _value_grad_and_peak(objective, every, has_aux=True, compute_dtype=compute_dtype)
        (_, (out, updated)), grads, peak = measure(state, diff, *args, **kwargs)
        nnx.update(model, updated)
        return out, grads, peak

    return _takes_first(wrapped, ["optimizer", "model"])


def apply_gradients(state: Any, grads: PyTree, **extra_args: Any) -> Any:
    """``state.apply_gradients(grads=grads)`` for a flax ``TrainState``, fused.

    Calls ``loss_scale.apply_gradients(state.tx, grads, state.opt_state,
    state.params)``, so that with a loss-scaling ``tx`` the update is added to
    the params before the skip keeps or drops it; then ``step + 1``, as flax does.

    Args:
      state: a ``flax.training.train_state.TrainState`` (or any struct with
        ``tx``, ``params``, ``opt_state``, ``step`` and ``replace``).
      grads: gradients of ``loss * scale``.
      **extra_args: passed on to the optimizer's update.

    Returns:
      The new state.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> from flax.training import train_state
      >>> from loss_scale.flax import apply_gradients, find_state
      >>> state = train_state.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=ls.dynamic(optax.sgd(0.5), initial_scale=4.0))
      >>> state = apply_gradients(state, {"w": jnp.array([4.0, jnp.inf])})
      >>> state.params["w"], int(state.step), bool(find_state(state).skipped)
      (Array([1., 1.], dtype=float32), 1, True)
    """
    params, opt_state = _apply_gradients(state.tx, grads, state.opt_state, state.params, **extra_args)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


class TrainState(train_state.TrainState):
    """flax's ``TrainState``, whose ``apply_gradients`` takes the fused step.

    ``state.apply_gradients(grads=grads)`` does what flax's does, but with a
    loss-scaling ``tx`` the update is added to the params before the skip
    keeps or drops it: the updates are never materialized. Build it with ``TrainState.create`` as flax's.

    From the same state, one step gives flax's ``opt_state`` and ``step``
    bit for bit (``step`` counts skipped steps too) and its params within
    one float32 rounding: XLA can add the update to a param with one
    rounding (a fused multiply-add on the CPU), where flax's rounds the
    materialized update first, so over many steps the params of the two can
    drift apart by such roundings. A skipped step leaves everything bit for
    bit as it was.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> from loss_scale.flax import TrainState
      >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
      ...                           tx=ls.dynamic(optax.sgd(0.5), initial_scale=4.0))
      >>> state = state.apply_gradients(grads={"w": jnp.array([4.0, 8.0])})
      >>> state.params["w"], int(state.step)
      (Array([0.5, 0. ], dtype=float32), 1)
    """

    def apply_gradients(self, *, grads: PyTree, **kwargs: Any) -> TrainState:
        """``step + 1``, and the params and ``opt_state`` after the fused step;
        ``kwargs`` are replaced as flax does."""
        overwrite = isinstance(grads, dict) and train_state.OVERWRITE_WITH_GRADIENT in grads
        grads_with_opt = grads["params"] if overwrite else grads
        params_with_opt = self.params["params"] if overwrite else self.params
        new_params, new_opt_state = _apply_gradients(self.tx, grads_with_opt, self.opt_state, params_with_opt)
        if overwrite:
            new_params = {
                "params": new_params,
                train_state.OVERWRITE_WITH_GRADIENT: grads[train_state.OVERWRITE_WITH_GRADIENT],
            }
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update`` takes the fused step.

    ``optimizer.update(model, grads)`` changes the model's params, the
    optimizer state and ``step`` as ``nnx.Optimizer``'s does, but with a
    loss-scaling ``tx`` the update is added to the params before the skip
    keeps or drops it, so the updates are never materialized; ``update`` returns
    ``None`` (``nnx.Optimizer``'s returns them).

    From the same state, one update gives ``nnx.Optimizer``'s optimizer
    state and ``step`` bit for bit, and its params within one float32
    rounding: XLA can add the update to a param with one rounding (a fused
    multiply-add on the CPU), where ``nnx.Optimizer`` rounds the
    materialized update first, so from the second step on a param can differ
    by a float32 ulp or so, and the two runs can drift apart by such
    roundings. A skipped step leaves everything bit for bit as it was.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> from flax import nnx
      >>> from loss_scale.flax import Optimizer, find_state, nnx_value_and_grad
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = Optimizer(model, ls.dynamic(optax.sgd(0.1), initial_scale=1024.0), wrt=nnx.Param)
      >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
      >>> _, grads = nnx_value_and_grad(loss_fn)(optimizer, model, jnp.ones((4, 2)))
      >>> optimizer.update(model, grads)
      >>> int(optimizer.step[...]), bool(find_state(optimizer).skipped)
      (1, False)
    """

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:  # type: ignore[override]
        # flax 0.12.7 (the oldest supported) has no graph mode; later versions
        # store the optimizer's choice in ``self.graph`` and need it passed on.
        graph = getattr(self, "graph", None)
        mode = {} if graph is None else {"graph": graph}
        params = nnx.as_pure(nnx.state(model, self.wrt, **mode))
        grads = nnx.as_pure(nnx.state(grads, self.wrt, **mode))
        opt_state = nnx.as_pure(self.opt_state)
        new_params, new_opt_state = _apply_gradients(self.tx, grads, opt_state, params, **nnx.as_pure(kwargs))
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, **mode))
        self.step[...] += 1

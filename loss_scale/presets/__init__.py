"""Compatibility presets: other libraries' loss-scaling rules, by their own names.

Each function takes the inner optimizer and the arguments of one peer, with
that peer's names and defaults, and returns the loss-scaling transformation
(``optax.GradientTransformationExtraArgs`` with a ``LossScaleState``) whose
scale after every step, and whose skipped steps, are the peer's for the same
sequence of clean and overflowing steps. Bring a PyTorch, DeepSpeed or
Megatron configuration and get the same scale trajectory:

=============  ================================  ==========================================
preset         peer                              growth after / backoff / bounds
=============  ================================  ==========================================
``torch``      torch 2.13 ``GradScaler``         N clean / x backoff_factor / none
``keras``      Keras 3.15 LossScaleOptimizer     N clean / x0.5 / none
``tf_keras``   tf-keras 2.21 LossScaleOptimizer  N clean / x0.5 / min 1
``deepspeed``  DeepSpeed 0.19 (ZeRO)             N+1 first, then N / x0.5, hysteresis / min
``megatron``   megatron-core 0.16                N clean / x0.5, hysteresis / min
``apex``       Apex amp ``LossScaler`` (master)  N clean / x0.5 / min, max 2**24
``flax``       flax 0.12 ``DynamicScale``        N+1 clean / x backoff_factor / min
``jmp``        jmp 0.0.4 ``DynamicLossScale``    N clean / / factor / min 1
``cerebras``   cerebras_pytorch 2.10             N+1 steps / x0.5, tolerance / min, max
=============  ================================  ==========================================

What every preset shares, and where that differs from some peers:

* A step is skipped exactly when a gradient is non-finite once divided by
  the scale; the inner optimizer's update does not run, so its state (Adam's
  moments, the step count behind learning-rate schedules) is unchanged.
  torch, Megatron, DeepSpeed, Apex and Keras 3 check the gradients *before*
  dividing them, which is the same check while the scale is at least 1; below
  1 a finite gradient can overflow in the division, which those peers then
  apply as inf.
* The scale is float32 and never becomes 0 or inf: a growth that would give
  inf keeps the scale, and a preset whose peer has no minimum stops at
  float32's smallest normal (``2**-126``). Peers without these guards can
  reach a scale of inf (then every step overflows and is skipped, forever)
  or of 0 (then torch and Keras 3 apply nan updates, forever).
  DeepSpeed and Apex keep the scale as a Python float (float64): the
  trajectories agree while the scale stays within float32's normal range.
* Factors are applied in float32 (``scale * float32(factor)``). With
  power-of-two factors (every default) this is exact. torch multiplies by
  its factors in float64 and rounds once, and jmp divides by its factor, so
  with a factor such as 0.9 (torch) or 3 (jmp) each growth or backoff may
  differ by one float32 rounding.

Every preset also takes the keyword options of ``loss_scale.dynamic``
(``cerebras`` takes its own ``max_gradient_norm`` instead of
``max_grad_norm``), and checks every setting whatever its mode (with
``enabled=False`` or a static ``loss_scale`` too), with errors that name the
peer's argument. One module per peer; the rules they build are in
``loss_scale/_rules/``.

Examples:
  The same steps under torch's rule and DeepSpeed's, each set up by its
  own argument names: DeepSpeed's ``hysteresis=2`` lets the first overflow
  pass without a backoff (the step is still skipped). The gradients given
  to ``update`` are those of the loss times the scale, as
  ``loss_scale.value_and_grad`` returns them.

  >>> import jax.numpy as jnp, optax, loss_scale as ls
  >>> def scales(tx, steps):
  ...     params = jnp.zeros(2)
  ...     state = tx.init(params)
  ...     out = []
  ...     for grads in steps:
  ...         _, state = tx.update(jnp.asarray(grads) * state.scale, state, params)
  ...         out.append((float(state.scale), bool(state.skipped)))
  ...     return out
  >>> steps = [[1.0, 1.0], [jnp.inf, 1.0], [jnp.inf, 1.0], [1.0, 1.0], [1.0, 1.0]]
  >>> scales(ls.presets.torch(optax.sgd(0.1), init_scale=2.0**16, growth_interval=2), steps)
  [(65536.0, False), (32768.0, True), (16384.0, True), (16384.0, False), (32768.0, False)]
  >>> scales(ls.presets.deepspeed(optax.sgd(0.1), initial_scale_power=16, hysteresis=2), steps)
  [(65536.0, False), (65536.0, True), (32768.0, True), (32768.0, False), (32768.0, False)]
"""

from loss_scale.presets._apex import apex
from loss_scale.presets._cerebras import cerebras
from loss_scale.presets._deepspeed import deepspeed
from loss_scale.presets._flax import flax
from loss_scale.presets._jmp import jmp
from loss_scale.presets._keras import keras, tf_keras
from loss_scale.presets._megatron import megatron
from loss_scale.presets._torch import torch

__all__ = ["apex", "cerebras", "deepspeed", "flax", "jmp", "keras", "megatron", "tf_keras", "torch"]

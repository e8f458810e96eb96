"""Keras 3 and tf-keras LossScaleOptimizer's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

import numpy as np

from tests.oracles._common import F32, _f32_mul


def keras3(overflows, initial_scale=2.0**15, dynamic_growth_steps=2000):
    """Keras 3.15, ``keras/src/optimizers/loss_scale_optimizer.py``
    (``_stateless_handle_finite_grads`` / ``_stateless_handle_non_finite_grads``).

    float32 ``dynamic_scale``, int ``step_counter``; no bound, no finite check
    on growth (the scale may become inf or 0 here, as in Keras).
    """
    dynamic_scale, step_counter, out = F32(initial_scale), 0, []
    for overflow in overflows:
        if not overflow:
            if step_counter == dynamic_growth_steps - 1:
                step_counter = 0
                dynamic_scale = _f32_mul(dynamic_scale, 2.0)
            else:
                step_counter += 1
        else:
            step_counter = 0
            dynamic_scale = _f32_mul(dynamic_scale, 0.5)
        out.append((float(dynamic_scale), bool(overflow)))
    return out


def tf_keras(overflows, dynamic=True, initial_scale=None, dynamic_growth_steps=None):
    """tf-keras 2.21, ``tf_keras/src/mixed_precision/loss_scale_optimizer.py``
    (``_DynamicLossScaleState.update``; defaults ``_DEFAULT_INITIAL_SCALE =
    2**15``, ``_DEFAULT_GROWTH_STEPS = 2000``, ``multiplier=2``).

    float32 ``current_loss_scale``, int64 ``counter``. With ``dynamic=False``
    tf-keras applies every step (``should_apply_grads = True``), inf or not.
    """
    if not dynamic:
        return [(float(F32(initial_scale)), False) for _ in overflows]
    scale = F32(2**15 if initial_scale is None else initial_scale)
    growth_steps = int(2000 if dynamic_growth_steps is None else dynamic_growth_steps)
    multiplier = 2.0
    counter, out = 0, []
    for overflow in overflows:
        is_finite = not overflow
        if is_finite:
            if counter + 1 >= growth_steps:
                new_loss_scale = _f32_mul(scale, multiplier)
                if np.isfinite(new_loss_scale):  # _assign_if_finite
                    scale = new_loss_scale
                counter = 0
            else:
                counter += 1
        else:
            scale = max(F32(scale / F32(multiplier)), F32(1))
            counter = 0
        out.append((float(scale), not is_finite))
    return out

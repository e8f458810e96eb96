"""jmp's DynamicLossScale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

import numpy as np

from tests.oracles._common import F32, _f32_mul


def jmp_dynamic_loss_scale(overflows, loss_scale=2.0**15, period=2000, factor=2, min_loss_scale=1.0):
    """jmp 0.0.4, ``jmp/_src/loss_scale.py`` ``DynamicLossScale.adjust``.
    float32 scale; the caller skips non-finite steps."""
    scale, counter, out = F32(loss_scale), 0, []
    for overflow in overflows:
        grads_finite = not overflow
        if grads_finite:
            if counter == period - 1:
                grown = _f32_mul(scale, factor)
                scale = grown if np.isfinite(grown) else scale
        else:
            scale = max(F32(min_loss_scale), F32(scale / F32(factor)))
        counter = ((counter + 1) % period) * int(grads_finite)
        out.append((float(scale), not grads_finite))
    return out

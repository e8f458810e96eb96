"""Cerebras' GradScaler's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

from tests.oracles._common import F32, _f32_mul


def cerebras(
    overflows,
    initial_loss_scale=2.0**15,
    steps_per_increase=2000,
    min_loss_scale=2.0**-14,
    max_loss_scale=2.0**15,
    overflow_tolerance=0.0,
):
    """cerebras_pytorch 2.10.0, ``cerebras/pytorch/amp/grad_scaler.py``
    ``GradScaler.__init__`` (``loss_scale="dynamic"``, float16 defaults) and
    ``update_scale``. float32 scale, int64 counters; the step is skipped
    (conditional update) when the gradients are not finite."""
    initial_loss_scale = initial_loss_scale if initial_loss_scale else 2.0**15
    steps_per_increase = steps_per_increase if steps_per_increase else 2000
    min_loss_scale = min_loss_scale if min_loss_scale else 2.0**-14
    max_loss_scale = max_loss_scale if max_loss_scale else 2.0**15
    loss_scale = F32(min(max_loss_scale, initial_loss_scale))
    steps_since_rescale = overflows_since_rescale = 0
    out = []
    for overflow in overflows:
        isfinite = int(not overflow)
        steps_since_rescale += 1
        overflows_since_rescale += 1 - isfinite
        ratio = F32(overflows_since_rescale) / F32(steps_since_rescale)
        exceeded = int(F32(overflow_tolerance) < ratio)
        loss_scale = F32(loss_scale / F32(1 + exceeded))
        overflows_since_rescale *= 1 - exceeded
        steps_since_rescale *= 1 - exceeded
        increase = int(steps_per_increase < steps_since_rescale)
        loss_scale = _f32_mul(loss_scale, 1 + increase)
        overflows_since_rescale *= 1 - increase
        steps_since_rescale *= 1 - increase
        max_ls, min_ls = F32(max_loss_scale), F32(min_loss_scale)
        loss_scale = loss_scale if loss_scale < max_ls else max_ls
        loss_scale = loss_scale if min_ls < loss_scale else min_ls
        out.append((float(loss_scale), bool(overflow)))
    return out

"""torch.amp.GradScaler's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

import numpy as np

from tests.oracles._common import F32


def torch_gradscaler(overflows, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """torch 2.13, ``torch/amp/grad_scaler.py`` ``GradScaler.update`` ->
    ``_amp_update_scale_`` (``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp``).

    The scale is a float32 tensor; the factors are doubles, so each product is
    taken in float64 and rounded once to float32. The step is skipped when
    inf/nan was found.
    """
    scale, growth_tracker, out = F32(init_scale), 0, []
    for found_inf in overflows:
        if found_inf:
            scale = F32(np.float64(scale) * backoff_factor)
            growth_tracker = 0
        else:
            successful = growth_tracker + 1
            if successful == growth_interval:
                with np.errstate(over="ignore"):
                    new_scale = F32(np.float64(scale) * growth_factor)
                if np.isfinite(new_scale):
                    scale = new_scale
                growth_tracker = 0
            else:
                growth_tracker = successful
        out.append((float(scale), bool(found_inf)))
    return out


def torch_gradscaler_float32(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """torch.amp.GradScaler.update (``_amp_update_scale_``), in float32.

    On overflow: scale *= backoff, tracker = 0. Otherwise tracker += 1 and at
    growth_interval: scale *= growth unless that is inf; tracker = 0.
    """
    scale, tracker, out = np.float32(init_scale), 0, []
    for overflow in overflows:
        if overflow:
            scale = np.float32(scale * np.float32(backoff_factor))
            tracker = 0
        else:
            tracker += 1
            if tracker == growth_interval:
                with np.errstate(over="ignore"):
                    grown = np.float32(scale * np.float32(growth_factor))
                if np.isfinite(grown):
                    scale = grown
                tracker = 0
        out.append((float(scale), bool(overflow)))
    return out

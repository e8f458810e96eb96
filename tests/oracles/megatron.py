"""Megatron-LM's DynamicGradScaler's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

import numpy as np

from tests.oracles._common import F32, _f32_mul


def megatron(overflows, initial_loss_scale=2.0**32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2):
    """megatron-core 0.16.1, ``megatron/core/optimizer/grad_scaler.py``
    ``DynamicGradScaler.update``, built by ``get_megatron_optimizer``
    (``megatron/core/optimizer/__init__.py``: growth 2.0, backoff 0.5).

    float32 tensors for the scale, the minimum and the factors; no finite
    check on growth (inf after 2**127, as in Megatron).
    """
    scale = F32(initial_loss_scale)
    min_scale, growth_factor, backoff_factor = F32(min_loss_scale), F32(2.0), F32(0.5)
    growth_tracker, hysteresis_tracker, out = 0, hysteresis, []
    for found_inf in overflows:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(_f32_mul(scale, backoff_factor), min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == loss_scale_window:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = _f32_mul(scale, growth_factor)
        out.append((float(scale), bool(found_inf)))
    return out


def megatron_general(overflows, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
    """megatron-core DynamicGradScaler.update: hysteresis refilled on growth."""
    scale, growth_tracker, hysteresis_tracker, out = np.float32(init_scale), 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(np.float32(scale * np.float32(backoff_factor)), np.float32(min_scale))
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = np.float32(scale * np.float32(growth_factor))
        out.append((float(scale), bool(overflow)))
    return out

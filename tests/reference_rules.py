"""Plain-Python transcriptions of the peers' loss-scale update rules.

Each function maps a sequence of overflow flags to the sequence of
(scale after the step, step skipped) pairs, so tests can compare loss_scale's
trajectories with the peers' rules over arbitrary sequences.
"""

from __future__ import annotations

import numpy as np


def torch_gradscaler(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
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


def megatron(overflows, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
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


def deepspeed_consecutive(overflows, init_scale, growth_factor, growth_interval, hysteresis, min_scale):
    """DeepSpeed DynamicLossScaler with consecutive_hysteresis=True, written
    with a growth counter (its own counts iterations since the last overflow):
    every clean step refills the hysteresis."""
    scale, tracker, cur_hysteresis, out = np.float32(init_scale), 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            if cur_hysteresis == 1:
                scale = max(np.float32(scale / np.float32(growth_factor)), np.float32(min_scale))
            else:
                cur_hysteresis -= 1
            tracker = 0
        else:
            cur_hysteresis = hysteresis
            tracker += 1
            if tracker == growth_interval:
                scale = np.float32(scale * np.float32(growth_factor))
                tracker = 0
        out.append((float(scale), bool(overflow)))
    return out

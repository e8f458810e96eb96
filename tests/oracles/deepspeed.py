"""DeepSpeed's DynamicLossScaler's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

import numpy as np


class DeepSpeedMinScaleError(Exception):
    """DeepSpeed's "Current loss scale already at minimum" exception; ``at``
    is the index of the step that raised, ``trajectory`` the steps before."""

    def __init__(self, at, trajectory):
        super().__init__(f"Current loss scale already at minimum (step {at})")
        self.at, self.trajectory = at, trajectory


def deepspeed(
    overflows,
    initial_scale_power=16,
    loss_scale_window=1000,
    hysteresis=2,
    consecutive_hysteresis=False,
    min_loss_scale=1,
    raise_error_at_min_scale=True,
):
    """DeepSpeed 0.19.8, ``deepspeed/runtime/fp16/loss_scaler.py``
    ``DynamicLossScaler.update_scale`` (what ZeRO stages 1-3 use), built as
    ``CreateLossScaler`` builds it from the ``fp16`` config
    (``precision_config.py``: ``init_scale = 2**initial_scale_power``,
    ``delayed_shift = hysteresis``, ``scale_factor = 2.0``).

    Python-float scale. Raises ``DeepSpeedMinScaleError`` where DeepSpeed
    raises (``raise_error_at_min_scale`` is always True in DeepSpeed).
    """
    cur_scale = 2**initial_scale_power
    cur_iter, last_overflow_iter = 0, -1
    scale_factor, scale_window, min_scale = 2.0, loss_scale_window, min_loss_scale
    delayed_shift = cur_hysteresis = hysteresis
    out = []
    for overflow in overflows:
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                if cur_scale == min_scale and raise_error_at_min_scale:
                    raise DeepSpeedMinScaleError(cur_iter, out)
                cur_scale = max(cur_scale / scale_factor, min_scale)
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive_hysteresis:
                cur_hysteresis = delayed_shift
            stable_interval = (cur_iter - last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % scale_window == 0):
                if not consecutive_hysteresis:
                    cur_hysteresis = delayed_shift
                cur_scale *= scale_factor
        cur_iter += 1  # noqa: SIM113 (as DeepSpeed counts)
        out.append((float(cur_scale), bool(overflow)))
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

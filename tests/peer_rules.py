"""Plain-Python transcriptions of the peers' loss-scale update rules.

One function per peer of ``loss_scale.presets``, written after the peer's own
source (file and version in each docstring), with the peer's names, defaults
and number types: float32 where the peer keeps a float32 tensor, Python float
(float64) where it keeps a Python float. Each maps a sequence of overflow
flags to the list of ``(scale after the step, step skipped)`` pairs. They are
checked against the real peers where those run here (tests/test_presets.py:
torch, jmp and flax live; Keras 3, DeepSpeed, Megatron-LM and Cerebras
through tests/data/peer_trajectories.json, recorded from their released
sources).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _f32_mul(a, b):
    with np.errstate(over="ignore", under="ignore"):
        return F32(F32(a) * F32(b))


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


def apex(overflows, init_scale=2.0**16, scale_window=2000, min_loss_scale=None, max_loss_scale=2.0**24):
    """NVIDIA Apex (master), ``apex/amp/scaler.py`` ``LossScaler.__init__`` and
    ``update_scale`` with ``loss_scale="dynamic"``. Python-float scale."""
    loss_scale = min(max_loss_scale, init_scale)
    unskipped, out = 0, []
    for has_overflow in overflows:
        if has_overflow:
            should_skip = True
            if min_loss_scale:  # noqa: SIM108 (as Apex writes it)
                loss_scale = max(min_loss_scale, loss_scale / 2.0)
            else:
                loss_scale = loss_scale / 2.0
            unskipped = 0
        else:
            should_skip = False
            unskipped += 1
        if unskipped == scale_window:
            loss_scale = min(max_loss_scale, loss_scale * 2.0)
            unskipped = 0
        out.append((float(loss_scale), should_skip))
    return out


def flax_dynamic_scale(
    overflows, scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, minimum_scale=FLOAT32_TINY
):
    """flax 0.12.8, ``flax/training/dynamic_scale.py``
    ``DynamicScale.value_and_grad`` (the scale update inside
    ``grad_fn_wrapper``). float32 scale; ``minimum_scale=None`` disables the
    floor. flax returns ``finite``; the caller skips non-finite steps."""
    scale, fin_steps, out = F32(scale), 0, []
    for overflow in overflows:
        finite = not overflow
        grow = fin_steps == growth_interval
        if grow and finite:  # noqa: SIM108
            fin_scale = min(_f32_mul(scale, growth_factor), F32(FLOAT32_MAX))
        else:
            fin_scale = scale
        inf_scale = _f32_mul(scale, backoff_factor)
        if minimum_scale is not None:
            inf_scale = max(inf_scale, F32(minimum_scale))
        scale = fin_scale if finite else inf_scale
        fin_steps = 0 if (grow or not finite) else fin_steps + 1
        out.append((float(scale), not finite))
    return out


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

"""flax's DynamicScale's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations

from tests.oracles._common import F32, FLOAT32_MAX, FLOAT32_TINY, _f32_mul


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

"""NVIDIA Apex amp's LossScaler's loss-scale rule, transcribed in plain Python from its own
source (file and version in each docstring): a differential oracle for
``loss_scale.presets``. Each function maps a sequence of overflow flags to
the list of ``(scale after the step, step skipped)`` pairs."""

from __future__ import annotations


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

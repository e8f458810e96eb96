"""What the presets share: a peer's settings, under the peer's names, to a
``DynamicRule``."""

from __future__ import annotations

from typing import Any

from loss_scale import _validate as validate
from loss_scale._rules.dynamic import DynamicRule

FLOAT32_MAX, FLOAT32_TINY = validate.FLOAT32_MAX, validate.FLOAT32_TINY


def dynamic_rule(
    *,
    initial: tuple[str, Any],
    minimum: tuple[str, Any],
    maximum: tuple[str, Any],
    growth_factor: tuple[str, Any] = ("growth_factor", 2.0),
    backoff_factor: tuple[str, Any] = ("backoff_factor", 0.5),
    growth_interval: int,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    growth_delay: int = 0,
) -> DynamicRule:
    """``DynamicRule`` from a peer's settings, each a ``(peer's name, value)``
    pair so that every error names the peer's argument. Counts are checked
    by the caller, which knows their names and ranges.

    Presets check every setting whatever their mode (``enabled=False``, a
    static ``loss_scale``), so that a wrong setting fails before anyone
    switches the mode."""
    initial_value, min_value, max_value = validate.scale_range(initial, minimum, maximum)
    return DynamicRule(
        initial_scale=initial_value,
        growth_factor=validate.growth_factor(*growth_factor),
        backoff_factor=validate.backoff_factor(*backoff_factor),
        growth_interval=growth_interval,
        min_scale=min_value,
        max_scale=max_value,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        growth_delay=growth_delay,
    )

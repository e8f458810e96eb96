"""A fixed loss scale: the rule of ``loss_scale.static``, ``loss_scale.no_op``
and a fixed-scale preset (``presets.apex(dynamic=False)``)."""

from __future__ import annotations

from loss_scale import _validate as validate
from loss_scale._rules.dynamic import DynamicRule


def fixed(scale: float) -> DynamicRule:
    """The rule of a fixed scale: the dynamic rule with its scale pinned
    (``min_scale = max_scale``), so that its state has ``dynamic``'s layout
    (``loss_scale.for_dtype`` switches between the two without changing the
    checkpoint's structure). It never grows (``growth_interval`` is the
    largest int32, and any growth would be capped at the scale anyway), and
    ``good_steps`` counts the clean steps in a row. ``scale`` is validated by
    the caller."""
    return DynamicRule(initial_scale=scale, min_scale=scale, max_scale=scale, growth_interval=validate.INT32_MAX)


def fixed_scale_of(rule: object) -> float | None:
    """The scale ``rule`` never moves (a ``fixed`` rule's), or ``None``: a
    constant of its state's layout, which reading the scale then reads."""
    if isinstance(rule, DynamicRule) and rule.min_scale == rule.max_scale:
        return float(rule.min_scale)
    return None

"""The validated settings the update reads: one typed, frozen record.

``loss_scale/_options.py`` declares the keyword options (their defaults,
checks and documentation) and validates what a caller passes; what comes out
is a ``Settings``, which the transformation keeps in its closure (never in
the state, so that ``jit`` and checkpoints cannot lose a setting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable


@dataclasses.dataclass(frozen=True)
class Settings:
    """The options of one loss-scaling transformation, validated.

    Each field but ``check_finite`` is the keyword option of the same name
    (see ``loss_scale/_options.py`` for what each does); ``check_finite`` is
    whether non-finite steps are skipped at all (``no_op`` does not skip by
    default: it still measures the statistics, and clips with
    ``max_grad_norm``).
    """

    max_grad_norm: float | None = None
    track_grad_norm: bool = False
    locate_overflows: bool = False
    axis_name: Hashable | None = None
    max_consecutive_skips: int | None = None
    backoff_on_nonfinite_loss: bool = False
    track_underflow: bool = False
    check_finite: bool = True

    @property
    def with_norm(self) -> bool:
        """Whether the check also measures the global norm (recorded, or
        needed by the clip)."""
        return self.track_grad_norm or self.max_grad_norm is not None

    @property
    def reads_gradients(self) -> bool:
        """Whether the update reads the gradients before the inner update:
        to skip a non-finite step, or for a statistic or the clip. An
        unchecked update that records nothing (``no_op``,
        ``for_dtype(bfloat16)`` without options) is the inner update alone,
        and its state's counters pass through untouched: no kernel, no byte
        more than the bare optimizer."""
        return self.check_finite or self.with_norm or self.track_underflow or self.locate_overflows

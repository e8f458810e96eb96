"""Dynamic loss scaling for mixed-precision training in JAX, the optax way.

Examples:
  >>> import jax.numpy as jnp, optax, loss_scale as ls
  >>> tx = ls.dynamic(optax.adam(1e-3))
  >>> opt_state = tx.init({"w": jnp.zeros(3)})
  >>> float(ls.get_scale(opt_state))
  32768.0
"""

from loss_scale import presets
from loss_scale._autocast import autocast, full_precision
from loss_scale._check import all_finite
from loss_scale._errors import Float16StateWarning, FullPrecisionParamsWarning, SkippedStepsError, check_skips
from loss_scale._factories import dynamic, no_op, predictive, static
from loss_scale._find import find_state
from loss_scale._fused import apply_gradients
from loss_scale._grad import get_scale, scale_loss, unscale, value_and_grad
from loss_scale._low_precision import LowPrecisionState, low_precision
from loss_scale._metrics import metrics, overflow_paths
from loss_scale._migrate import migrate_state, wrap_opt_state
from loss_scale._peak import value_grad_and_peak
from loss_scale._precision import Policy, for_dtype
from loss_scale._range_report import RangeReport, RangeRow, SegmentRow, range_report
from loss_scale._rules.segmented import SegmentCounters, SegmentPeaks, SegmentTable
from loss_scale._segments import SegmentError, segment
from loss_scale._serialization import register_with_flax
from loss_scale._state import LossScaleState, SkipReason, StepRecord
from loss_scale._update import LossScaleTransformation

__version__ = "0.3.0"

register_with_flax()

__all__ = [
    "Float16StateWarning",
    "FullPrecisionParamsWarning",
    "LossScaleState",
    "LossScaleTransformation",
    "LowPrecisionState",
    "Policy",
    "RangeReport",
    "RangeRow",
    "SegmentCounters",
    "SegmentError",
    "SegmentPeaks",
    "SegmentRow",
    "SegmentTable",
    "SkipReason",
    "SkippedStepsError",
    "StepRecord",
    "all_finite",
    "apply_gradients",
    "autocast",
    "check_skips",
    "dynamic",
    "find_state",
    "for_dtype",
    "full_precision",
    "get_scale",
    "low_precision",
    "metrics",
    "migrate_state",
    "no_op",
    "overflow_paths",
    "predictive",
    "presets",
    "range_report",
    "scale_loss",
    "segment",
    "static",
    "unscale",
    "value_and_grad",
    "value_grad_and_peak",
    "wrap_opt_state",
]

"""``ls.low_precision``: bfloat16/float16 parameters and optimizer state,
with Kahan-compensated, stochastic or nearest rounding of each update.

An optax transformation in the update layer: ``_rounding`` (the rounding
functions and the random bits), ``_state`` (``LowPrecisionState``, where the
moments are in the inner state), ``_transform`` (``low_precision``).
"""

from loss_scale._low_precision._state import LowPrecisionState
from loss_scale._low_precision._transform import low_precision

__all__ = ["LowPrecisionState", "low_precision"]

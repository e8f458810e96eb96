"""Type aliases shared by the modules."""

from collections.abc import Hashable
from typing import Any

PyTree = Any
AxisName = Hashable

# The segment of per-segment scaling that holds the loss: the values that no
# boundary separates from it. Not a boundary's name.
LOSS_SEGMENT = "loss"

"""Type aliases shared by the modules."""

from collections.abc import Hashable
from typing import Any

PyTree = Any
AxisName = Hashable

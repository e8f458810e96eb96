"""Type aliases shared by the modules."""

from typing import Any

PyTree = Any

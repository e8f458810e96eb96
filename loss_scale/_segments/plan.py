"""What the analysis (``analysis.py``) hands the evaluation
(``evaluate.py``): a ``Plan`` per jaxpr evaluated, a ``ScanPlan`` per
``lax.scan`` body analysed step by step, in terms of *potentials* (the
number of times the paths from a value to the loss cross each boundary)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Potential = tuple[int, ...]

# An output position of a jaxpr, in rescale keys: (OUT, j).
OUT = -1


@dataclasses.dataclass
class Plan:
    """What the evaluation of one jaxpr needs, for given output potentials.

    Attributes:
      potentials: the potential of every value on a path from the
        differentiated inputs to the loss, by variable.
      in_potentials: the potential of each input (``None``: not on such a path).
      markers: boundary equations: equation index -> boundary index.
      rescales: ``(equation index, input index)`` (or ``(OUT, j)`` for
        output ``j``) -> the exponent vector by which that use's cotangent
        is rescaled (``2**(v @ e)``).
      in_rescales: input index -> exponent vector, applied to the input on
        entry (a ``cond`` branch whose input potential differs from the
        other branches').
      recasts: ``(equation index, input index)`` -> the equation that made
        that input, a cast of a wider value: the use reads a cast of its
        own, of the wider value rescaled (a float32 parameter cast to
        float16 once and used in two segments).
      inner: equation index -> the plan of a jaxpr evaluated inside (a call,
        ``jax.checkpoint``), a list of plans (``cond`` branches) or a
        ``ScanPlan``.
      dependent: the variables that depend on the differentiated inputs.
    """

    potentials: dict[Any, Potential]
    in_potentials: list[Potential | None]
    markers: dict[int, int]
    rescales: dict[tuple[int, int], Potential]
    in_rescales: dict[int, Potential]
    inner: dict[int, Any]
    dependent: set[Any]
    recasts: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)

    @property
    def rewrites(self) -> bool:
        """Whether evaluating the jaxpr differs from binding it whole."""
        return bool(self.markers or self.rescales or self.in_rescales or self.recasts) or any(
            _rewrites(inner) for inner in self.inner.values()
        )


def _rewrites(inner: Any) -> bool:
    if isinstance(inner, list):
        return any(p.rewrites for p in inner)
    return inner.rewrites


@dataclasses.dataclass
class ScanPlan:
    """A ``lax.scan`` body's plans, one per iteration (index ``t`` is the
    iteration, in the scan's own order), and what they share.

    Attributes:
      steps: the body's plan at each iteration.
      const_rescales: const index -> int array [T, n]: the exponent vector by
        which that const's cotangent is rescaled at each iteration (to the
        potential the scan's caller sees it at).
    """

    steps: list[Plan]
    const_rescales: dict[int, np.ndarray]

    @property
    def rewrites(self) -> bool:
        return bool(self.const_rescales) or any(p.rewrites for p in self.steps)


def all_potentials(plan: Plan) -> dict[Any, Potential]:
    """The potentials of the values of a plan's jaxpr and of the calls,
    checkpoints and ``cond`` branches evaluated inside it (a ``scan`` body's
    change from step to step, and are left out)."""
    found = dict(plan.potentials)
    for inner in plan.inner.values():
        for sub in inner if isinstance(inner, list) else [inner]:
            if isinstance(sub, Plan):
                found.update(all_potentials(sub))
    return found

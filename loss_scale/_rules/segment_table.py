"""The per-segment part of a per-segment rule's state (``SegmentTable``):
each boundary's exponent and margin and each segment's last measurement,
with the boundaries' names as static metadata and as data, checked on
restore."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from loss_scale._rules.segment_names import check_restored_names
from loss_scale._types import LOSS_SEGMENT


@jax.tree_util.register_pytree_with_keys_class
class SegmentTable:
    """The per-segment part of the state: one entry per boundary, and per
    segment (the boundaries' and ``"loss"``, the loss's own), in a few
    arrays rather than a scalar per name (each state leaf is a buffer a
    step reads and writes). ``names`` is static (pytree metadata): a state
    made by an optimizer with other segments fails the update's layout
    check. A checkpointer restores the arrays into the target's structure,
    names included, so the names are also saved as data (``name_bytes``):
    a table whose saved names differ from its target's (other names, or
    another order) raises a ``ValueError`` naming both lists when it is
    rebuilt from restored arrays.

    Attributes:
      names: the boundaries' names, sorted.
      exponent: int32[n]: boundary ``names[i]`` multiplies the cotangents
        below it by ``2**exponent[i]``.
      margin: int32[n]: binades of headroom the parts that boundary
        ``names[i]`` decides keep on top of the global rule's, learned from
        overflows located in them (their batch-to-batch spread).
      peak: float32[n + 1]: each segment's largest *unscaled* cotangent
        magnitude at the last measurement (index 0 the loss's segment, then
        ``names``' order; the segment of a value is the deepest boundary its
        paths to the loss cross).
      zero_fraction: float32[n + 1]: the fraction of the segment's cotangent
        elements that were exactly 0 at the last measurement.
      below_normal_fraction: float32[n + 1]: the fraction below the compute
        dtype's smallest normal (flushed or subnormal).
      name_bytes: uint8[n, 64]: ``names`` as data, each UTF-8 and
        zero-padded (a name longer than 64 bytes is cut to 60 and ends with
        its CRC-32), checked against ``names`` on restore.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> state = ls.predictive(optax.sgd(0.1), segments=("embed", "body")).init(jnp.zeros(2))
      >>> table = state.counters.segments
      >>> table.names, table.exponents()
      (('body', 'embed'), {'body': 0, 'embed': 0})
    """

    def __init__(
        self,
        names: tuple[str, ...],
        exponent: jax.Array,
        margin: jax.Array,
        peak: jax.Array,
        zero_fraction: jax.Array,
        below_normal_fraction: jax.Array,
        name_bytes: Any,
    ):
        self.names = tuple(names)
        self.exponent, self.margin, self.peak = exponent, margin, peak
        self.zero_fraction, self.below_normal_fraction = zero_fraction, below_normal_fraction
        self.name_bytes = name_bytes

    # Packed into the state's words, a table still checks its names when a
    # checkpoint is restored (``loss_scale/_packed.py``).
    checked_on_restore = True

    _FIELDS = ("exponent", "margin", "peak", "zero_fraction", "below_normal_fraction", "name_bytes")

    def tree_flatten_with_keys(self):
        return [(jax.tree_util.GetAttrKey(f), getattr(self, f)) for f in self._FIELDS], self.names

    def tree_flatten(self):
        return [getattr(self, f) for f in self._FIELDS], self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        check_restored_names(names, children[-1])
        return cls(names, *children)

    def __repr__(self) -> str:
        return f"SegmentTable(names={self.names}, exponent={self.exponent!r})"

    @property
    def segments(self) -> tuple[str, ...]:
        """Every segment's name, in the order of the per-segment arrays:
        ``"loss"``, then ``names``."""
        return (LOSS_SEGMENT, *self.names)

    def exponents(self) -> dict[str, int]:
        """``{name: exponent}`` as Python ints (outside ``jit``), e.g. for
        ``loss_scale.range_report(..., segments=...)``."""
        return {name: int(e) for name, e in zip(self.names, jax.device_get(self.exponent), strict=True)}

    def replace(self, **changes: Any) -> SegmentTable:
        """A copy with some arrays replaced; ``exponents={name: e}`` sets
        exponents by name."""
        by_name = changes.pop("exponents", None)
        fields = {f: changes.pop(f, getattr(self, f)) for f in self._FIELDS}
        if changes:
            raise TypeError(f"SegmentTable has no field {sorted(changes)[0]!r}")
        if by_name is not None:
            unknown = set(by_name) - set(self.names)
            if unknown:
                raise ValueError(f"no boundary named {sorted(unknown)}; the boundaries are {list(self.names)}")
            fields["exponent"] = jnp.stack(
                [jnp.asarray(by_name.get(n, e), jnp.int32) for n, e in zip(self.names, fields["exponent"], strict=True)]
            )
        return SegmentTable(self.names, **fields)

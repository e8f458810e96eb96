"""The loss-scale state's own values in one int32 array (``PackedFields``).

XLA:GPU gives every output buffer of a step its own kernel unless the
values are computed in one fusion, and it does not merge independent
scalar updates. With the scale, the good steps, the rule's counters and
the step record each a buffer, their bookkeeping cost about one kernel
launch per field (14 in an Adam step compiled for an H100). Packed into one
array, the whole bookkeeping is one kernel that writes one buffer.

``Layout`` is static: the tree of fields (a ``jax.tree_util.PyTreeDef``)
and each leaf's shape and dtype, pytree metadata of ``PackedFields`` (so
``jit`` keys its cache on it and a state of another layout is a different
tree). Each leaf takes whole int32 words: 32-bit values bit for bit,
booleans and narrower integers as their value, 16-bit floats by their
bits. ``pack`` and ``unpack`` work on a leading batch of states too
(``jax.vmap(tx.init)``'s), the words on the last axis.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._rules.segment_names import on_hand

_WORD = jnp.int32


def _to_words(x: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return x.astype(_WORD)
    if dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, _WORD) if dtype != np.int32 else x
    if dtype.kind == "f":  # 16-bit floats keep their bits
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(_WORD)
    return x.astype(_WORD)


def _from_words(words: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return words != 0
    if dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(words, dtype) if dtype != np.int32 else words
    if dtype.kind == "f":
        return jax.lax.bitcast_convert_type(words.astype(jnp.uint16), dtype)
    return words.astype(dtype)


def _check_packable(dtype: np.dtype, where: str) -> None:
    if dtype == np.bool_ or (dtype.kind in "iuf" and dtype.itemsize <= 4):
        return
    raise TypeError(f"the loss-scale state's {where} is {dtype}: its fields must be 32 bits or narrower")


class Layout:
    """Where each field of the loss-scale state lies in the packed words:
    hashable and comparable, so it can be pytree metadata."""

    __slots__ = ("treedef", "specs", "offsets", "size", "checked_on_restore", "fixed_scale", "_hash")

    def __init__(
        self,
        treedef: Any,
        specs: tuple[tuple[tuple[int, ...], np.dtype], ...],
        checked_on_restore: bool = False,
        fixed_scale: float | None = None,
    ):
        self.treedef = treedef
        self.specs = specs
        # The scale that the state's transformation never moves (static,
        # no_op), which ``LossScaleState.scale`` reads as a constant.
        self.fixed_scale = fixed_scale
        # Whether a node of the tree checks the values it is rebuilt from (a
        # segment table's names, ``CHECKED_ON_RESTORE``).
        self.checked_on_restore = checked_on_restore
        sizes = [math.prod(shape) for shape, _ in specs]
        self.offsets = tuple(int(o) for o in np.cumsum([0, *sizes])[:-1])
        self.size = int(sum(sizes))
        self._hash = hash((treedef, specs, fixed_scale))

    @classmethod
    def of(cls, fields: Any, fixed_scale: float | None = None) -> Layout:
        """The layout of ``fields`` (a tree of arrays or shapes)."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(fields)
        specs = []
        for path, leaf in paths:
            dtype = np.dtype(leaf.dtype)
            _check_packable(dtype, jax.tree_util.keystr(path) or "field")
            specs.append((tuple(int(d) for d in leaf.shape), dtype))
        checks = jax.tree.leaves(fields, is_leaf=_checks_restored)
        return cls(treedef, tuple(specs), any(_checks_restored(node) for node in checks), fixed_scale)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Layout)
            and self.treedef == other.treedef
            and self.specs == other.specs
            and self.fixed_scale == other.fixed_scale
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        fixed = "" if self.fixed_scale is None else f", scale fixed at {self.fixed_scale}"
        return f"Layout({self.size} words{fixed}: {self.treedef})"

    def pack(self, fields: Any) -> jax.Array:
        """``fields`` (this layout's tree of arrays) as int32 words."""
        leaves = self.treedef.flatten_up_to(fields)
        words = []
        for leaf, (shape, dtype) in zip(leaves, self.specs, strict=True):
            leaf = jnp.asarray(leaf)
            if leaf.dtype != dtype:
                leaf = leaf.astype(dtype)
            batch = leaf.shape[: leaf.ndim - len(shape)]
            if tuple(leaf.shape[len(batch) :]) != shape:
                raise ValueError(f"a field of shape {shape} was given a value of shape {leaf.shape}")
            words.append(_to_words(leaf, dtype).reshape((*batch, -1)))
        if not words:
            return jnp.zeros((0,), _WORD)
        batch = jnp.broadcast_shapes(*(w.shape[:-1] for w in words))
        return jnp.concatenate([jnp.broadcast_to(w, (*batch, w.shape[-1])) for w in words], axis=-1)

    def unpack(self, data: Any) -> Any:
        """The tree of fields held in ``data`` (int32 words, or their
        ``jax.ShapeDtypeStruct``: then the fields' shapes)."""
        batch = tuple(data.shape[:-1])
        if isinstance(data, jax.ShapeDtypeStruct):
            leaves = [jax.ShapeDtypeStruct((*batch, *shape), dtype) for shape, dtype in self.specs]
            return self.treedef.unflatten(leaves)
        if not isinstance(data, jax.core.Tracer) and isinstance(data, jax.Array):
            return _unpack_compiled(self)(data)
        return self.treedef.unflatten(self._leaves(jnp.asarray(data), batch))

    def _leaves(self, data: Any, batch: tuple[int, ...], convert: Any = None) -> list[Any]:
        convert = convert or _from_words
        leaves = []
        for offset, (shape, dtype) in zip(self.offsets, self.specs, strict=True):
            size = math.prod(shape)
            words = data[..., offset : offset + size].reshape((*batch, *shape))
            leaves.append(convert(words, dtype))
        return leaves


# The class attribute by which a node of the state's fields asks to check
# the values it is rebuilt from when a checkpoint is restored.
CHECKED_ON_RESTORE = "checked_on_restore"


def _checks_restored(node: Any) -> bool:
    return bool(getattr(type(node), CHECKED_ON_RESTORE, False))


def _from_words_numpy(words: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``_from_words`` on the host, for checking a restored checkpoint."""
    if dtype == np.bool_:
        return words != 0
    if dtype.itemsize == 4:
        return words.view(dtype)
    if dtype.kind == "f":
        return words.astype(np.uint16).view(dtype)
    return words.astype(dtype)


@functools.lru_cache(maxsize=256)
def _unpack_compiled(layout: Layout) -> Any:
    """Unpacking outside ``jit`` as one compiled call (reading every field
    eagerly would dispatch a slice per field)."""
    return jax.jit(lambda data: layout.treedef.unflatten(layout._leaves(data, tuple(data.shape[:-1]))))


@jax.tree_util.register_pytree_with_keys_class
class PackedFields:
    """The loss-scale state's scale, good steps, rule counters and step
    record, packed into one int32 array (``data``) laid out by ``layout``.

    A pytree with one leaf, ``data``; the layout is static metadata.
    ``LossScaleState`` reads the fields from it by name (``state.scale``,
    ``state.record``) and ``LossScaleState._replace`` writes them.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> state = ls.dynamic(optax.sgd(0.1), initial_scale=8.0).init(jnp.zeros(2))
      >>> state.packed.data.dtype, float(state.scale)
      (dtype('int32'), 8.0)
    """

    __slots__ = ("data", "layout")

    def __init__(self, data: Any, layout: Layout):
        self.data = data
        self.layout = layout

    @classmethod
    def of(cls, fields: Any, fixed_scale: float | None = None) -> PackedFields:
        """``fields`` (a tree of arrays) packed in their own layout."""
        layout = Layout.of(fields, fixed_scale)
        return cls(layout.pack(fields), layout)

    def unpack(self) -> Any:
        """The tree of fields."""
        data = self.data
        if not (hasattr(data, "shape") and hasattr(data, "dtype")):
            raise TypeError(
                f"the loss-scale state's packed fields hold {type(data).__name__}, not an array: this state is a "
                "tree of other values (shardings, specs or variables); read its fields from the state itself"
            )
        return self.layout.unpack(data)

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("data"), self.data),), self.layout

    def tree_flatten(self):
        return (self.data,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: Any) -> PackedFields:
        (data,) = children
        if layout.checked_on_restore and on_hand(data):
            # A restored checkpoint: fields that check what they are rebuilt
            # from (a segment table's names) check it now.
            words = np.asarray(data)
            layout.treedef.unflatten(layout._leaves(words, words.shape[:-1], _from_words_numpy))
        return cls(data, layout)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedFields) or self.layout != other.layout:
            return False
        if hasattr(self.data, "shape") and hasattr(other.data, "shape"):
            return bool(np.array_equal(np.asarray(self.data), np.asarray(other.data)))
        return bool(self.data == other.data)

    __hash__ = None  # holds an array

    def __repr__(self) -> str:
        return f"PackedFields({self.layout.size} words)"

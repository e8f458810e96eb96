"""The boundary names of a per-segment state, saved as data
(``SegmentTable.name_bytes``), and the check that a restored table's saved
names are its target's: a checkpointer restores the arrays into the
target's structure, names included, so only the data can tell."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import jax
import numpy as np

# The bytes each boundary name is saved in (SegmentTable.name_bytes).
NAME_BYTES = 64


@functools.lru_cache(maxsize=64)
def encode_names(names: tuple[str, ...]) -> np.ndarray:
    """``names`` as uint8[len(names), NAME_BYTES]: UTF-8, zero-padded; a
    longer name keeps its first NAME_BYTES - 4 bytes and its CRC-32."""
    rows = np.zeros((len(names), NAME_BYTES), np.uint8)
    for i, name in enumerate(names):
        data = name.encode()
        if len(data) > NAME_BYTES:
            data = data[: NAME_BYTES - 4] + zlib.crc32(data).to_bytes(4, "little")
        rows[i, : len(data)] = np.frombuffer(data, np.uint8)
    rows.setflags(write=False)
    return rows


def decode_names(rows: np.ndarray) -> list[str]:
    """The names ``encode_names`` saved (a cut name ends with its CRC-32's
    bytes, shown escaped)."""
    return [bytes(row).rstrip(b"\0").decode(errors="backslashreplace") for row in np.asarray(rows)]


def on_hand(x: Any) -> bool:
    """Whether ``x`` holds values already on hand (numpy, or a ready array),
    as a checkpoint just restored does; tracers, shapes and a step's
    outputs still being computed are not, so that no step waits on them."""
    if isinstance(x, np.ndarray):
        return True
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    try:
        return not x.is_deleted() and x.is_fully_addressable and x.is_ready()
    except Exception:  # an array kind without these queries: nothing to read
        return False


def check_restored_names(names: tuple[str, ...], saved: Any) -> None:
    """Raises if ``saved`` (a table's ``name_bytes`` being rebuilt into a
    table with ``names``) holds other names. Only arrays whose values are
    already on hand are read (a checkpoint just restored): tracers, shapes,
    and a step's outputs still being computed are left alone, so that no
    step waits on this."""
    if not on_hand(saved):
        return
    expected = encode_names(tuple(names))
    if saved.dtype != np.uint8 or tuple(saved.shape[-2:]) != expected.shape:
        return
    value = np.asarray(saved)
    if np.array_equal(value, np.broadcast_to(expected, value.shape)):
        return
    rows = value.reshape(-1, *expected.shape)
    differing = next(row for row in rows if not np.array_equal(row, expected))
    raise ValueError(
        f"the per-segment state was saved for the boundaries {decode_names(differing)}, and it is being "
        f"restored into an optimizer whose boundaries are {list(names)}: each exponent belongs to its "
        "boundary by name (and position). Build the optimizer with the saved names "
        "(loss_scale.predictive(..., segments=...)), or keep only the inner optimizer's state and start the "
        "segments afresh (loss_scale.wrap_opt_state)"
    )

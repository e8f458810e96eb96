"""Number types shared by the oracles: float32 where a peer keeps a float32
tensor."""

import numpy as np

F32 = np.float32
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _f32_mul(a, b):
    with np.errstate(over="ignore", under="ignore"):
        return F32(F32(a) * F32(b))

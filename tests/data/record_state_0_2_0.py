"""Records ``state_0_2_0.npz``: optimizer states saved by loss_scale 0.2.0.

The file holds what a 0.2.0 user's checkpoint holds, written the way a
checkpointer writes a pytree: one array per leaf, keyed by its path (a
NamedTuple's field names, a tuple's indices, a dict's keys, ``/`` between
them). Beside each state it records the gradients of the next step and what
0.2.0's update made of them, so that a test can check that a migrated state
carries on exactly where the old one stopped.

It was run once, on loss_scale 0.2.0 (commit c954f17, whose state is the
flat 13-field ``LossScaleState``), with ``python tests/data/record_state_0_2_0.py``;
later versions cannot rerun it (their state has another layout), which is
the point of the fixture.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scale as ls

OUT = pathlib.Path(__file__).with_name("state_0_2_0.npz")


def params() -> dict:
    return {"b": jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32), "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}


def grads(step: int, scale: jax.Array) -> dict:
    """Deterministic scaled gradients; steps 2 and 5 overflow."""
    g = {
        "b": jnp.cos(jnp.arange(4, dtype=jnp.float32) + step),
        "w": jnp.sin(jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * (step + 1)),
    }
    g = jax.tree.map(lambda x: x * scale, g)
    if step in (2, 5):
        g["w"] = g["w"].at[1, 2].set(jnp.inf)
    return g


def keyed(tree, prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey):
                parts.append(entry.name)
            elif isinstance(entry, jax.tree_util.SequenceKey):
                parts.append(str(entry.idx))
            else:
                parts.append(str(entry.key))
        out["/".join([prefix, *parts])] = np.asarray(leaf)
    return out


def record(name: str, tx, steps: int) -> dict[str, np.ndarray]:
    p = params()
    state = tx.init(p)
    for step in range(steps):
        updates, state = tx.update(grads(step, state.scale), state, p)
        p = optax.apply_updates(p, updates)
    g = grads(steps, state.scale)
    updates, after = tx.update(g, state, p)
    return (
        keyed(state, f"{name}/state")
        | keyed(p, f"{name}/params")
        | keyed(g, f"{name}/next_grads")
        | keyed(optax.apply_updates(p, updates), f"{name}/next_params")
        | keyed(after, f"{name}/next_state")
    )


def main() -> None:
    arrays = record(
        "dynamic",
        ls.dynamic(
            optax.adam(1e-2),
            initial_scale=2.0**10,
            growth_interval=3,
            hysteresis=2,
            track_grad_norm=True,
            locate_overflows=True,
            track_underflow=True,
        ),
        steps=7,
    )
    arrays |= record("predictive", ls.predictive(optax.sgd(0.1, momentum=0.9)), steps=6)
    np.savez(OUT, **arrays)
    print(f"wrote {OUT} ({len(arrays)} arrays)")


if __name__ == "__main__":
    main()

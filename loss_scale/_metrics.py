"""Diagnostics read from the state: a flat dict for loggers, overflow paths."""

from __future__ import annotations

import jax

from loss_scale._find import find_state
from loss_scale._types import PyTree


def metrics(opt_state: PyTree, prefix: str = "loss_scale/") -> dict[str, jax.Array]:
    """A flat dict of scalars describing the scaler, for any logger.

    Args:
      opt_state: an optimizer state holding a loss-scale state (anywhere).
      prefix: put in front of every key.

    Returns:
      ``{prefix + name: scalar}`` for ``scale``, ``skipped``,
      ``skipped_steps``, ``consecutive_skips``, ``good_steps``, ``growths``,
      ``backoffs``, ``steps_at_min``, ``grad_max``; when tracked,
      ``grad_norm``, ``zero_fraction`` and ``below_normal_fraction``; and the
      rule's own counters by name (``overflows_left`` for ``dynamic``,
      ``headroom`` and ``grad_peak`` for ``predictive``...); with segments
      (``predictive(..., segments=...)``), ``segment/<name>/exponent`` for
      each boundary and ``segment/<name>/peak``, ``/zero_fraction`` and
      ``/below_normal_fraction`` (the last measurement) for each segment
      and for ``loss``, the loss's own segment. These keys are
      the stable view of the state. Works inside ``jit``; pass the result to
      clu, tensorboardX or wandb as it is.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([8.0, jnp.inf]), state)
      >>> m = ls.metrics(state)
      >>> float(m["loss_scale/scale"]), int(m["loss_scale/skipped_steps"])
      (4.0, 1)
    """
    scale, good_steps, counters, record = find_state(opt_state).fields()
    record = record._asdict()
    del record["nonfinite_leaves"]  # one flag per leaf, not a scalar: see overflow_paths
    # The order of 0.2.0's keys: the scale, the stable skip counts, good_steps, the rest.
    stable = {name: record.pop(name) for name in ("skipped", "skipped_steps", "consecutive_skips")}
    counters = counters._asdict()
    # A per-segment table becomes one key per boundary and segment.
    segments = {}
    table = counters.pop("segments", None)
    if table is not None:
        for i, name in enumerate(table.names):
            segments[f"segment/{name}/exponent"] = table.exponent[i]
        for field in ("peak", "zero_fraction", "below_normal_fraction"):
            for i, name in enumerate(table.segments):
                segments[f"segment/{name}/{field}"] = getattr(table, field)[i]
    values = {"scale": scale} | stable | {"good_steps": good_steps} | record | counters | segments
    return {prefix + name: value for name, value in values.items() if value is not None}


def overflow_paths(opt_state: PyTree, grads_like: PyTree) -> list[str]:
    """The gradient leaves that were non-finite on the last skipped step.

    Needs ``locate_overflows=True``. Call it outside ``jit`` (it reads the
    flags into Python).

    Args:
      opt_state: an optimizer state holding a loss-scale state.
      grads_like: any tree with the gradients' structure (the params).

    Returns:
      ``jax.tree_util.keystr`` paths, in leaf order; empty when no step has
      been skipped.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> params = {"dense": {"w": jnp.zeros(2), "b": jnp.zeros(1)}}
      >>> tx = ls.dynamic(optax.sgd(0.1), locate_overflows=True)
      >>> state = tx.init(params)
      >>> grads = {"dense": {"w": jnp.ones(2), "b": jnp.array([jnp.nan])}}
      >>> _, state = tx.update(grads, state, params)
      >>> ls.overflow_paths(state, params)
      ["['dense']['b']"]
    """
    state = find_state(opt_state)
    if state.record.nonfinite_leaves is None:
        raise ValueError("overflow_paths needs the transformation built with locate_overflows=True")
    flags = jax.device_get(state.record.nonfinite_leaves)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(grads_like)[0]]
    if len(paths) != flags.shape[0]:
        raise ValueError(f"grads_like has {len(paths)} leaves, the state tracks {flags.shape[0]}")
    return [jax.tree_util.keystr(path) for path, bad in zip(paths, flags, strict=True) if bad]

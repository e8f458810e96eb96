"""Evaluating a jaxpr equation by equation with a zero "probe" added to
every floating value an equation produces (``v + p``, ``p`` all zeros of
``v``'s shape and dtype): the forward pass is unchanged, and the gradient
with respect to ``p`` is exactly the cotangent that reaches ``v`` in the
backward pass, in ``v``'s dtype. ``range_report`` builds on it.

Calls of jitted functions and ``jax.checkpoint`` are evaluated inside
(their equations are probed one by one); ``custom_jvp``/``custom_vjp``
functions and control flow (``scan``, ``while_loop``, ``cond``) are bound
whole and their outputs probed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp

from loss_scale._sharding import varying_axes

# Equations whose inner jaxpr is evaluated in place (their equations get rows).
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_REMAT = {"checkpoint", "remat", "remat2"}
# Equations kept whole: their outputs get one row each.
_WHOLE = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "scan", "while", "cond")


class Site(NamedTuple):
    where: str
    primitive: str
    shape: tuple[int, ...]
    dtype: jnp.dtype
    # The shard_map axes the value varies along: its probe must vary along
    # them too, or the probe's gradient would be summed over them.
    varying: frozenset = frozenset()


def is_probed(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _describe(eqn: Any, prefix: str) -> str:
    """The name stack (``jax.named_scope``, jitted functions, flax modules)
    and the user's ``file:line (function)``."""
    name = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        line = f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})" if frame else ""
    except Exception:  # a private helper moved: the name alone
        line = ""
    return " ".join(p for p in (name, line) if p)


def _bind(eqn: Any, invals: list) -> Any:
    """``eqn``'s primitive applied to ``invals``, as ``jax.core.eval_jaxpr``
    does (before jax 0.9 ``get_bind_params`` also returned sub-functions)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = []
    if isinstance(params, tuple):
        subfuns, params = params
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **params)


class Evaluator:
    """Evaluates a jaxpr equation by equation, adding the next probe to each
    floating output; with ``probes=None`` records the sites instead."""

    def __init__(self, probes: list | None):
        self.probes = probes
        self.sites: list[Site] = []
        self.values: list[jax.Array] = []
        self.inlined: set[str] = set()
        self.whole: set[str] = set()

    def probe(self, x: Any, where: str, primitive: str) -> Any:
        if not is_probed(x):
            return x
        index = len(self.sites)
        self.sites.append(Site(where, primitive, tuple(x.shape), x.dtype, varying_axes(jax.typeof(x))))
        if self.probes is not None:
            x = x + self.probes[index]
        self.values.append(x)
        return x

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: str = "") -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in _INLINED and _INLINED[name] in eqn.params:
                inner = eqn.params[_INLINED[name]]
                label = eqn.params.get("name", name)
                self.inlined.add(f"{name}")
                scope = "/".join(p for p in (prefix, str(eqn.source_info.name_stack), f"{name}({label})") if p)
                outs = self.run(inner.jaxpr, inner.consts, invals, scope)
            elif name in _REMAT and "jaxpr" in eqn.params:
                self.inlined.add(name)
                scope = "/".join(p for p in (prefix, str(eqn.source_info.name_stack), name) if p)
                outs = self.run(eqn.params["jaxpr"], (), invals, scope)
            else:
                if name.startswith(_WHOLE):
                    self.whole.add(name)
                outs = _bind(eqn, invals)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                where = _describe(eqn, prefix)
                outs = [self.probe(x, where, name) for x in outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                if type(v).__name__ != "DropVar":  # an output nobody reads
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

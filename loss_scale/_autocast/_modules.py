"""Module objects among an autocast function's arguments: flax NNX modules
(and anything else NNX treats as a graph node, an ``nnx.Rngs`` or an
``nnx.Optimizer``) hold their state in mutable variables, which the
function may write (BatchNorm's running statistics, Dropout's RNG
counter). The rewrite traces a pure function of their state instead, as
``nnx.jit`` does, and writes the state the function left back into the
caller's objects, so an autocast call mutates them as a plain call would
(eagerly, under ``nnx.jit`` and inside ``nnx.grad``).

flax is never imported here: if the caller has not imported ``flax.nnx``,
no argument can be one of its modules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

# run(pure, state, others) -> (outputs, new state), or None when the
# function has nothing to rewrite (then it is called as it is).
Runner = Callable[[Callable[..., Any], Any, list[Any]], Any]


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def holds_modules(tree: Any) -> bool:
    """Whether ``tree`` holds an NNX graph node (a module, ``nnx.Rngs``)."""
    nnx = _nnx()
    if nnx is None:
        return False
    is_node = nnx.graph.is_graph_node
    return any(is_node(leaf) for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_node))


def module_of(fun: Callable[..., Any]) -> Any:
    """The NNX graph node ``fun`` is (a module called as a function) or is
    a bound method of (``model.loss``), or None."""
    nnx = _nnx()
    if nnx is None:
        return None
    for candidate in (fun, getattr(fun, "__self__", None)):
        if candidate is not None and nnx.graph.is_graph_node(candidate):
            return candidate
    return None


def call_module(run: Runner, fun: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    """``fun(*args, **kwargs)`` for ``fun`` a module or a module's bound
    method: the module is passed as an argument, so its state is traced
    and written back like an argument's."""
    method = None if fun is module else fun.__name__

    def called(node: Any, *a: Any, **k: Any) -> Any:
        return (node if method is None else getattr(node, method))(*a, **k)

    return call_with_modules(run, called, (module, *args), kwargs)


def call_with_modules(run: Runner, fun: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fun(*args, **kwargs)`` through ``run`` as a pure function of the
    graph nodes' state and the other leaves, the state it returns written
    back into the nodes (shared references kept: a module passed twice, or
    reachable from two arguments, is one module)."""
    nnx = _nnx()
    is_node = nnx.graph.is_graph_node
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    at = [i for i, leaf in enumerate(leaves) if is_node(leaf)]
    nodes = [leaves[i] for i in at]
    others = [leaf for i, leaf in enumerate(leaves) if i not in set(at)]
    graphdef, state = nnx.split(nodes)

    def pure(state: Any, others: list[Any]) -> tuple[Any, Any]:
        merged = nnx.merge(graphdef, state)
        full, rest, fresh = [], iter(others), iter(merged)
        for i in range(len(leaves)):
            full.append(next(fresh) if i in at else next(rest))
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        out = fun(*a, **k)
        return out, nnx.split(merged)[1]

    result = run(pure, state, others)
    if result is None:
        return fun(*args, **kwargs)
    out, new_state = result
    nnx.update(nodes, new_state)
    return out

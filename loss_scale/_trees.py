"""Where two pytrees that must match first differ, said in words.

Errors that compare a state with the layout it must have (a checkpoint
restored into a differently configured optimizer, an inner optimizer whose
update changes its state) name the first differing leaf path and what each
side has there, rather than printing two ``PyTreeDef``s.
"""

from __future__ import annotations

from typing import Any

import jax


def _leaf_type(leaf: Any) -> str:
    dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
    if dtype is not None and shape is not None:
        return f"{dtype}{list(shape)}"
    return type(leaf).__name__


def _nodes(tree: Any) -> dict[str, str]:
    """``{path: what is there}`` for every leaf and every ``None`` (an empty
    subtree, which a layout may have where another has an array)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {
        jax.tree_util.keystr(path) or "(the root)": "None" if leaf is None else _leaf_type(leaf)
        for path, leaf in leaves
    }


def first_difference(have: Any, want: Any, *, compare_types: bool = True) -> str | None:
    """``None`` when ``have`` and ``want`` have the same structure (and, with
    ``compare_types``, the same leaf dtypes and shapes); otherwise a phrase
    naming the first differing path and both sides, e.g. ``"at
    .record.grad_norm: None here, float32[] expected"``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from loss_scale._trees import first_difference
      >>> first_difference({"a": jnp.zeros(2)}, {"a": jnp.zeros(3)})
      "at ['a']: float32[2] here, float32[3] expected"
      >>> first_difference({"a": 1.0}, {"b": 1.0})
      "at ['a']: float here, nothing expected"
    """
    got, expected = _nodes(have), _nodes(want)
    for path in dict.fromkeys([*got, *expected]):
        if path not in expected:
            return f"at {path}: {got[path]} here, nothing expected"
        if path not in got:
            return f"at {path}: nothing here, {expected[path]} expected"
        if (compare_types or "None" in (got[path], expected[path])) and got[path] != expected[path]:
            return f"at {path}: {got[path]} here, {expected[path]} expected"
    if jax.tree.structure(have) != jax.tree.structure(want):
        # Same paths and leaves in different containers (a tuple for a list,
        # one NamedTuple class for another with the same fields).
        return f"the containers differ: {jax.tree.structure(have)} here, {jax.tree.structure(want)} expected"
    return None

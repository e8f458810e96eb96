"""Wrappers that take the optimizer state first: their names, signatures
and argument errors (``value_and_grad`` and its flax and Equinox versions)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax


def need_arguments(args: tuple, names: Sequence[str], call: str) -> None:
    """Raises a ``TypeError`` naming ``call`` (``"value_and_grad(fun)(opt_state,
    *args)"``) when fewer positional arguments than ``names`` were passed: a
    wrapper named after the user's function would otherwise raise Python's
    error about that function."""
    if len(args) < len(names):
        missing = ", ".join(names[len(args) :])
        raise TypeError(
            f"{call} got {len(args)} positional argument{'' if len(args) == 1 else 's'}, missing {missing}: "
            f"{names[0]} comes first, then the function's own arguments"
        )


def takes_first(wrapper: Callable, names: Sequence[str]) -> Callable:
    """Gives ``wrapper(*args, **kwargs)`` the signature ``(names..., *args,
    **kwargs)``, which ``inspect.signature`` (and so ``eqx.filter_jit`` and
    IDEs) reports."""
    first = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    rest = [
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
    wrapper.__signature__ = inspect.Signature([*first, *rest])  # type: ignore[attr-defined]
    return wrapper


def named_after(fun: Callable) -> Callable[[Callable], Callable]:
    """Gives a wrapper ``fun``'s name and docstring, but not its signature:
    the wrapper takes the optimizer state first, and ``functools.wraps``'
    ``__wrapped__`` would make ``inspect.signature`` (which ``eqx.filter_jit``
    and IDEs read) report ``fun``'s."""

    def name(wrapper: Callable) -> Callable:
        functools.update_wrapper(wrapper, fun, updated=())
        del wrapper.__wrapped__
        return wrapper

    return name


def over_leaves(
    fun: Callable[..., Any], argnums: int | Sequence[int], args: tuple, kwargs: dict
) -> tuple[Callable[[list], Any], list, Any]:
    """``fun(*args, **kwargs)`` as a function of the flat leaves of the
    arguments ``argnums`` (negative ones count from the end), the others
    held as they are: ``(of_leaves, leaves, treedef)``, for tracing a loss
    function once with respect to exactly what ``jax.grad`` differentiates."""
    positions = [argnums] if isinstance(argnums, int) else list(argnums)
    positions = [a % len(args) for a in positions]
    leaves, tree = jax.tree.flatten([args[a] for a in positions])

    def of_leaves(leaves: list) -> Any:
        call = list(args)
        for a, value in zip(positions, jax.tree.unflatten(tree, leaves), strict=True):
            call[a] = value
        return fun(*call, **kwargs)

    return of_leaves, leaves, tree

"""What a traced function's jaxpr holds, for the tests of how a step is skipped."""

from __future__ import annotations

import jax

from loss_scale._jaxpr import sub_jaxprs


def primitives(fn, *args) -> set[str]:
    """The names of the primitives in ``fn``'s jaxpr, sub-jaxprs included.

    A ``cond`` on the platform (``jax.lax.platform_dependent``, which the
    finite check uses) is not counted: only one branch is lowered, for the
    platform compiled for, and nothing branches at run time."""
    names, stack = set(), [jax.make_jaxpr(fn)(*args).jaxpr]
    while stack:
        platform = set()
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "platform_index":
                platform.update(id(v) for v in eqn.outvars)
            elif not (eqn.primitive.name == "cond" and id(eqn.invars[0]) in platform):
                names.add(eqn.primitive.name)
            stack.extend(sub_jaxprs(eqn.params))
    return names

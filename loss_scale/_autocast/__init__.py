"""Automatic mixed precision: ``autocast`` runs a function written in
float32 with its matrix products and convolutions in half precision, and
``full_precision`` keeps a region of it in float32.

=====================================  ===================================
operation                              runs in
=====================================  ===================================
``dot_general``,                       ``dtype`` (float32 operands cast
``conv_general_dilated`` (``HALF``)    where they are read); the result
                                       float32 where a softmax reads it
``exp``, ``log``, ``pow``, ``rsqrt``,  float32 (half operands cast up):
sums, products, cumulative sums,       softmax, logsumexp, cross-entropy,
``reduce_max``, the special functions  a norm's statistics
(``FLOAT32``)
arithmetic, comparisons, selections,   their inputs' dtype: half if one
reshapes, slices, elementwise max      is half, unless another is a
(``FOLLOW``)                           float32 result of the row above;
                                       float32 where a ``FLOAT32``
                                       operation reads the result and it
                                       could leave the half range (a
                                       square a variance sums, a mask
                                       argument added to logits)
anything else (random bits, sort,      as declared (inputs cast back)
scatter, callbacks, Pallas and custom
calls)
calls inside ``full_precision``        as declared, outputs float32
an operation reading a constant        float32 (a product too)
beyond the half range
=====================================  ===================================

The lists and the reasons for them are in ``loss_scale/_autocast/_lists.py``
and the guide "Automatic mixed precision".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from loss_scale._autocast._lists import FLOAT32, FOLLOW, FULL_PRECISION_SCOPE, HALF
from loss_scale._autocast._modules import call_module, call_with_modules, holds_modules, module_of
from loss_scale._autocast._rewrite import Autocast, has_products, rewrite

__all__ = ["FLOAT32", "FOLLOW", "HALF", "Autocast", "autocast", "full_precision"]

F = TypeVar("F", bound=Callable[..., Any])

_HALF_DTYPES = (np.dtype(jax.numpy.float16), np.dtype(jax.numpy.bfloat16))


def _checked_dtype(dtype: Any) -> np.dtype:
    try:
        checked = np.dtype(dtype)
    except TypeError as error:
        raise TypeError(f"autocast: dtype must be a floating dtype such as jnp.float16, got {dtype!r}") from error
    if checked not in (*_HALF_DTYPES, np.dtype(np.float32)):
        raise ValueError(
            f"autocast: dtype must be jnp.float16, jnp.bfloat16 or jnp.float32 (no rewrite), got {checked.name}"
        )
    return checked


def _is_traced(x: Any) -> bool:
    """Whether a leaf of the arguments is an array the rewrite traces
    (anything else, an activation function, a Python number or flag,
    passes through as it is, as ``equinox.filter_jit`` treats it)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _rewritten_call(fun: Callable[..., Any], args: tuple, kwargs: dict, half: np.dtype) -> tuple[Any] | None:
    """``(fun(*args, **kwargs),)`` with its operations in their lists'
    dtypes, or None when ``fun`` computes no product or convolution (it has
    nothing to run in half precision, and is then called as it is)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    traced = [_is_traced(x) for x in leaves]
    arrays = [x for x, t in zip(leaves, traced, strict=True) if t]

    def flat(*arrays_in: Any) -> Any:
        it = iter(arrays_in)
        full = [next(it) if t else x for x, t in zip(leaves, traced, strict=True)]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fun(*a, **k)

    closed, shapes = jax.make_jaxpr(flat, return_shape=True)(*arrays)
    if not has_products(closed):
        return None
    outs = rewrite(closed, arrays, half)
    return (jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs),)


def autocast(fun: F, dtype: Any = jax.numpy.float16) -> F:
    """``fun`` with its matrix products and convolutions in ``dtype``, for
    a model written in float32.

    A function transformation like ``jax.checkpoint``: the same signature
    and output pytree, usable under ``jax.jit``, ``jax.grad``, ``jax.vmap``
    and ``ls.value_and_grad``. Every ``dot_general`` and
    ``conv_general_dilated`` whose operands are float32 computes in
    ``dtype`` (the operands cast where they are read, so float32
    parameters keep float32 gradients; a product whose result a softmax
    reads, attention's logits or a classifier's, returns its float32
    accumulation, and differentiates in ``dtype``); exponentials, logarithms, powers,
    sums and products compute in float32, so softmax, cross-entropy and
    normalisation statistics stay in float32, and so does what they read
    where half precision could take it out of range (the square a variance
    sums, the errors an MSE squares, a mask added to logits); other
    operations follow their inputs (see the table in ``loss_scale._autocast``
    and the guide). A constant beyond the half range (a literal, an array
    ``fun`` closes over) keeps the operations that read it in float32;
    arguments are never looked at, so the same call gives the same program
    eagerly and under ``jit``. Jitted inner functions, ``jax.checkpoint``
    (its policy kept), ``lax.scan``, ``lax.cond``/``switch``,
    ``lax.while_loop`` bodies and ``custom_jvp``/``custom_vjp`` functions
    (their rules kept) are rewritten inside, effects (prints, callbacks)
    included. ``fun``'s outputs keep the dtypes they have without
    autocast; ``dtype=jnp.float32``, or a function without a product or
    convolution, is ``fun`` itself (its results bit for bit).

    flax NNX modules among the arguments (or ``fun`` itself, or the module
    whose method ``fun`` is) are traced through their state, as
    ``nnx.jit`` does, and what ``fun`` writes into them (BatchNorm's
    running statistics, Dropout's RNG counter) is written back.

    Args:
      fun: a function of pytrees (or an NNX module, or a module's method).
        Its floating arrays are traced; other leaves (Python numbers,
        flags, an Equinox module's activation functions) pass through
        unchanged.
      dtype: ``jnp.float16`` (default), ``jnp.bfloat16``, or
        ``jnp.float32`` (``fun`` itself).

    Returns:
      The rewritten function.

    Examples:
      >>> import jax, jax.numpy as jnp, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
      >>> f16_loss = ls.autocast(loss_fn)
      >>> (product,) = [e for e in jax.make_jaxpr(f16_loss)(w, x).eqns if e.primitive.name == "dot_general"]
      >>> [str(v.aval.dtype) for v in (*product.invars, *product.outvars)]
      ['float16', 'float16', 'float16']
      >>> f16_loss(w, x).dtype
      dtype('float32')
      >>> jax.grad(f16_loss)(w, x).dtype
      dtype('float32')
    """
    if not callable(fun):
        raise TypeError(f"autocast: fun must be callable, got {type(fun).__name__}")
    half = _checked_dtype(dtype)
    if half == np.dtype(np.float32):
        return fun

    @functools.wraps(fun)
    def rewritten(*args: Any, **kwargs: Any) -> Any:
        def run(pure: Callable[..., Any], state: Any, others: list[Any]) -> Any:
            result = _rewritten_call(pure, (state, others), {}, half)
            return None if result is None else result[0]

        module = module_of(fun)
        if module is not None:
            return call_module(run, fun, module, args, kwargs)
        if holds_modules((args, kwargs)):
            return call_with_modules(run, fun, args, kwargs)
        result = _rewritten_call(fun, args, kwargs, half)
        return fun(*args, **kwargs) if result is None else result[0]

    return rewritten  # type: ignore[return-value]


def full_precision(fn: F) -> F:
    """``fn`` with every call of it kept in float32 inside ``autocast``
    (its products and convolutions too): its inputs are cast back to the
    dtypes they have without autocast and its outputs are float32 results
    (operations that combine them with half-precision values run in
    float32). Outside ``autocast`` it is ``fn``.

    ``fn`` is what is called: a function, or a module instance (a flax
    linen module made inside ``@nn.compact``, ``ls.full_precision(nn.Dense(4))(x)``;
    an NNX or Equinox module's layer, ``ls.full_precision(self.head)(x)``), or
    a function a module takes as an argument
    (``nn.MultiHeadDotProductAttention(..., attention_fn=ls.full_precision(nn.dot_product_attention))``).
    A class is refused: wrapping it would wrap its construction, not its
    calls.

    Examples:
      >>> import jax, jax.numpy as jnp, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     logits = ls.full_precision(jnp.dot)(x, w)
      ...     return jnp.sum(logits)
      >>> jaxpr = jax.make_jaxpr(ls.autocast(loss_fn))(jnp.ones((4, 3)), jnp.ones((2, 4)))
      >>> [str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      ['float32']
    """
    if not callable(fn):
        raise TypeError(f"full_precision: fn must be callable, got {type(fn).__name__}")
    if isinstance(fn, type):
        name = fn.__name__
        raise TypeError(
            f"full_precision wraps what is called, not a class: full_precision({name}) would keep only the "
            f"construction of a {name} in float32, not its calls. Wrap the instance where it is called, "
            f"ls.full_precision({name}(...))(x) (in a flax linen @nn.compact method) or "
            f"ls.full_precision(self.layer)(x) (flax NNX, Equinox), or a function a module takes "
            "(attention_fn=ls.full_precision(nn.dot_product_attention))"
        )

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return fn(*args, **kwargs)

    return kept  # type: ignore[return-value]

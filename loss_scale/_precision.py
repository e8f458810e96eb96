"""Mixed-precision policy: which dtype params, computations and outputs use.

A ``Policy`` names three dtypes:

* ``param_dtype``: the dtype in which the parameters are stored and updated
  (the "master weights"). Keep it float32: an update smaller than half the
  spacing of float16 numbers around a weight (about ``|w| * 2**-11``) rounds
  away entirely, so float16 weights stop learning once the updates get small,
  however well the gradients are scaled.
* ``compute_dtype``: the dtype of the forward and backward pass. float16 and
  bfloat16 halve memory traffic; float16 needs loss scaling, bfloat16 (which
  has float32's exponent range) does not.
* ``output_dtype``: the dtype of the model's output, in which the loss is
  computed. float32 keeps the softmax and the reduction over the batch
  accurate.

``for_dtype`` picks the loss scaling that a compute dtype needs, so that a
training script switches precision with one flag.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale import _validate as validate
from loss_scale._autocast import autocast
from loss_scale._factories import dynamic, unscaled
from loss_scale._options import OPTIONS, accepted_keywords, unexpected_keyword
from loss_scale._types import PyTree

DTypeLike = Any

# Names accepted in policy strings. "half" is IEEE half precision (float16)
# on every platform, so that a string means the same thing everywhere.
_DTYPE_NAMES: dict[str, np.dtype] = {
    **dict.fromkeys(("float32", "f32", "fp32", "full", "single"), np.dtype(jnp.float32)),
    **dict.fromkeys(("float16", "f16", "fp16", "half"), np.dtype(jnp.float16)),
    **dict.fromkeys(("bfloat16", "bf16"), np.dtype(jnp.bfloat16)),
    **dict.fromkeys(("float64", "f64", "fp64", "double"), np.dtype(jnp.float64)),
}
_KEYS: dict[str, str] = {
    **dict.fromkeys(("params", "param", "p"), "param_dtype"),
    **dict.fromkeys(("compute", "c"), "compute_dtype"),
    **dict.fromkeys(("output", "outputs", "o"), "output_dtype"),
}
_SHORT_KEY = {"param_dtype": "params", "compute_dtype": "compute", "output_dtype": "output"}

# dtypes with float32's exponent range (or more): their gradients do not
# underflow where float32's would not, so they need no loss scaling.
_WIDE_RANGE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32), np.dtype(jnp.float64))


def _dtype_from_name(name: str, what: str, text: str | None = None) -> np.dtype:
    key = name.strip().lower()
    if key not in _DTYPE_NAMES:
        where = f" in policy string {text!r}" if text is not None else ""
        known = ", ".join(sorted(_DTYPE_NAMES))
        raise ValueError(f"unknown dtype {name.strip()!r} for {what}{where} (known: {known})")
    return _DTYPE_NAMES[key]


def _as_dtype(value: DTypeLike, what: str) -> np.dtype:
    """A floating numpy dtype from a dtype, a dtype name or a short name."""
    if isinstance(value, str):
        return _dtype_from_name(value, what)
    return validate.floating_dtype(what, value)


def _cast_floating(tree: PyTree, dtype: np.dtype) -> PyTree:
    """Casts every floating array leaf of ``tree`` to ``dtype``.

    Integer, boolean and complex leaves, and leaves that are not arrays
    (Python scalars, ``None``, strings), pass through unchanged: token ids,
    masks and step counters must keep their types.
    """

    def cast(x):
        x_dtype = getattr(x, "dtype", None)
        if x_dtype is None or not jnp.issubdtype(x_dtype, jnp.floating) or x_dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of a mixed-precision training run.

    Build it from dtypes (or dtype names), or from a string with
    ``Policy.from_string``. Dtypes are stored as ``numpy.dtype`` objects.

    Attributes:
      param_dtype: dtype of the stored parameters (master weights).
      compute_dtype: dtype of the forward and backward computation.
      output_dtype: dtype of the model's output, in which the loss is computed.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> policy = ls.Policy.from_string("p=f32,c=f16,o=f32")
      >>> print(policy)
      params=float32,compute=float16,output=float32
      >>> params = {"w": jnp.ones((2, 2)), "step": jnp.array(3)}
      >>> policy.cast_to_compute(params)["w"].dtype, policy.cast_to_compute(params)["step"].dtype
      (dtype('float16'), dtype('int32'))
      >>> tx = policy.loss_scaling(optax.adam(1e-3))   # ls.dynamic, since compute is float16
      >>> float(ls.get_scale(tx.init(params)))
      32768.0
    """

    param_dtype: DTypeLike = "float32"
    compute_dtype: DTypeLike = "float32"
    output_dtype: DTypeLike = "float32"

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_dtype(getattr(self, field), field))

    @classmethod
    def from_string(cls, text: str) -> Policy:
        """Parses ``"params=float32,compute=float16,output=float32"``.

        Keys: ``params`` (or ``param``, ``p``), ``compute`` (``c``), ``output``
        (``o``), each at most once, in any order, case-insensitive. A key that
        is left out is float32. Dtypes: ``float32`` (``f32``, ``fp32``,
        ``full``, ``single``), ``float16`` (``f16``, ``fp16``, ``half``),
        ``bfloat16`` (``bf16``), ``float64`` (``f64``, ``fp64``, ``double``).
        A bare dtype such as ``"bf16"`` sets all three, as in jmp.

        Raises:
          ValueError: naming the part of the string that is not understood.

        Examples:
          >>> import loss_scale as ls
          >>> ls.Policy.from_string("compute=bf16").compute_dtype
          dtype(bfloat16)
          >>> ls.Policy.from_string("half")
          Policy(param_dtype=dtype('float16'), compute_dtype=dtype('float16'), output_dtype=dtype('float16'))
          >>> ls.Policy.from_string("params=f32,compute=f8")
          Traceback (most recent call last):
          ...
          ValueError: unknown dtype 'f8' for compute in policy string 'params=f32,compute=f8' (known: ...)
        """
        if not isinstance(text, str):
            raise TypeError(f"a policy string must be a str, got {text!r}")
        if not text.strip():
            raise ValueError("empty policy string; expected e.g. 'params=float32,compute=float16,output=float32'")
        if "=" not in text and "," not in text:
            dtype = _dtype_from_name(text, "params, compute and output", text)
            return cls(dtype, dtype, dtype)
        fields: dict[str, np.dtype] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ValueError(f"expected 'key=dtype' but got {part.strip()!r} in policy string {text!r}")
            field = _KEYS.get(key.strip().lower())
            if field is None:
                raise ValueError(
                    f"unknown key {key.strip()!r} in policy string {text!r} "
                    "(expected params/param/p, compute/c or output/o)"
                )
            if field in fields:
                raise ValueError(f"{_SHORT_KEY[field]} is given twice in policy string {text!r}")
            fields[field] = _dtype_from_name(value, _SHORT_KEY[field], text)
        return cls(**fields)

    def __str__(self) -> str:
        return f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """``tree`` with its floating leaves cast to ``param_dtype``."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """``tree`` with its floating leaves cast to ``compute_dtype``.

        Cast the float32 params inside the loss function: the gradients then
        flow back through the cast and arrive in ``param_dtype``.
        """
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """``tree`` with its floating leaves cast to ``output_dtype``."""
        return _cast_floating(tree, self.output_dtype)

    def autocast(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` (a model or loss written in float32) with its products and
        convolutions in ``compute_dtype`` (``loss_scale.autocast``), and its
        floating outputs cast to ``output_dtype``.

        Examples:
          >>> import jax.numpy as jnp, loss_scale as ls
          >>> policy = ls.Policy.from_string("params=f32,compute=f16,output=f32")
          >>> logits = policy.autocast(lambda w, x: x @ w)(jnp.ones((4, 3)), jnp.ones((2, 4)))
          >>> logits.dtype
          dtype('float32')
        """
        rewritten = autocast(fun, self.compute_dtype)

        @functools.wraps(fun)
        def cast_outputs(*args: Any, **kwargs: Any) -> Any:
            return self.cast_to_output(rewritten(*args, **kwargs))

        return cast_outputs

    def loss_scaling(
        self, inner: optax.GradientTransformation, *, skip_nonfinite: bool = False, **dynamic_kwargs: Any
    ) -> optax.GradientTransformationExtraArgs:
        """``inner`` wrapped in the loss scaling this policy needs.

        ``loss_scale.dynamic`` when any of the three dtypes is float16 (the
        gradients pass through that dtype somewhere: the output's cotangent,
        the computation, or the cast back to the params), else
        ``loss_scale.no_op``. See ``for_dtype``.
        """
        dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
        narrowest = np.dtype(jnp.float16) if np.dtype(jnp.float16) in dtypes else self.compute_dtype
        return _for_dtype(inner, narrowest, skip_nonfinite, dynamic_kwargs, "Policy.loss_scaling")


def for_dtype(
    inner: optax.GradientTransformation, dtype: DTypeLike, *, skip_nonfinite: bool = False, **dynamic_kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """The loss scaling that training in ``dtype`` needs, around ``inner``.

    float16 gets ``loss_scale.dynamic(inner, **dynamic_kwargs)``; bfloat16,
    float32 and float64, whose exponent range is float32's or wider, get
    ``loss_scale.no_op(inner)`` with the options (scale 1, no skipping, the same
    state layout, so the training loop and checkpoints do not change with the
    flag), where ``options`` are the keyword options among
    ``dynamic_kwargs`` (``max_grad_norm``, ``track_grad_norm``...): they take
    effect in every dtype. The scale rule's settings (``initial_scale``,
    ``growth_interval``...) concern float16 only.

    ``dynamic_kwargs`` are validated whatever the dtype, so a misspelt or
    out-of-range setting fails in a float32 run too, not only once someone
    switches to float16. The options that act on skipped steps only
    (``max_consecutive_skips``, ``backoff_on_nonfinite_loss``) need
    ``skip_nonfinite=True`` for the wider dtypes, and are refused without it.

    Args:
      inner: the optimizer to wrap.
      dtype: the compute dtype, as a dtype or a name (``"f16"``, ``"bf16"``...).
      skip_nonfinite: for the wider dtypes, skip non-finite steps as
        ``loss_scale.no_op(inner, skip_nonfinite=True)`` does (float16 always
        skips them).
      **dynamic_kwargs: settings and options for ``loss_scale.dynamic``.

    Returns:
      An optax transformation whose state holds a ``LossScaleState``.

    Raises:
      ValueError: for a dtype with no loss-scaling rule (float8 formats need
        per-tensor scaling, which this is not), or an option that acts on
        skipped steps only for a wider dtype without ``skip_nonfinite``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> params = jnp.zeros(3)
      >>> for dtype in ("float16", "bfloat16", jnp.float32):
      ...     tx = ls.for_dtype(optax.sgd(0.1), dtype, initial_scale=2.0**12)
      ...     print(float(ls.get_scale(tx.init(params))))
      4096.0
      1.0
      1.0
    """
    return _for_dtype(inner, dtype, skip_nonfinite, dynamic_kwargs, "for_dtype")


def _for_dtype(
    inner: optax.GradientTransformation,
    dtype: DTypeLike,
    skip_nonfinite: bool,
    dynamic_kwargs: dict[str, Any],
    caller: str,
) -> optax.GradientTransformationExtraArgs:
    """``for_dtype``, whose errors for an unknown keyword name ``caller``
    (the function the user called) rather than ``dynamic``."""
    accepted = ("dtype", "skip_nonfinite", *(n for n in accepted_keywords("dynamic") if n != "inner"))
    for name in dynamic_kwargs:
        if name not in accepted:
            raise unexpected_keyword(caller, name, accepted)
    dtype = _as_dtype(dtype, "dtype")
    scaled = dynamic(inner, **dynamic_kwargs)
    if dtype == np.dtype(jnp.float16):
        return scaled
    if dtype in _WIDE_RANGE:
        options = {name: value for name, value in dynamic_kwargs.items() if name in OPTIONS}
        try:
            return unscaled(inner, "for_dtype", options, skip_nonfinite)
        except ValueError as error:
            raise ValueError(f"{error} (for {dtype.name}, which gets no loss scaling)") from None
    raise ValueError(
        f"no loss-scaling rule for {dtype}: expected float16 (dynamic loss scaling) or "
        "bfloat16/float32/float64 (none needed)"
    )

"""Which dtype each operation runs in under ``autocast``: three lists of
primitives and the rule for everything else.

The lists follow the two precedents, torch's autocast op lists and
TensorFlow's auto-mixed-precision graph rewrite, translated to JAX's
primitives:

* ``HALF``: the operations whose cost is in multiply-adds and which
  tensor cores and matrix units run fastest in half precision. torch and
  TensorFlow both put matrix products and convolutions here, and nothing
  else that is cheap to keep.
* ``FLOAT32``: operations whose result loses range or accuracy in half
  precision. Exponentials and logarithms overflow or lose their small
  arguments (``exp(12) > 65504``); sums and products of many terms lose
  the small terms and overflow (a sum of 65536 ones is beyond float16's
  largest number, 65504); the special functions lose accuracy near their
  poles. These are torch's float32 list (``exp``, ``log``, ``pow``, ``rsqrt``,
  ``erfinv``, ``sum``, ``prod``, ``cumsum``, ``softmax``'s and the norms'
  pieces) and TensorFlow's deny list (``Exp``, ``Log``, ``Pow``,
  ``Softmax``, ``Sum``, ``Mean``'s reduction). A softmax, log-softmax,
  logsumexp, cross-entropy and a normalisation's statistics are built from
  these, so they end up in float32 without being named.
* ``FOLLOW``: operations that compute nothing that half precision cannot
  hold more than their inputs already did (arithmetic, comparisons,
  selections, reshapes, slices, min-reductions, pooling by max): they run in their inputs'
  dtype. This is TensorFlow's "infer" and "clear" lists: half precision
  propagates through them, so that a bias added to a product, an
  activation and a residual stay in half precision as a hand-cast model's
  do, and the activations kept for the backward pass take half the memory.

Everything else (random bits, sorting, scatter, callbacks, opaque kernels:
Pallas calls and custom calls, whose signatures are fixed) runs as
declared: its inputs are cast back to the dtypes they have without
autocast.

Among ``FOLLOW`` operations, mixing half and float32 inputs is decided by
where the float32 input comes from: a value computed in float32 by the
``FLOAT32`` list (a softmax's normaliser, a normalisation's mean; the
label ``FLOAT32_RESULT``) keeps the operation in float32, JAX's own
promotion; any other float32 value (a parameter, an input, a constant) is
cast to half precision where it is used, as TensorFlow's rewrite casts a
variable read by a half-precision operation.

Two exceptions keep values inside the range they need. A product whose
result a softmax reads (``SOFTMAX``: attention's logits, a classifier's
before its cross-entropy) returns its float32 accumulation from
half-precision operands, as ``jax.nn.dot_product_attention`` computes its
logits (its derivative's products stay in half precision). What a
``FLOAT32`` operation reads (``_feeds``) is computed in float32 where
half precision could take it out of range: a ``GROWING`` operation (the
square a variance sums, an MSE's squared errors) and, what a softmax
reads, one that reads a float32 value with a half one (a mask added to
logits), back to the last product and not past a ``BOUNDED`` function. This is what flax's half-precision norms do by
casting their input up before their statistics, and torch's autocast by
running ``pow``, the norms and ``mse_loss`` in float32; a trace of a
float32 model holds no such cast (it is a no-op there), so the rewrite
reads it off the program. And a constant beyond the half range
(``BEYOND_HALF``: float32's minimum or ``-1e9`` as a mask's fill, a
closed-over array of ``1e5``) keeps every operation that reads it, or
what was computed from it, in float32, products included.
"""

from __future__ import annotations

HALF = frozenset({"dot_general", "conv_general_dilated"})

FLOAT32 = frozenset(
    {
        # exponentials, logarithms and powers
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "pow",
        "rsqrt",
        # inverse and hyperbolic functions that overflow or lose accuracy
        "acos",
        "asin",
        "acosh",
        "asinh",
        "atanh",
        "cosh",
        "sinh",
        "tan",
        # special functions
        "erf_inv",
        "lgamma",
        "digamma",
        "igamma",
        "igammac",
        "polygamma",
        "bessel_i0e",
        "bessel_i1e",
        # the shift that begins a softmax, log-softmax and logsumexp: with it
        # in float32 they run in float32 from their input on, as torch's
        # softmax does (and the input is kept once, in float32, for the
        # backward pass, not in both dtypes)
        "reduce_max",
        # sums and products of many terms
        "reduce_sum",
        "reduce_window_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
    }
)

FOLLOW = frozenset(
    {
        # arithmetic
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "neg",
        "abs",
        "sign",
        "max",
        "min",
        "square",
        "sqrt",
        "integer_pow",
        "rem",
        "floor",
        "ceil",
        "round",
        "clamp",
        # bounded elementwise functions
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sin",
        "cos",
        "atan",
        "atan2",
        # comparisons and selections
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "is_finite",
        "select_n",
        # moving values without computing
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "rev",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "concatenate",
        "split",
        "pad",
        "copy",
        "copy_p",
        "stop_gradient",
        "optimization_barrier",
        # reductions that pick one of their inputs
        "reduce_min",
        "reduce_window_max",
        "reduce_window_min",
        "cummax",
        "cummin",
        "argmax",
        "argmin",
        "reduce_and",
        "reduce_or",
    }
)

# ``FOLLOW`` operations whose result stays within a fixed range whatever
# their input (``|tanh(x)| <= 1``): what they read cannot take a statistic
# of their result out of the half range, so the float32 that a statistic
# asks for (``_feeds``) does not reach past them.
BOUNDED = frozenset({"tanh", "logistic", "erf", "erfc", "sin", "cos", "atan", "atan2", "sign", "is_finite"})

# ``FOLLOW`` operations whose result can be larger than their inputs: a
# product or a quotient (a square, a variance's terms, an MSE's squared
# errors, an inverse).
GROWING = frozenset({"mul", "div", "square", "integer_pow"})

# The ``FLOAT32`` operations that begin a softmax, a log-softmax or a
# logsumexp (the largest element, which they subtract): what they read are
# logits, which a mask pushes far beyond the half range (``-1e9``,
# float32's minimum) and which a softmax takes at any size.
SOFTMAX = frozenset({"reduce_max", "cumlogsumexp"})

# The label of a float32 value computed in float32 by the ``FLOAT32`` list
# (or inside ``full_precision``): a ``FOLLOW`` operation that reads one
# runs in float32.
FLOAT32_RESULT = "float32 result"

# The label of a constant beyond the half dtype's range (float32's minimum
# or -1e9 as a mask's fill, a closed-over array of 1e5) and of what moves or
# combines it: an operation that reads one runs in float32 (a product
# included) rather than turn it into an infinity.
BEYOND_HALF = "beyond the half range"

# ``jax.named_scope`` that ``full_precision`` puts its calls in.
FULL_PRECISION_SCOPE = "loss_scale.full_precision"

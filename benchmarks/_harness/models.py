"""The model zoo: an MLP classifier and a causal transformer LM in plain
``jax.numpy``, and the same MLP as an Equinox module.

Every model keeps float32 params and comes in two precisions: ``"f32"``, and
``"mixed"`` (params cast to float16 inside the loss, float16 forward and
backward, float32 loss), so gradients always arrive in float32.
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

PRECISIONS = ("f32", "mixed")
SIZES = ("quick", "default", "gpu", "large")
MODELS = ("mlp", "transformer", "tiny", "tree")


class Model(NamedTuple):
    """A model ready to benchmark: float32 params, a batch and its loss.

    ``params`` is a pytree of arrays, or an ``eqx.Module`` for the Equinox
    models; ``loss_fn(params, batch)`` returns a float32 scalar.
    """

    name: str
    precision: str
    description: str
    params: PyTree
    batch: PyTree
    loss_fn: Callable[[PyTree, PyTree], jax.Array]


def compute_dtype(precision: str) -> jnp.dtype:
    return {"f32": jnp.float32, "mixed": jnp.float16}[precision]


def cast(tree: PyTree, dtype: Any) -> PyTree:
    """Casts the floating array leaves of ``tree`` (an ``eqx.Module`` too)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def row(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` of shape ``[d]`` reshaped to broadcast against a rank-``ndim``
    array explicitly (the test suite runs with rank promotion disabled)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


# Set by ``build_abstract``: ``normal`` returns shapes instead of numbers.
_ABSTRACT = contextvars.ContextVar("abstract", default=False)


def normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> jax.Array | jax.ShapeDtypeStruct:
    """Random float32 params drawn with NumPy: ``jax.random`` would compile
    one XLA executable per shape, which dominates a smoke run's wall time.
    Inside ``build_abstract``, the shape alone."""
    if _ABSTRACT.get():
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    return jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(std))


def n_params(params: PyTree) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def fmt_count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


def _mlp_arrays(sizes: Sequence[int], batch_size: int, seed: int) -> tuple[list[tuple[jax.Array, jax.Array]], dict]:
    """The MLP's ``(w, b)`` per layer and its batch; the plain and the
    Equinox MLP draw the same numbers."""
    rng = np.random.default_rng(seed)
    layers = [
        (normal(rng, (n_in, n_out), math.sqrt(2.0 / n_in)), jnp.zeros((n_out,), jnp.float32))
        for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    batch = {
        "x": normal(rng, (batch_size, sizes[0]), 1.0),
        "y": jnp.asarray(rng.integers(0, sizes[-1], (batch_size,)), jnp.int32),
    }
    return layers, batch


def _mlp_forward(layers: Sequence[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    for i, (w, b) in enumerate(layers):
        x = x @ w + row(b, x.ndim)
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def _mlp_description(sizes: Sequence[int], batch_size: int, params: PyTree, prefix: str = "MLP") -> str:
    widths = "→".join(str(s) for s in sizes)
    return f"{prefix} {widths}, batch {batch_size}, {fmt_count(n_params(params))} params"


def make_mlp(precision: str, sizes: Sequence[int], batch_size: int, seed: int = 0) -> Model:
    """A ReLU MLP classifier with softmax cross-entropy.

    Args:
      precision: "f32" or "mixed" (float16 compute, float32 loss).
      sizes: layer widths, input first, number of classes last.
      batch_size: examples per batch.
      seed: seed of the params and the data.
    """
    layers, batch = _mlp_arrays(sizes, batch_size, seed)
    params = [{"w": w, "b": b} for w, b in layers]
    dtype = compute_dtype(precision)

    def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
        params = cast(params, dtype)
        logits = _mlp_forward([(layer["w"], layer["b"]) for layer in params], batch["x"].astype(dtype))
        return _cross_entropy(logits, batch["y"])

    return Model("mlp", precision, _mlp_description(sizes, batch_size, params), params, batch, loss_fn)


@functools.cache
def _eqx_mlp_class() -> type:
    """The Equinox MLP class, defined on first use (equinox is optional)."""
    import equinox as eqx

    class MLP(eqx.Module):
        """A ReLU MLP on a batch: ``weights[i]`` is ``[in, out]``."""

        weights: tuple[jax.Array, ...]
        biases: tuple[jax.Array, ...]

        def __call__(self, x: jax.Array) -> jax.Array:
            return _mlp_forward(list(zip(self.weights, self.biases, strict=True)), x)

    return MLP


def make_eqx_mlp(precision: str, sizes: Sequence[int], batch_size: int, seed: int = 0) -> Model:
    """``make_mlp``'s model and batch as an ``eqx.Module`` (the same numbers).

    The loss casts the module's floating arrays to the compute dtype, as
    ``ls.Policy.cast_to_compute`` does; a module that arrives already cast
    (MPX casts every argument before differentiating) passes unchanged.
    """
    layers, batch = _mlp_arrays(sizes, batch_size, seed)
    model = _eqx_mlp_class()(tuple(w for w, _ in layers), tuple(b for _, b in layers))
    dtype = compute_dtype(precision)

    def loss_fn(model: Any, batch: PyTree) -> jax.Array:
        return _cross_entropy(cast(model, dtype)(batch["x"].astype(dtype)), batch["y"])

    return Model("mlp", precision, _mlp_description(sizes, batch_size, model, "Equinox MLP"), model, batch, loss_fn)


# ---------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Layer norm with float32 statistics (float16 variance is unsafe)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * row(scale, y.ndim) + row(bias, y.ndim)).astype(x.dtype)


def make_transformer(
    precision: str,
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
) -> Model:
    """A pre-LN causal transformer LM (learned positions, GELU MLP, untied
    head) with next-token cross-entropy, in plain ``jax.numpy``.

    Matmuls run in the compute dtype; layer-norm statistics, the attention
    softmax and the loss run in float32, as mixed-precision recipes do.
    """
    d_ff = 4 * d_model
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> jax.Array:
        return normal(rng, (n_in, n_out), 0.02)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d_model,), jnp.float32), "bias": jnp.zeros((d_model,), jnp.float32)}

    params = {
        "embed": dense(vocab, d_model),
        "pos": dense(seq_len, d_model),
        "layers": [
            {
                "ln1": norm(),
                "qkv": dense(d_model, 3 * d_model),
                "out": dense(d_model, d_model),
                "ln2": norm(),
                "w1": dense(d_model, d_ff),
                "b1": jnp.zeros((d_ff,), jnp.float32),
                "w2": dense(d_ff, d_model),
                "b2": jnp.zeros((d_model,), jnp.float32),
            }
            for _ in range(n_layers)
        ],
        "ln_f": norm(),
        "head": dense(d_model, vocab),
    }
    tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len + 1)), jnp.int32)
    dtype = compute_dtype(precision)
    head_dim = d_model // n_heads
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))[None, None]

    def attention(x: jax.Array, layer: PyTree) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, n_heads, head_dim) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d_model) @ layer["out"]

    def loss_fn(params: PyTree, tokens: jax.Array) -> jax.Array:
        params = cast(params, dtype)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"][inputs] + params["pos"][None]
        for layer in params["layers"]:
            x = x + attention(_layer_norm(x, **layer["ln1"]), layer)
            h = jax.nn.gelu(_layer_norm(x, **layer["ln2"]) @ layer["w1"] + row(layer["b1"], x.ndim))
            x = x + h @ layer["w2"] + row(layer["b2"], x.ndim)
        logits = (_layer_norm(x, **params["ln_f"]) @ params["head"]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    description = (
        f"transformer LM d={d_model} L={n_layers} H={n_heads} vocab={vocab} seq={seq_len}, "
        f"batch {batch_size}, {fmt_count(n_params(params))} params"
    )
    return Model("transformer", precision, description, params, tokens, loss_fn)


# ---------------------------------------------------------------------------
# The configurations the benchmarks run
# ---------------------------------------------------------------------------

# size -> MLP widths and batch. "quick" is a smoke test that compiles and runs
# in seconds; "large" keeps a GPU busy for milliseconds per step (~240M
# parameters), so that kernel launches do not dominate the timings.
MLP_CONFIGS = {
    "quick": ((64, 128, 10), 8),
    "default": ((1024, 2048, 2048, 2048, 2048, 2048, 1000), 64),
    "gpu": ((4096, 8192, 8192, 8192, 8192, 1000), 1024),
    "large": ((4096, 8192, 8192, 8192, 8192, 1000), 1024),
}
# The tiny MLP (316 params, the size of optax's getting-started example):
# one size, where the per-step cost is the kernels and buffers of the
# update's bookkeeping, not arithmetic. Its steps are timed
# ``TINY_STEPS_PER_SAMPLE`` at a time.
TINY_CONFIG = ((8, 16, 8, 4), 32)
TINY_STEPS_PER_SAMPLE = 200
TRANSFORMER_CONFIGS = {
    "quick": {"vocab": 128, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2},
    "default": {"vocab": 8192, "d_model": 256, "n_layers": 8, "n_heads": 4, "seq_len": 64, "batch_size": 4},
    # "gpu": the "large" one with 2 layers, whose variants compile within a
    # short GPU window (the 12-layer one's six did not in 120 s on an H200).
    "gpu": {"vocab": 32768, "d_model": 1024, "n_layers": 2, "n_heads": 16, "seq_len": 512, "batch_size": 16},
    "large": {"vocab": 32768, "d_model": 1024, "n_layers": 12, "n_heads": 16, "seq_len": 512, "batch_size": 16},
}


# The tree of many leaves: its leaf count per size.
TREE_LEAVES = {"quick": 4, "default": 40, "gpu": 160, "large": 160}


def make_tree(precision: str, n_leaves: int, width: int = 256, seed: int = 0) -> Model:
    """``n_leaves`` parameter leaves, ``[width, width]`` matrices and
    ``[width]`` vectors alternating, each a layer of a residual stack: the
    shape of a model of many small leaves, where a scaler's cost per leaf
    (its check, its bookkeeping) shows."""
    rng = np.random.default_rng(seed)
    params = {
        f"{i:03d}": normal(rng, (width, width), 1.0 / math.sqrt(width)) if i % 2 == 0 else jnp.zeros((width,))
        for i in range(n_leaves)
    }
    batch = {"x": normal(rng, (8, width), 1.0)}
    dtype = compute_dtype(precision)

    def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
        x = batch["x"].astype(dtype)
        leaves = [params[k].astype(dtype) for k in sorted(params)]
        for i in range(0, len(leaves), 2):
            h = x @ leaves[i]
            if i + 1 < len(leaves):
                h = h + row(leaves[i + 1], 2)
            x = x + jnp.tanh(h)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    description = f"{n_leaves} leaves ({width}x{width} and {width}, alternating), batch 8"
    return Model("tree", precision, description, params, batch, loss_fn)


def build(name: str, precision: str, size: str = "default") -> Model:
    """The benchmark's model ``name`` ("mlp", "transformer", "tiny" or
    "tree") at ``size`` ("quick", "default", "gpu" or "large"; the tiny MLP
    has one size; the tree's size is its leaf count, ``TREE_LEAVES``)."""
    if name == "tree":
        return make_tree(precision, TREE_LEAVES[size])
    if name == "mlp":
        sizes, batch_size = MLP_CONFIGS[size]
        return make_mlp(precision, sizes, batch_size)
    if name == "tiny":
        sizes, batch_size = TINY_CONFIG
        return make_mlp(precision, sizes, batch_size)._replace(name="tiny")
    if name == "transformer":
        return make_transformer(precision, **TRANSFORMER_CONFIGS[size])
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def build_abstract(name: str, precision: str, size: str = "default") -> Model:
    """``build(name, precision, size)`` with params and batch as
    ``jax.ShapeDtypeStruct``s: nothing param-sized is drawn or allocated, so
    a program can be compiled for a device (``gpu.compile_for``) from a
    model that would not fit this machine's memory."""
    return _abstract(build, name, precision, size)


def _abstract(builder: Callable[..., Model | None], *args: Any) -> Model | None:
    """``builder(*args)`` with params and batch as shapes (see ``build_abstract``)."""
    token = _ABSTRACT.set(True)
    try:
        model = builder(*args)
    finally:
        _ABSTRACT.reset(token)
    if model is None:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (model.params, model.batch))
    return model._replace(params=shapes[0], batch=shapes[1])


def build_equinox(name: str, precision: str, size: str = "default") -> Model | None:
    """The Equinox version of model ``name``, or ``None`` where there is none
    (only the MLP has one)."""
    if name != "mlp":
        return None
    sizes, batch_size = MLP_CONFIGS[size]
    return make_eqx_mlp(precision, sizes, batch_size)


def build_equinox_abstract(name: str, precision: str, size: str = "default") -> Model | None:
    """``build_equinox`` from shapes alone, as ``build_abstract`` builds."""
    return _abstract(build_equinox, name, precision, size)

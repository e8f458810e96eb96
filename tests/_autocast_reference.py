"""The models of tests/test_autocast_matrix.py, each written in float32 and
paired with its reference: the same model in its framework's own
half-precision mode (flax linen and NNX modules constructed with
``dtype=half, param_dtype=float32`` and the float32 model's parameters), or,
for Equinox and plain JAX, the same computation cast by hand the way flax's
modules cast it: products read half-precision operands, the statistics of norms,
softmax, log-softmax and losses read their inputs cast up to float32, and a
norm returns its output in the half dtype.

A functional cell is ``fn(params, state, inputs) -> (out, new_state)`` with
``ref`` of the same signature; an NNX cell builds a module for a dtype (None
for float32) and is called on it. ``args(magnitude)`` gives the arguments for
one input magnitude, with the same shapes at every magnitude (one compile per
function). Before every norm stands a product initialised near the identity,
so the norm reads half-precision values of the input's magnitude.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

F32 = jnp.float32
BATCH, FEATURES, HIDDEN, VOCAB, SEQ, HEADS = 4, 8, 16, 16, 4, 2
NORMS = ("layernorm", "rmsnorm", "batchnorm_train", "batchnorm_eval", "groupnorm")


def near_identity(rng: np.random.Generator, n: int) -> np.ndarray:
    """A square kernel ``I + small noise``: the product passes the input's
    magnitude on to the norm after it."""
    return (np.eye(n) + 0.05 * rng.standard_normal((n, n))).astype(np.float32)


def numpy_init(abstract: Any, seed: int, identity: bool = False) -> Any:
    """Concrete values for the abstract leaves (``jax.ShapeDtypeStruct``) of
    parameters and state from ``eval_shape``, drawn with NumPy: JAX's random
    initialisers compile a program per shape, seconds each on a busy CI
    CPU. Kernels ~ N(0, 1/fan_in) (``identity``: a square kernel near the
    identity), biases and scales near 0 and 1, running statistics 0 and 1."""
    rng = np.random.default_rng(seed)

    def draw(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        name, shape = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))), leaf.shape
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.key(int(rng.integers(1 << 30)))
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or name == "mean":
            return jnp.zeros(shape, leaf.dtype)
        if name == "var":
            return jnp.ones(shape, leaf.dtype)
        if name == "bias":
            return jnp.asarray(0.1 * rng.standard_normal(shape), leaf.dtype)
        if len(shape) < 2:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(shape), leaf.dtype)
        if identity and len(shape) == 2 and shape[0] == shape[1]:
            return jnp.asarray(near_identity(rng, shape[0]), leaf.dtype)
        fan_in = np.prod(shape[1:] if name == "weight" else shape[:-1])
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def unit(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform in [-1, 1] with its largest magnitude exactly 1."""
    u = np.random.default_rng(seed).uniform(-1.0, 1.0, shape)
    return (u / np.abs(u).max()).astype(np.float32)


def half_cast(tree: Any, dtype: Any) -> Any:
    """Floating arrays of ``tree`` cast to ``dtype`` (ints, bools, keys and
    non-arrays as they are): an operand a product reads in half precision."""

    def cast(a: Any) -> Any:
        if isinstance(a, jax.Array | np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating):
            return a.astype(dtype)
        return a

    return jax.tree.map(cast, tree)


def masks() -> tuple[np.ndarray, np.ndarray]:
    """A causal boolean mask ``(BATCH, 1, SEQ, SEQ)`` whose sample 1 has a
    fully masked first query row, and the same mask as an additive bias of
    -1e9 (beyond float16's range) where it is False."""
    mask = np.broadcast_to(np.tril(np.ones((SEQ, SEQ), bool)), (BATCH, 1, SEQ, SEQ)).copy()
    mask[1, 0, 0, :] = False
    return mask, np.where(mask, 0.0, -1e9).astype(np.float32)


def inputs_for(layer: str, magnitude: float) -> dict[str, Any]:
    """A layer's inputs at one magnitude; only ``x`` depends on it."""
    mask, bias = masks()
    if layer == "conv":
        return {"x": magnitude * unit(1, (BATCH, 6, 6, 4))}
    if layer.startswith("attention"):
        return {"x": magnitude * unit(2, (BATCH, SEQ, FEATURES)), "mask": jnp.asarray(mask), "bias": jnp.asarray(bias)}
    x = {"x": magnitude * unit(3, (BATCH, FEATURES))}
    if layer == "embedding":
        x["ids"] = jnp.asarray([3, 0, 15, 7])
    if layer == "dropout":
        x["key"] = jax.random.key(7)
    if layer.startswith("cross_entropy"):
        x["labels"] = jnp.asarray([1, 0, 9, 4])
    return x


def half_attention(query, key, value, bias=None, mask=None, **_: Any) -> jax.Array:
    """``jax.nn.dot_product_attention`` (its XLA path) on half-precision
    inputs, without the ``F16_F16_F32`` precision it asks for (XLA refuses it
    on CPU): the logits accumulated in float32, the bias, mask and softmax
    in float32, the probabilities cast to half for the second product. NNX's
    attention calls that function when it has no dropout."""
    logits = jnp.einsum("BTNH,BSNH->BNTS", query, key, preferred_element_type=F32) / np.sqrt(query.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -0.7 * jnp.finfo(F32).max)
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1).astype(value.dtype), value)


class Functional(NamedTuple):
    """``fn``/``ref``: ``(params, state, inputs) -> (out, new_state)``;
    ``args(magnitude) -> (params, state, inputs)``."""

    fn: Callable[..., Any]
    ref: Callable[..., Any]
    args: Callable[[float], tuple[Any, Any, dict[str, Any]]]


class Stateful(NamedTuple):
    """An NNX cell: ``make(dtype)`` builds the module (``None``: float32),
    ``prepare(module, magnitude)`` sets what depends on the magnitude,
    ``calls`` is how many calls in a row each check makes."""

    make: Callable[[Any], nnx.Module]
    prepare: Callable[[nnx.Module, float], None]
    calls: int


# ---------------------------------------------------------------- flax linen


class Linen(nn.Module):
    layer: str
    dtype: Any = None

    @nn.compact
    def __call__(self, x, ids=None, mask=None, bias=None, key=None, train=True):
        d, layer = self.dtype, self.layer.removesuffix("_bf16")
        if layer == "dense":
            return nn.Dense(FEATURES, dtype=d)(nn.gelu(nn.Dense(HIDDEN, dtype=d)(x)))
        if layer == "conv":
            return nn.Conv(4, (3, 3), dtype=d)(nn.relu(nn.Conv(8, (3, 3), dtype=d)(x)))
        if layer == "embedding":
            embed = nn.Embed(VOCAB, FEATURES, dtype=d)
            return embed.attend(nn.Dense(FEATURES, dtype=d)(embed(ids) + x))  # tied output layer
        if layer == "attention_bias":
            q, k, v = (nn.DenseGeneral((HEADS, FEATURES // HEADS), dtype=d)(x) for _ in range(3))
            o = nn.dot_product_attention(q, k, v, bias=bias, dtype=d, force_fp32_for_softmax=True)
            return nn.DenseGeneral(FEATURES, axis=(-2, -1), dtype=d)(o)
        if layer == "attention_mask":
            attention = nn.MultiHeadDotProductAttention(HEADS, dtype=d, force_fp32_for_softmax=True)
            return attention(x, mask=mask)
        if layer == "dropout":
            dropped = nn.Dropout(0.5, deterministic=False)(nn.Dense(HIDDEN, dtype=d)(x), rng=key)
            return dropped, nn.Dense(FEATURES, dtype=d)(dropped)
        h = nn.Dense(FEATURES, dtype=d)(x)  # near the identity (numpy_init)
        if layer == "layernorm":
            return nn.LayerNorm(dtype=d)(h)
        if layer == "rmsnorm":
            return nn.RMSNorm(dtype=d)(h)
        if layer == "groupnorm":
            return nn.GroupNorm(num_groups=2, dtype=d)(h)
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=d)(h)


def running_stats(magnitude: float, seed: int = 5) -> tuple[jax.Array, jax.Array]:
    """Running mean and variance for an eval-mode BatchNorm reading values
    of this magnitude (uniform in [-M, M]: variance M**2 / 3)."""
    mean = 0.1 * magnitude * unit(seed, (FEATURES,))
    return jnp.asarray(mean), jnp.full((FEATURES,), magnitude**2 / 3, F32)


def linen_cell(layer: str, half: Any) -> Functional:
    def make(dtype: Any) -> Callable[..., Any]:
        model = Linen(layer, dtype)

        def fn(params, state, inputs):
            if layer.startswith("batchnorm_train"):
                return model.apply({"params": params, **state}, **inputs, mutable=["batch_stats"])
            return model.apply({"params": params, **state}, **inputs, train=False), state

        return fn

    abstract = jax.eval_shape(lambda: Linen(layer).init(jax.random.key(0), **inputs_for(layer, 1.0), train=False))
    variables = numpy_init(abstract, 0, identity=layer.removesuffix("_bf16") in NORMS)
    params = variables["params"]

    def args(magnitude):
        state = {key: value for key, value in variables.items() if key != "params"}
        if layer.startswith("batchnorm_eval"):
            mean, var = running_stats(magnitude)
            state = {"batch_stats": {"BatchNorm_0": {"mean": mean, "var": var}}}
        return params, state, inputs_for(layer, magnitude)

    return Functional(make(None), make(half), args)


# ---------------------------------------------------------------- flax NNX


class NNX(nnx.Module):
    def __init__(self, layer: str, dtype: Any, rngs: nnx.Rngs):
        self.layer, d = layer.removesuffix("_bf16"), {"dtype": dtype, "rngs": rngs}
        layer = self.layer
        if layer == "dense":
            self.a, self.b = nnx.Linear(FEATURES, HIDDEN, **d), nnx.Linear(HIDDEN, FEATURES, **d)
        elif layer == "conv":
            self.a, self.b = nnx.Conv(4, 8, (3, 3), **d), nnx.Conv(8, 4, (3, 3), **d)
        elif layer == "embedding":
            self.a, self.b = nnx.Embed(VOCAB, FEATURES, **d), nnx.Linear(FEATURES, FEATURES, **d)
        elif layer == "attention_bias":
            self.qkv = nnx.List([nnx.LinearGeneral(FEATURES, (HEADS, FEATURES // HEADS), **d) for _ in range(3)])
            self.b = nnx.LinearGeneral((HEADS, FEATURES // HEADS), FEATURES, axis=(-2, -1), **d)
            self.dtype = dtype
        elif layer == "attention_mask":
            fn = {} if dtype is None else {"attention_fn": half_attention}
            self.a = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, **fn, **d)
        elif layer == "dropout":
            self.a, self.b = nnx.Linear(FEATURES, HIDDEN, **d), nnx.Linear(HIDDEN, FEATURES, **d)
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=11))
        else:
            self.a = nnx.Linear(FEATURES, FEATURES, **d)  # near the identity (numpy_init)
            self.norm = {
                "layernorm": lambda: nnx.LayerNorm(FEATURES, **d),
                "rmsnorm": lambda: nnx.RMSNorm(FEATURES, **d),
                "groupnorm": lambda: nnx.GroupNorm(FEATURES, num_groups=2, **d),
                "batchnorm_train": lambda: nnx.BatchNorm(FEATURES, momentum=0.9, **d),
                "batchnorm_eval": lambda: nnx.BatchNorm(FEATURES, use_running_average=True, **d),
            }[layer]()

    def __call__(self, x, ids=None, mask=None, bias=None):
        layer = self.layer
        if layer in ("dense", "conv"):
            return self.b(jax.nn.relu(self.a(x)) if layer == "conv" else nnx.gelu(self.a(x)))
        if layer == "embedding":
            return self.a.attend(self.b(self.a(ids) + x))
        if layer == "attention_bias":
            q, k, v = (p(x) for p in self.qkv)
            attention = nnx.dot_product_attention if self.dtype is None else half_attention
            return self.b(attention(q, k, v, bias=bias))
        if layer == "attention_mask":
            return self.a(x, mask=mask)
        if layer == "dropout":
            dropped = self.drop(self.a(x))
            return dropped, self.b(dropped)
        return self.norm(self.a(x))


def nnx_cell(layer: str, half: Any) -> Stateful:
    _, state = nnx.split(nnx.eval_shape(lambda: NNX(layer, None, nnx.Rngs(0))))
    values = numpy_init(nnx.to_pure_dict(state), 0, identity=layer.removesuffix("_bf16") in NORMS)

    def make(dtype: Any) -> nnx.Module:
        graphdef, state = nnx.split(nnx.eval_shape(lambda: NNX(layer, dtype, nnx.Rngs(0))))
        nnx.replace_by_pure_dict(state, values)
        return nnx.merge(graphdef, state)

    def prepare(model: nnx.Module, magnitude: float) -> None:
        if layer.startswith("batchnorm_eval"):
            model.norm.mean[...], model.norm.var[...] = running_stats(magnitude)

    return Stateful(make, prepare, 2 if layer.startswith(("dropout", "batchnorm_train")) else 1)


# ---------------------------------------------------------------- Equinox


def equinox_cell(layer: str, half: Any) -> Functional:
    """Equinox layers act on one sample: the model is vmapped over the batch.
    The reference casts the products' layers and inputs to ``half`` and runs
    each norm on its input cast up to float32 with float32 parameters,
    casting its output to ``half`` (Equinox's own norms upcast; its
    BatchNorm does not, flax's does)."""
    base = layer.removesuffix("_bf16")

    def build() -> tuple[eqx.Module, ...]:  # traced by eval_shape: the random initialisers compile nothing
        k = jax.random.split(jax.random.key(0), 2)
        if base == "dense":
            return eqx.nn.Linear(FEATURES, HIDDEN, key=k[0]), eqx.nn.Linear(HIDDEN, FEATURES, key=k[1])
        if base == "conv":
            return eqx.nn.Conv2d(4, 8, 3, padding=1, key=k[0]), eqx.nn.Conv2d(8, 4, 3, padding=1, key=k[1])
        if base == "embedding":
            return eqx.nn.Embedding(VOCAB, FEATURES, key=k[0]), eqx.nn.Linear(FEATURES, FEATURES, key=k[1])
        if base == "attention_mask":
            return (eqx.nn.MultiheadAttention(HEADS, FEATURES, key=k[0]),)
        if base == "dropout":
            return (
                eqx.nn.Linear(FEATURES, HIDDEN, key=k[0]),
                eqx.nn.Dropout(0.5),
                eqx.nn.Linear(HIDDEN, FEATURES, key=k[1]),
            )
        linear = eqx.nn.Linear(FEATURES, FEATURES, key=k[0])
        if base == "layernorm":
            return linear, eqx.nn.LayerNorm(FEATURES)
        if base == "rmsnorm":
            return linear, eqx.nn.RMSNorm(FEATURES)
        if base == "groupnorm":
            return linear, eqx.nn.GroupNorm(2, FEATURES)
        return (linear,)

    model = numpy_init(eqx.filter_eval_shape(build), 0, identity=base in NORMS)
    state = None
    if base.startswith("batchnorm"):
        norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(FEATURES, "batch", momentum=0.9, mode="ema")
        model = (*model, norm)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def body(dtype: Any) -> Callable[..., Any]:
        def cast(tree: Any) -> Any:
            return tree if dtype is None else half_cast(tree, dtype)

        def up(y: jax.Array) -> jax.Array:
            return y if dtype is None else y.astype(F32)

        def down(y: jax.Array) -> jax.Array:
            return y if dtype is None else y.astype(dtype)

        def fn(params, state, inputs):
            m, x = eqx.combine(params, static), inputs["x"]
            if base in ("dense", "conv"):
                a, b = cast(m[0]), cast(m[1])
                act = jax.nn.relu if base == "conv" else jax.nn.gelu
                x = cast(jnp.transpose(x, (0, 3, 1, 2)) if base == "conv" else x)  # Equinox convolves CHW
                return jax.vmap(lambda s: b(act(a(s))))(x), state
            if base == "embedding":
                emb, lin = cast(m[0]), cast(m[1])
                h = jax.vmap(lin)(jax.vmap(emb)(inputs["ids"]) + cast(x))
                return h @ emb.weight.T, state
            if base == "attention_mask":
                mha = cast(m[0])
                return jax.vmap(lambda s, mk: mha(s, s, s, mask=mk))(cast(x), inputs["mask"][:, 0]), state
            if base == "dropout":
                a, drop, b = cast(m[0]), m[1], cast(m[2])
                keys = jax.random.split(inputs["key"], BATCH)
                dropped = jax.vmap(lambda s, key: drop(a(s), key=key, inference=False))(cast(x), keys)
                return dropped, jax.vmap(b)(dropped)
            h = up(jax.vmap(cast(m[0]))(cast(x)))
            norm = m[1]
            if base.startswith("batchnorm"):
                inference = base.startswith("batchnorm_eval")

                def call(s, st):
                    return norm(s, st, inference=inference)

                out, state = jax.vmap(call, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(h, state)
                return down(out), state
            return down(jax.vmap(norm)(h)), state

        return fn

    def args(magnitude):
        st = jax.tree.map(jnp.asarray, state)  # a new State: Equinox refuses one that was set before
        if base.startswith("batchnorm_eval"):
            st = st.set(model[1].ema_state_index, running_stats(magnitude))
            st = st.set(model[1].ema_first_time_index, jnp.array(False))
        return params, st, inputs_for(layer, magnitude)

    return Functional(body(None), body(half), args)


# ---------------------------------------------------------------- plain JAX


def jax_cell(layer: str, half: Any) -> Functional:
    """Hand-written norms, losses and ``jax.nn.dot_product_attention``; the
    reference casts the product's operands to ``half`` and the statistic's
    or loss's input up to float32 (for attention: JAX's own half-precision
    path, which keeps its logits and softmax in float32)."""
    base = layer.removesuffix("_bf16")
    rng, eps = np.random.default_rng(0), 1e-6

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), F32)

    if base == "attention_bias":
        params = {n: normal(FEATURES, HEADS, FEATURES // HEADS) / 3 for n in "qkv"}
        params["o"] = normal(HEADS, FEATURES // HEADS, FEATURES) / 3
    elif base == "cross_entropy":
        params = {"w": normal(FEATURES, 10) / 3}
    elif base == "mse":
        params = {"w": jnp.asarray(0.8 * near_identity(rng, FEATURES))}  # errors of ~0.8 x the magnitude
    else:
        params = {"w": jnp.asarray(near_identity(rng, FEATURES)), "g": 1.0 + 0.1 * normal(FEATURES)}

    statistic = {
        "rms_pow": lambda h: h * jax.lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + eps),
        "rms_mul": lambda h: h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps),
        "var_norm": lambda h: (
            (h - jnp.mean(h, axis=-1, keepdims=True)) * jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + eps)
        ),
        "linalg_norm": lambda h: h / jnp.linalg.norm(h, axis=-1, keepdims=True),
    }

    def body(dtype: Any) -> Callable[..., Any]:
        def product(a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
            if dtype is not None:
                a, b = a.astype(dtype), b.astype(dtype)
            return jnp.einsum(spec, a, b)

        def up(y: jax.Array) -> jax.Array:
            return y if dtype is None else y.astype(F32)

        def fn(params, state, inputs):
            x = inputs["x"]
            if base == "attention_bias":
                q, kk, v = (product(x, params[n], "btf,fhd->bthd") for n in "qkv")
                attention = jax.nn.dot_product_attention if dtype is None else half_attention
                o = attention(q, kk, v, bias=inputs["bias"])
                return product(o, params["o"], "bthd,hdf->btf"), state
            if base == "cross_entropy":
                logits = up(product(x, params["w"], "bf,fc->bc"))
                return optax.softmax_cross_entropy_with_integer_labels(logits, inputs["labels"]).mean(), state
            h = product(x, params["w"], "bf,fg->bg")
            if base == "mse":
                return jnp.mean((up(h) - 1.0) ** 2), state
            out = statistic[base](up(h)) * params["g"][None, :]
            return (out if dtype is None else out.astype(dtype)), state

        return fn

    return Functional(body(None), body(half), lambda magnitude: (params, None, inputs_for(layer, magnitude)))

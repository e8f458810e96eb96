"""Small models written in float32, without a dtype anywhere, for the
``autocast`` tests, the benchmark and the example: an MLP, a convolutional
net and a transformer block (attention, softmax, layer norm, gelu,
residual), each with a hand-cast twin that computes in a half dtype the way
jmp and MPX users write it (parameters and inputs cast to half, logits cast
back to float32 for the loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cast_floats(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def row(b, like):
    """``b`` shaped to broadcast along ``like``'s last axis (the tests run
    with rank promotion an error)."""
    return b.reshape((1,) * (like.ndim - 1) + b.shape)


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits.astype(jnp.float32)) * labels, axis=-1))


# -- MLP ---------------------------------------------------------------------


def mlp_params(key, sizes=(32, 64, 64, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (m, n)) * np.sqrt(2.0 / m), jnp.zeros(n))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_logits(params, x):
    h = x
    for w, b in params[:-1]:
        h = h @ w
        h = jax.nn.relu(h + row(b, h))
    w, b = params[-1]
    out = h @ w
    return out + row(b, out)


def mlp_loss(params, x, y):
    return cross_entropy(mlp_logits(params, x), y)


def mlp_loss_hand_cast(params, x, y, dtype=jnp.float16):
    return cross_entropy(mlp_logits(cast_floats(params, dtype), x.astype(dtype)), y)


def classification_batch(key, n=64, features=32, classes=10):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, features))
    teacher = jax.random.normal(kw, (features, classes))
    y = jax.nn.one_hot(jnp.argmax(x @ teacher, axis=-1), classes)
    return x, y


# -- convolutional net ---------------------------------------------------------


def cnn_params(key, channels=8, classes=10):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "conv1": jax.random.normal(k1, (channels, 1, 3, 3)) * 0.3,
        "conv2": jax.random.normal(k2, (channels, channels, 3, 3)) * 0.1,
        "dense": jax.random.normal(k3, (channels * 8 * 8, classes)) * 0.02,
    }


def cnn_logits(params, images):
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))

    h = jax.nn.relu(conv(images, params["conv1"]))
    h = jax.nn.relu(conv(h, params["conv2"]))
    return h.reshape(h.shape[0], -1) @ params["dense"]


def cnn_loss(params, images, y):
    return cross_entropy(cnn_logits(params, images), y)


# -- transformer block -----------------------------------------------------------


def block_params(key, d=32, heads=4, hidden=64, vocab=16):
    ks = jax.random.split(key, 7)

    def dense(k, m, n):
        return jax.random.normal(k, (m, n)) * np.sqrt(1.0 / m)

    return {
        "embed": jax.random.normal(ks[0], (vocab, d)) * 0.5,
        "qkv": dense(ks[1], d, 3 * d),
        "proj": dense(ks[2], d, d),
        "ln1": (jnp.ones(d), jnp.zeros(d)),
        "ln2": (jnp.ones(d), jnp.zeros(d)),
        "up": (dense(ks[3], d, hidden), jnp.zeros(hidden)),
        "down": (dense(ks[4], hidden, d), jnp.zeros(d)),
        "head": dense(ks[5], d, vocab),
    }


def layer_norm(x, scale_bias, eps=1e-5):
    scale, bias = scale_bias
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return y * row(scale, y) + row(bias, y)


def attention(p, x, heads=4):
    t, d = x.shape[-2:]
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)

    def split(a):
        return a.reshape(*a.shape[:-1], heads, d // heads).swapaxes(-2, -3)

    q, k, v = split(q), split(k), split(v)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e4), axis=-1)
    out = (weights @ v).swapaxes(-2, -3).reshape(*x.shape)
    return out @ p["proj"]


def block(p, x):
    x = x + attention(p, layer_norm(x, p["ln1"]))
    w1, b1 = p["up"]
    w2, b2 = p["down"]
    up = layer_norm(x, p["ln2"]) @ w1
    down = jax.nn.gelu(up + row(b1, up)) @ w2
    return x + down + row(b2, down)


def block_logits(params, tokens):
    return block(params, params["embed"][tokens]) @ params["head"]


def block_loss(params, tokens, targets):
    return cross_entropy(block_logits(params, tokens), jax.nn.one_hot(targets, params["head"].shape[1]))


def block_loss_hand_cast(params, tokens, targets, dtype=jnp.float16):
    half = cast_floats(params, dtype)
    return cross_entropy(block_logits(half, tokens), jax.nn.one_hot(targets, params["head"].shape[1]))


def token_batch(key, n=8, t=12, vocab=16):
    tokens = jax.random.randint(key, (n, t), 0, vocab)
    return tokens, jnp.roll(tokens, -1, axis=1)

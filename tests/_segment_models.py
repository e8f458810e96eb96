"""Small float16 models whose backward pass spans more binades than float16
holds, for the per-segment scaling tests, with float32 oracles.

``chain``: a deep stack of layers whose backward pass shrinks each layer's
cotangent by ``2**-SHRINK`` while the forward pass keeps its scale (a
straight-through term carries the rest of the forward value), so that the
first layers' cotangents lie about ``DEPTH * SHRINK`` binades below the
head's; ``ls.segment`` between the layers when ``marked``.

``rnn``: a tanh recurrent network over ``CHUNKS`` chunks of ``STEPS``
tokens, a scan of chunks whose body scans the chunk's steps, the embedding
looked up inside the body, the loss read from the last state only, a
boundary on the carry at each chunk when ``marked``: the early chunks'
cotangents shrink with every chunk further back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import loss_scale as ls

DEPTH, WIDTH, SHRINK = 5, 16, 9


def chain_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layer{k}": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
        for k in range(DEPTH)
    } | {"head": jnp.asarray(rng.standard_normal((WIDTH, 4)), jnp.float32)}


def chain_batch(seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((8, WIDTH)), jnp.float32)


def _shrinking(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` forward; its cotangents are ``2**-SHRINK`` times smaller."""
    y = x @ w
    small = y * jnp.asarray(2.0**-SHRINK, y.dtype)
    return small + jax.lax.stop_gradient(y - small)


def chain_loss(params: dict, x: jax.Array, dtype=jnp.float16, marked: bool = True) -> jax.Array:
    h = x.astype(dtype)
    for k in range(DEPTH):
        h = jnp.tanh(_shrinking(h, params[f"layer{k}"].astype(dtype)))
        if marked:
            h = ls.segment(h, f"layer{k}")
    out = h @ params["head"].astype(dtype)
    return jnp.mean(out.astype(jnp.float32) ** 2)


CHAIN_SEGMENTS = tuple(f"layer{k}" for k in range(DEPTH))

CHUNKS, STEPS, VOCAB, HIDDEN = 6, 4, 12, 8


def rnn_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((VOCAB, HIDDEN)) * 0.5, jnp.float32),
        "recurrent": jnp.asarray(rng.standard_normal((HIDDEN, HIDDEN)) * 0.1, jnp.float32),
        "head": jnp.asarray(rng.standard_normal((HIDDEN, 3)), jnp.float32),
    }


# The first chunk's tokens appear nowhere else: their embedding rows'
# gradients come from the first chunk alone, the furthest back in time.
FIRST_CHUNK_TOKENS = np.arange(STEPS)


def rnn_tokens(seed: int = 1) -> jax.Array:
    later = np.random.default_rng(seed).integers(STEPS, VOCAB, (CHUNKS - 1) * STEPS)
    return jnp.asarray(np.concatenate([FIRST_CHUNK_TOKENS, later]), jnp.int32)


def rnn_loss(params: dict, tokens: jax.Array, dtype=jnp.float16, marked: bool = True) -> jax.Array:
    def chunk(h, chunk_tokens):
        if marked:
            h = ls.segment(h, "time")

        def step(h, token):
            x = params["embed"][token].astype(dtype)
            return jnp.tanh(h @ params["recurrent"].astype(dtype) + x), None

        return jax.lax.scan(step, h, chunk_tokens)[0], None

    h, _ = jax.lax.scan(chunk, jnp.zeros((HIDDEN,), dtype), tokens.reshape(CHUNKS, STEPS))
    return jnp.sum((h @ params["head"].astype(dtype)).astype(jnp.float32) ** 2)


def relative_error(got: jax.Array, want: jax.Array) -> float:
    """The largest error relative to the oracle's largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def with_exponents(state, scale=None, **exponents):
    """``state`` (a ``LossScaleState`` with segments) with some boundaries'
    exponents set, and the scale when given."""
    counters = state.counters._replace(segments=state.counters.segments.replace(exponents=exponents))
    state = state._replace(counters=counters)
    return state if scale is None else state._replace(scale=jnp.float32(scale))

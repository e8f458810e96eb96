"""Decoder-only language models in the shapes open models have today, in
plain ``jax.numpy``: the workloads of autocast's memory benchmark.

* ``llama``: pre-norm (RMSNorm before each sub-layer), rotary positions,
  SwiGLU, grouped-query attention;
* ``gemma3``: RMSNorm before *and after* each sub-layer, RMSNorm on the
  queries and keys, rotary positions at two bases, sliding-window layers
  between global ones (five to one), GeGLU, grouped-query attention;
* ``qwen3``: the Llama shape with RMSNorm on the queries and keys.

Written once, for a compute dtype: ``precision="f32"`` is the float32
model (the one ``ls.autocast`` reads), ``"mixed"`` the same model cast by
hand as a framework's float16 mode casts it (flax's layers with
``dtype=float16``): params and activations in float16, a norm's
statistics in float32 and its output back in float16, the attention
scores and their softmax in float16 (flax's default), the loss in
float32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from _harness.models import Model, cast, compute_dtype, fmt_count, n_params, normal, row

STYLES = ("llama", "gemma3", "qwen3")


class Style(NamedTuple):
    post_norms: bool  # a norm after each sub-layer too (Gemma 2/3, OLMo 2)
    qk_norm: bool  # RMSNorm on each head's queries and keys (Gemma 3, Qwen 3, OLMo 2)
    window: int | None  # the local layers' sliding window (None: every layer global)
    local_per_global: int  # local layers before each global one
    activation: str  # "silu" (SwiGLU) or "gelu" (GeGLU)


_STYLES = {
    "llama": Style(post_norms=False, qk_norm=False, window=None, local_per_global=0, activation="silu"),
    "gemma3": Style(post_norms=True, qk_norm=True, window=128, local_per_global=5, activation="gelu"),
    "qwen3": Style(post_norms=False, qk_norm=True, window=None, local_per_global=0, activation="silu"),
}
_BASES = {"global": 1_000_000.0, "local": 10_000.0}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Statistics in float32, the output in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6)
    return (y * row(1.0 + scale.astype(jnp.float32), y.ndim)).astype(x.dtype)


def _rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary positions on ``x`` of shape ``[batch, seq, heads, head_dim]``."""
    seq, half = x.shape[1], x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = (f(angles).astype(x.dtype)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def make_decoder(
    style: str,
    precision: str,
    vocab: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
) -> Model:
    """Decoder ``style`` (one of ``STYLES``) with a tied embedding and
    next-token cross-entropy."""
    shape = _STYLES[style]
    head_dim = d_model // n_heads
    d_ff = 4 * d_model
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> Any:
        return normal(rng, (n_in, n_out), 1.0 / math.sqrt(n_in))

    def zeros(n: int) -> jax.Array:
        return jnp.zeros((n,), jnp.float32)

    def layer() -> dict[str, Any]:
        p = {
            "attn_norm": zeros(d_model),
            "q": dense(d_model, n_heads * head_dim),
            "k": dense(d_model, n_kv_heads * head_dim),
            "v": dense(d_model, n_kv_heads * head_dim),
            "o": dense(n_heads * head_dim, d_model),
            "mlp_norm": zeros(d_model),
            "gate": dense(d_model, d_ff),
            "up": dense(d_model, d_ff),
            "down": dense(d_ff, d_model),
        }
        if shape.post_norms:
            p |= {"attn_post_norm": zeros(d_model), "mlp_post_norm": zeros(d_model)}
        if shape.qk_norm:
            p |= {"q_norm": zeros(head_dim), "k_norm": zeros(head_dim)}
        return p

    params = {"embed": normal(rng, (vocab, d_model), 1.0), "layers": [layer() for _ in range(n_layers)]}
    params["final_norm"] = zeros(d_model)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len + 1)), jnp.int32)
    dtype = compute_dtype(precision)
    positions = np.arange(seq_len)
    causal = positions[:, None] >= positions[None, :]
    masks = {"global": causal}
    if shape.window is not None:
        masks["local"] = causal & (positions[:, None] - positions[None, :] < shape.window)
    kinds = [
        "local" if shape.window is not None and (i + 1) % (shape.local_per_global + 1) else "global"
        for i in range(n_layers)
    ]
    act = jax.nn.silu if shape.activation == "silu" else jax.nn.gelu

    def attention(x: jax.Array, p: dict[str, jax.Array], kind: str) -> jax.Array:
        b, t, _ = x.shape
        q = (x @ p["q"]).reshape(b, t, n_heads, head_dim)
        k = (x @ p["k"]).reshape(b, t, n_kv_heads, head_dim)
        v = (x @ p["v"]).reshape(b, t, n_kv_heads, head_dim)
        if shape.qk_norm:
            q, k = _rms_norm(q, p["q_norm"]), _rms_norm(k, p["k_norm"])
        q, k = _rope(q, _BASES[kind]), _rope(k, _BASES[kind])
        group = n_heads // n_kv_heads
        q = q.reshape(b, t, n_kv_heads, group, head_dim) * (1.0 / math.sqrt(head_dim))
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k)
        scores = jnp.where(masks[kind][None, None, None], scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, n_heads * head_dim)
        return out @ p["o"]

    def mlp(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return (act(x @ p["gate"]) * (x @ p["up"])) @ p["down"]

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        params = cast(params, dtype)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"][inputs] * math.sqrt(d_model)
        for p, kind in zip(params["layers"], kinds, strict=True):
            h = attention(_rms_norm(x, p["attn_norm"]), p, kind)
            x = x + (_rms_norm(h, p["attn_post_norm"]) if shape.post_norms else h)
            h = mlp(_rms_norm(x, p["mlp_norm"]), p)
            x = x + (_rms_norm(h, p["mlp_post_norm"]) if shape.post_norms else h)
        logits = (_rms_norm(x, params["final_norm"]) @ params["embed"].T).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    description = (
        f"{style} decoder d={d_model} L={n_layers} H={n_heads} KV={n_kv_heads} vocab={vocab} seq={seq_len}, "
        f"batch {batch_size}, {fmt_count(n_params(params))} params"
    )
    return Model(style, precision, description, params, tokens, loss_fn)

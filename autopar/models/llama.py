"""A Llama-style decoder LM in flax linen, with an optax adamw training step.

RMSNorm before each block, rotary position embeddings on queries and keys, grouped-query
attention (``kv_heads`` key/value heads shared by ``heads / kv_heads`` query heads each), a
SwiGLU MLP (``down(silu(gate(x)) * up(x))``), no biases, an untied LM head.

Shapes in comments: B batch, S sequence, D model width, H query heads, K key/value heads,
G = H/K query heads per key/value head, Dh head width, F MLP width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.models import abstract_of, concrete_of
from autopar.models.gpt import lm_train_step, make_batch


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    kv_heads: int = 2
    d_ff: int = 128
    layers: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    scan: bool = False      # stack the layers with nn.scan (one loop region) instead of unrolling
    remat: bool = False     # recompute each block in the backward pass (nn.remat)
    dtype: Any = jnp.float32


# Published shapes (Llama 2 7B: multi-head; Llama 3 8B: 8 key/value heads), computing in
# bfloat16 with float32 parameters and optimizer state.
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "7B": LlamaConfig(vocab=32000, seq=4096, d_model=4096, heads=32, kv_heads=32, d_ff=11008,
                      layers=32, dtype=jnp.bfloat16),
    "8B": LlamaConfig(vocab=128256, seq=8192, d_model=4096, heads=32, kv_heads=8, d_ff=14336,
                      layers=32, rope_theta=500000.0, dtype=jnp.bfloat16),
}


def rotary(x, theta: float):
    """Rotates each (first half, second half) pair of ``x (B, S, N, Dh)`` by position."""
    s, dh = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)   # (Dh/2,)
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]      # (S, Dh/2)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):  # x: (B, S, D)
        c = self.cfg
        dh, g = c.d_model // c.heads, c.heads // c.kv_heads
        dense = (lambda n, name: nn.DenseGeneral((n, dh), use_bias=False, dtype=c.dtype,
                                                 name=name))
        q = rotary(dense(c.heads, "q")(x), c.rope_theta)                          # (B, S, H, Dh)
        k = rotary(dense(c.kv_heads, "k")(x), c.rope_theta)                       # (B, S, K, Dh)
        v = dense(c.kv_heads, "v")(x)                                             # (B, S, K, Dh)
        b, s = x.shape[:2]
        q = q.reshape(b, s, c.kv_heads, g, dh)                                    # (B, S, K, G, Dh)
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / jnp.sqrt(dh).astype(c.dtype)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(c.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)                                   # (B, K, G, S, S)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, s, c.heads, dh)
        return nn.DenseGeneral(c.d_model, axis=(-2, -1), use_bias=False, dtype=c.dtype,
                               name="o")(out)


class MLP(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x):  # (B, S, D)
        c = self.cfg
        gate = nn.Dense(c.d_ff, use_bias=False, dtype=c.dtype, name="gate")(x)   # (B, S, F)
        up = nn.Dense(c.d_ff, use_bias=False, dtype=c.dtype, name="up")(x)
        return nn.Dense(c.d_model, use_bias=False, dtype=c.dtype, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, _=None):
        c = self.cfg
        x = x + Attention(c, name="attn")(nn.RMSNorm(c.norm_eps, dtype=c.dtype, name="norm1")(x))
        x = x + MLP(c, name="mlp")(nn.RMSNorm(c.norm_eps, dtype=c.dtype, name="norm2")(x))
        return (x, None) if c.scan else x


class Llama(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: (B, S) int32
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, dtype=c.dtype, name="embed")(tokens)    # (B, S, D)
        block = nn.remat(Block) if c.remat else Block
        if c.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=c.layers)
            x, _ = stack(c, name="layers")(x, None)
        else:
            for i in range(c.layers):
                x = block(c, name=f"layer_{i}")(x)
        x = nn.RMSNorm(c.norm_eps, dtype=c.dtype, name="norm_f")(x)
        return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="lm_head")(x)   # (B, S, V)


def make_train_step(cfg: LlamaConfig, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is a dict of params and adamw state."""
    return lm_train_step(Llama(cfg), cfg.seq, lr)


def concrete(cfg: LlamaConfig, batch_size: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    return concrete_of(make_train_step, make_batch, cfg, batch_size, seed)


def abstract(cfg: LlamaConfig, batch_size: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    return abstract_of(make_train_step, make_batch, cfg, batch_size)

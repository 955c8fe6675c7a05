"""A GPT-style decoder LM in flax linen, with an optax adamw training step.

Shapes in comments: B batch, S sequence, D model width, H heads, Dh head width, F MLP width,
V vocabulary, L layers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    layers: int = 2
    scan: bool = False      # stack the layers with nn.scan (one loop region) instead of unrolling
    remat: bool = False     # recompute each block in the backward pass (nn.remat)
    dtype: Any = jnp.float32


# Configs of the papers (Megatron-LM / Alpa GPT table), by parameter count.
GPT_CONFIGS: dict[str, GPTConfig] = {
    "125M": GPTConfig(vocab=51200, seq=1024, d_model=768, heads=12, d_ff=3072, layers=12),
    "350M": GPTConfig(vocab=51200, seq=1024, d_model=1024, heads=16, d_ff=4096, layers=24),
    "1.3B": GPTConfig(vocab=51200, seq=1024, d_model=2048, heads=32, d_ff=8192, layers=24),
    "2.6B": GPTConfig(vocab=51200, seq=1024, d_model=2560, heads=32, d_ff=10240, layers=32),
    "6.7B": GPTConfig(vocab=51200, seq=1024, d_model=4096, heads=32, d_ff=16384, layers=32),
    "15B": GPTConfig(vocab=51200, seq=1024, d_model=5120, heads=40, d_ff=20480, layers=48),
    "39B": GPTConfig(vocab=51200, seq=1024, d_model=8192, heads=64, d_ff=32768, layers=48),
    "76B": GPTConfig(vocab=51200, seq=1024, d_model=10240, heads=80, d_ff=40960, layers=60),
    "175B": GPTConfig(vocab=51200, seq=2048, d_model=12288, heads=96, d_ff=49152, layers=96),
}


class Attention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):  # x: (B, S, D)
        c = self.cfg
        dh = c.d_model // c.heads
        # No qkv bias: the key bias gets an exactly-zero gradient (softmax is shift-invariant) that
        # Adam would blow up from rounding noise into lr-sized updates, hiding real differences.
        qkv = nn.DenseGeneral((3, c.heads, dh), use_bias=False, dtype=c.dtype, name="qkv")(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                       # (B, S, H, Dh)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(dh).astype(c.dtype)
        s = x.shape[1]
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(c.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)                                   # (B, H, S, S)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)                             # (B, S, H, Dh)
        return nn.DenseGeneral(c.d_model, axis=(-2, -1), dtype=c.dtype, name="out")(out)


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):  # (B, S, D)
        h = nn.Dense(self.cfg.d_ff, dtype=self.cfg.dtype, name="fc1")(x)  # (B, S, F)
        h = nn.gelu(h)
        return nn.Dense(self.cfg.d_model, dtype=self.cfg.dtype, name="fc2")(h)


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, _=None):
        x = x + Attention(self.cfg, name="attn")(nn.LayerNorm(dtype=self.cfg.dtype, name="ln1")(x))
        x = x + MLP(self.cfg, name="mlp")(nn.LayerNorm(dtype=self.cfg.dtype, name="ln2")(x))
        return (x, None) if self.cfg.scan else x


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):  # tokens: (B, S) int32
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, dtype=c.dtype, name="wte")(tokens)   # (B, S, D)
        pos = self.param("wpe", nn.initializers.normal(0.02), (c.seq, c.d_model))
        x = x + pos[None, : tokens.shape[1]].astype(c.dtype)
        block = nn.remat(Block) if c.remat else Block
        if c.scan:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=c.layers)
            x, _ = stack(c, name="layers")(x, None)
        else:
            for i in range(c.layers):
                x = block(c, name=f"layer_{i}")(x)
        x = nn.LayerNorm(dtype=c.dtype, name="ln_f")(x)
        return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="lm_head")(x)  # (B, S, V)


def loss_fn(params, model, batch):
    logits = model.apply({"params": params}, batch["tokens"])                  # (B, S, V)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
    return nll.mean()


def make_train_step(cfg: GPTConfig, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is a dict of params and adamw state."""
    model = GPT(cfg)
    tx = optax.adamw(lr, weight_decay=0.01)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], model, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, loss

    def init_state(rng, batch_size: int):
        tokens = jnp.zeros((batch_size, cfg.seq), jnp.int32)
        params = model.init(rng, tokens)["params"]
        return {"params": params, "opt_state": tx.init(params)}

    return train_step, init_state


def make_batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"tokens": jax.random.randint(k1, (batch_size, cfg.seq), 0, cfg.vocab, jnp.int32),
            "targets": jax.random.randint(k2, (batch_size, cfg.seq), 0, cfg.vocab, jnp.int32)}


def concrete(cfg: GPTConfig, batch_size: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    step, init = make_train_step(cfg)
    return step, init(jax.random.PRNGKey(seed), batch_size), make_batch(cfg, batch_size, seed)


def abstract(cfg: GPTConfig, batch_size: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    step, init = make_train_step(cfg)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), batch_size))
    batch = jax.eval_shape(lambda: make_batch(cfg, batch_size))
    return step, state, batch

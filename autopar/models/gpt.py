"""A GPT-style decoder LM in flax linen, with an optax adamw training step.

Shapes in comments: B batch, S sequence, D model width, H heads, Dh head width, F MLP width,
V vocabulary, L layers.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.models import abstract_of, adamw_step, concrete_of, token_batch


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    layers: int = 2
    scan: bool = False      # stack the layers with nn.scan (one loop region) instead of unrolling
    # recompute each block in the backward pass (nn.remat): True (all of it), or "selective",
    # Megatron-LM's selective recomputation: the matmuls with weights keep their outputs, the
    # attention's scores, softmax and weighted sum (batched matmuls) are recomputed
    remat: bool | str = False
    dtype: Any = jnp.float32


def remat_block(block, remat: bool | str):
    """``block`` under the user's recomputation ``remat`` (``GPTConfig.remat``)."""
    if remat == "selective":
        return nn.remat(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    if remat not in (True, False):
        raise ValueError(f"GPTConfig.remat={remat!r}: True, False or 'selective'")
    return nn.remat(block) if remat else block


# Configs of the papers (Megatron-LM / Alpa GPT table), by parameter count: vocabulary 51200,
# d_ff = 4 d_model. They compute in bfloat16 (parameters and optimizer state stay float32), as
# those papers trained them.
def _paper(d_model: int, heads: int, layers: int, seq: int = 1024) -> GPTConfig:
    return GPTConfig(vocab=51200, seq=seq, d_model=d_model, heads=heads, d_ff=4 * d_model,
                     layers=layers, dtype=jnp.bfloat16)


GPT_CONFIGS: dict[str, GPTConfig] = {
    "125M": _paper(768, 12, 12),
    "350M": _paper(1024, 16, 24),
    "1.3B": _paper(2048, 32, 24),
    "2.6B": _paper(2560, 32, 32),
    "6.7B": _paper(4096, 32, 32),
    "15B": _paper(5120, 40, 48),
    "39B": _paper(8192, 64, 48),
    "76B": _paper(10240, 80, 60),
    "175B": _paper(12288, 96, 96, seq=2048),
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
        block = remat_block(Block, c.remat)
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
    return lm_train_step(GPT(cfg), cfg.seq, lr)


def lm_train_step(model: nn.Module, seq: int, lr: float = 1e-3):
    """``(train_step, init_state)`` of any token-in, logits-out ``model`` (adamw, next-token
    cross-entropy); shared by the GPT and Llama-style models."""
    tx = optax.adamw(lr, weight_decay=0.01)

    train_step = adamw_step(lambda params, batch: loss_fn(params, model, batch), tx)

    @functools.partial(jax.jit, static_argnums=1)   # one program, not one per initialiser op
    def init_state(rng, batch_size: int):
        tokens = jnp.zeros((batch_size, seq), jnp.int32)
        params = model.init(rng, tokens)["params"]
        return {"params": params, "opt_state": tx.init(params)}

    return train_step, init_state


def make_batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    return token_batch(cfg.vocab, cfg.seq, batch_size, seed)


def concrete(cfg: GPTConfig, batch_size: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    return concrete_of(make_train_step, make_batch, cfg, batch_size, seed)


def abstract(cfg: GPTConfig, batch_size: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    return abstract_of(make_train_step, make_batch, cfg, batch_size)

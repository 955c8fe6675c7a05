"""A small causal language model written the way Flax NNX teaches: ``nnx.Embed``,
``nnx.RMSNorm``, ``nnx.MultiHeadAttention`` with a padding mask from the batch, an MLP and an
``nnx.Linear`` head, trained by an optax adamw step on its state pytree.

Layers are a Python list, or stacked and run by ``nnx.scan`` (``scan=True``, the layout the
NNX docs give for deep models), each optionally under ``nnx.remat``. Like ``nnx_mlp``, the
graphdef is closed over and the step takes and returns plain pytrees ``(params, opt_state)``.
The batch holds ``tokens``, ``targets`` and ``mask`` (1 for a real token, 0 for padding at the
end of a row); attention sees a key when it is real and not after the query
(``nnx.make_attention_mask`` and ``is_causal``), and the loss averages over the real tokens.
Shapes in comments: B batch, S sequence, E model width, V vocabulary.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autopar.models import adamw_step


@dataclasses.dataclass(frozen=True)
class NNXLMConfig:
    vocab: int = 128
    seq: int = 16
    d_model: int = 32
    heads: int = 4
    kv_heads: int | None = None  # fewer than heads: grouped-query attention
    d_ff: int = 64
    layers: int = 2
    scan: bool = False
    remat: bool = False
    padding_mask: bool = True    # False: causal only (a constant mask the kernel rebuilds)


class Block(nnx.Module):
    def __init__(self, cfg: NNXLMConfig, *, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.d_model, num_kv_heads=cfg.kv_heads,
                                           decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x, mask):                          # (B, S, E), (B, 1, S, S) or None
        x = x + self.attn(self.norm1(x), mask=mask, is_causal=True)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NNXLM(nnx.Module):
    def __init__(self, cfg: NNXLMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        if cfg.scan:
            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs: nnx.Rngs):
                return Block(cfg, rngs=rngs)
            self.blocks = stack(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, padding=None):             # (B, S) int, (B, S) or None
        x = self.embed(tokens)                             # (B, S, E)
        mask = None if padding is None else nnx.make_attention_mask(padding, padding)
        if self.cfg.scan:
            x = self._scanned(x, mask)
        else:
            for block in self.blocks:
                x = (nnx.remat(block) if self.cfg.remat else block)(x, mask)
        return self.head(self.norm(x))                     # (B, S, V)

    def _scanned(self, x, mask):
        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        def run(x, block, mask):
            return (nnx.remat(block) if self.cfg.remat else block)(x, mask)
        return run(x, self.blocks, mask)


def make_train_step(cfg: NNXLMConfig, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is ``{"params", "opt_state"}``."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: NNXLM(cfg, rngs=nnx.Rngs(0))))
    tx = optax.adamw(lr, weight_decay=0.01)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        real = batch["mask"]
        logits = model(batch["tokens"], real if cfg.padding_mask else None)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * real) / jnp.sum(real)

    def init_state(seed: int = 0):
        _, params = nnx.split(NNXLM(cfg, rngs=nnx.Rngs(seed)))
        return {"params": params, "opt_state": tx.init(params)}

    return adamw_step(loss_fn, tx), init_state


def make_batch(cfg: NNXLMConfig, rows: int, seed: int = 0) -> dict:
    """Random tokens and targets; every other row padded after a random length (at least half
    the sequence, so every query sees a key)."""
    rng = np.random.default_rng(seed)
    lengths = np.where(np.arange(rows) % 2, rng.integers(cfg.seq // 2, cfg.seq, rows), cfg.seq)
    mask = (np.arange(cfg.seq)[None] < lengths[:, None]).astype(np.int32)     # (B, S)
    return {"tokens": jnp.asarray(rng.integers(0, cfg.vocab, (rows, cfg.seq)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, cfg.vocab, (rows, cfg.seq)), jnp.int32),
            "mask": jnp.asarray(mask)}


def concrete(cfg: NNXLMConfig, rows: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    step, init = make_train_step(cfg)
    return step, init(seed), make_batch(cfg, rows, seed)


def abstract(cfg: NNXLMConfig, rows: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    step, init = make_train_step(cfg)
    return step, jax.eval_shape(init), jax.eval_shape(lambda: make_batch(cfg, rows))

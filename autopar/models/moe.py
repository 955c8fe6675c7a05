"""A GShard-style mixture-of-experts LM in flax linen, with an optax adamw training step.

Routing is top-1 or top-2 with a capacity factor and einsum dispatch/combine (no ragged
all-to-all, so it runs on CPU). Shapes in comments: G groups, S tokens per group, D model width,
E experts, C capacity per expert and group, F expert MLP width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.models import abstract_of, adamw_step, concrete_of, token_batch


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 128
    seq: int = 32
    d_model: int = 32
    d_ff: int = 64
    experts: int = 4
    top_k: int = 2                 # 1 or 2
    capacity_factor: float = 1.25
    layers: int = 2
    dtype: Any = jnp.float32

    def capacity(self, tokens_per_group: int) -> int:
        return max(1, math.ceil(self.top_k * self.capacity_factor * tokens_per_group
                                / self.experts))


def _assign(gates, capacity: int, taken, fill):
    """One routing round: argmax expert, its buffer slot, dropped past ``capacity``."""
    e = gates.shape[-1]
    mask = jax.nn.one_hot(jnp.argmax(gates, -1), e, dtype=gates.dtype)  # (G, S, E)
    pos = jnp.cumsum(mask, axis=1) - 1 + fill                           # (G, S, E)
    mask = mask * (pos < capacity) * (1 - taken)
    slot = jax.nn.one_hot(jnp.sum(pos * mask, -1).astype(jnp.int32), capacity,
                          dtype=gates.dtype)                            # (G, S, C)
    return mask, slot, jnp.sum(gates * mask, -1)                        # gate: (G, S)


def route(logits, capacity: int, top_k: int):
    """Returns (combine, dispatch) tensors of shape (G, S, E, C)."""
    gates = jax.nn.softmax(logits, axis=-1)                             # (G, S, E)
    m1, s1, g1 = _assign(gates, capacity, jnp.zeros_like(gates), 0.0)
    combine = (g1[..., None, None] * m1[..., None] * s1[:, :, None, :])
    if top_k == 2:
        fill = jnp.sum(m1, axis=1, keepdims=True)                       # (G, 1, E)
        m2, s2, g2 = _assign(gates * (1 - m1), capacity, m1, fill)
        denom = g1 + g2 + 1e-9
        combine = (combine + g2[..., None, None] * m2[..., None] * s2[:, :, None, :]) \
            / denom[..., None, None]
    return combine, (combine > 0).astype(logits.dtype)


class MoE(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):  # (G, S, D)
        c = self.cfg
        init = nn.initializers.normal(0.02)
        w_in = self.param("w_in", init, (c.experts, c.d_model, c.d_ff))    # (E, D, F)
        w_out = self.param("w_out", init, (c.experts, c.d_ff, c.d_model))  # (E, F, D)
        logits = nn.Dense(c.experts, use_bias=False, name="router")(x)    # (G, S, E)
        combine, dispatch = route(logits, c.capacity(x.shape[1]), c.top_k)
        xe = jnp.einsum("gsec,gsm->egcm", dispatch, x)                     # (E, G, C, D)
        h = nn.gelu(jnp.einsum("egcm,emf->egcf", xe, w_in))               # (E, G, C, F)
        ye = jnp.einsum("egcf,efm->egcm", h, w_out)                        # (E, G, C, D)
        return jnp.einsum("gsec,egcm->gsm", combine, ye)                   # (G, S, D)


class MoELM(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, tokens):  # (G, S) int32
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, name="wte")(tokens)              # (G, S, D)
        for i in range(c.layers):
            x = x + MoE(c, name=f"layer_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
        return nn.Dense(c.vocab, use_bias=False, name="lm_head")(x)      # (G, S, V)


def make_train_step(cfg: MoEConfig, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is a dict of params and adamw state."""
    model = MoELM(cfg)
    tx = optax.adamw(lr, weight_decay=0.01)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"])          # (G, S, V)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    train_step = adamw_step(loss_fn, tx)

    @functools.partial(jax.jit, static_argnums=1)   # one program, not one per initialiser op
    def init_state(rng, groups: int):
        params = model.init(rng, jnp.zeros((groups, cfg.seq), jnp.int32))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    return train_step, init_state


def make_batch(cfg: MoEConfig, groups: int, seed: int = 0):
    return token_batch(cfg.vocab, cfg.seq, groups, seed)


def concrete(cfg: MoEConfig, groups: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    return concrete_of(make_train_step, make_batch, cfg, groups, seed)


def abstract(cfg: MoEConfig, groups: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    return abstract_of(make_train_step, make_batch, cfg, groups)

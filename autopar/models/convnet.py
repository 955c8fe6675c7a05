"""A small flax linen conv net with BatchNorm (batch_stats in the state) and adamw.

Shapes in comments: B batch, S image side, C channels, K classes.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    side: int = 16
    channels: tuple[int, ...] = (8, 16)
    classes: int = 10
    in_channels: int = 3


class ConvNet(nn.Module):
    cfg: ConvConfig

    @nn.compact
    def __call__(self, x, train: bool = True):  # (B, S, S, C_in)
        for i, c in enumerate(self.cfg.channels):
            x = nn.Conv(c, (3, 3), padding="SAME", use_bias=False, name=f"conv_{i}")(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn_{i}")(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))  # (B, S/2, S/2, C)
        x = x.mean(axis=(1, 2))                                    # (B, C)
        return nn.Dense(self.cfg.classes, name="head")(x)          # (B, K)


def make_train_step(cfg: ConvConfig, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state holds params, batch_stats and adamw state."""
    model = ConvNet(cfg)
    tx = optax.adamw(lr, weight_decay=0.01)

    def loss_fn(params, batch_stats, batch):
        logits, new_vars = model.apply({"params": params, "batch_stats": batch_stats},
                                       batch["image"], mutable=["batch_stats"])
        labels = jax.nn.one_hot(batch["label"], cfg.classes)
        return optax.softmax_cross_entropy(logits, labels).mean(), new_vars["batch_stats"]

    def train_step(state, batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, stats), grads = grad_fn(state["params"], state["batch_stats"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "batch_stats": stats,
                "opt_state": opt_state}, loss

    @functools.partial(jax.jit, static_argnums=1)   # one program, not one per initialiser op
    def init_state(rng, batch_size: int):
        image = jnp.zeros((batch_size, cfg.side, cfg.side, cfg.in_channels))
        variables = model.init(rng, image)
        params = variables["params"]
        return {"params": params, "batch_stats": variables["batch_stats"],
                "opt_state": tx.init(params)}

    return train_step, init_state


def make_batch(cfg: ConvConfig, batch_size: int, seed: int = 0):
    ki, kl = jax.random.split(jax.random.PRNGKey(seed))
    return {"image": jax.random.normal(ki, (batch_size, cfg.side, cfg.side, cfg.in_channels)),
            "label": jax.random.randint(kl, (batch_size,), 0, cfg.classes, jnp.int32)}


def concrete(cfg: ConvConfig, batch_size: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    step, init = make_train_step(cfg)
    return step, init(jax.random.PRNGKey(seed), batch_size), make_batch(cfg, batch_size, seed)


def abstract(cfg: ConvConfig, batch_size: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    step, init = make_train_step(cfg)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), batch_size))
    return step, state, jax.eval_shape(lambda: make_batch(cfg, batch_size))

"""A flax linen MLP regressor with an optax adamw training step.

Shapes in comments: B batch, I input width, H hidden width, L hidden layers.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.models import abstract_of, adamw_step, concrete_of


class MLP(nn.Module):
    hidden: int
    layers: int
    d_out: int

    @nn.compact
    def __call__(self, x):  # (B, I)
        for i in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden, name=f"layer_{i}")(x))  # (B, H)
        return nn.Dense(self.d_out, name="head")(x)                    # (B, O)


def make_train_step(d_in: int, hidden: int, layers: int, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is a dict of params and adamw state."""
    model = MLP(hidden, layers, d_in)
    tx = optax.adamw(lr, weight_decay=0.01)

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"])  # (B, I)
        return jnp.mean((pred - batch["y"]) ** 2)

    train_step = adamw_step(loss_fn, tx)

    @functools.partial(jax.jit, static_argnums=1)   # one program, not one per initialiser op
    def init_state(rng, batch_size: int):
        params = model.init(rng, jnp.zeros((batch_size, d_in)))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    return train_step, init_state


def make_batch(d_in: int, batch_size: int, seed: int = 0):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return {"x": jax.random.normal(kx, (batch_size, d_in)),
            "y": jax.random.normal(ky, (batch_size, d_in))}


def make(d_in: int, hidden: int, layers: int, batch: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    return concrete_of(make_train_step, make_batch, (d_in, hidden, layers), batch, seed)


concrete = make


def abstract(d_in: int, hidden: int, layers: int, batch: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    return abstract_of(make_train_step, make_batch, (d_in, hidden, layers), batch)

"""A flax nnx MLP trained with optax adamw through a functional step on state pytrees.

The graphdef is closed over; the step takes and returns plain pytrees ``(params, opt_state)``,
which is what a planner needs (``nnx.split`` / ``nnx.merge`` around the model call).
Shapes in comments: B batch, I input width, H hidden width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from autopar.models import adamw_step
from autopar.models.mlp import make_batch  # same regression batch as the linen MLP


class MLP(nnx.Module):
    def __init__(self, d_in: int, hidden: int, layers: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(d_in if i == 0 else hidden, hidden, rngs=rngs)
                                for i in range(layers)])
        self.head = nnx.Linear(hidden, d_in, rngs=rngs)

    def __call__(self, x):  # (B, I)
        for layer in self.layers:
            x = nnx.relu(layer(x))  # (B, H)
        return self.head(x)         # (B, I)


def make_train_step(d_in: int, hidden: int, layers: int, lr: float = 1e-3):
    """Returns ``(train_step, init_state)``; state is ``{"params", "opt_state"}``."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLP(d_in, hidden, layers, rngs=nnx.Rngs(0))))
    tx = optax.adamw(lr, weight_decay=0.01)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    train_step = adamw_step(loss_fn, tx)

    def init_state(seed: int = 0):
        _, params = nnx.split(MLP(d_in, hidden, layers, rngs=nnx.Rngs(seed)))
        return {"params": params, "opt_state": tx.init(params)}

    return train_step, init_state


def concrete(d_in: int, hidden: int, layers: int, batch: int, seed: int = 0):
    """Small real model: ``(train_step, state, batch)`` with random weights."""
    step, init = make_train_step(d_in, hidden, layers)
    return step, init(seed), make_batch(d_in, batch, seed)


def abstract(d_in: int, hidden: int, layers: int, batch: int):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    step, init = make_train_step(d_in, hidden, layers)
    return step, jax.eval_shape(init), jax.eval_shape(lambda: make_batch(d_in, batch))

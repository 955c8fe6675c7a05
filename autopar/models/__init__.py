"""Reference models used by the demo, the benchmarks and the tests.

Every model is built from a config with random weights (no hub downloads). Each module offers
``make_*`` helpers that return ``(train_step, state, batch)`` either concrete (small configs, for
numerics) or abstract (``jax.ShapeDtypeStruct`` leaves, for planning large configs for free).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

# The model modules, imported on first use: ``autopar.models.mlp.make(...)`` works after
# ``import autopar`` alone, without importing every model (and transformers, for ``hf``) up front.
SUBMODULES = ("convnet", "gpt", "hf", "llama", "mlp", "moe", "nnx_mlp")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBMODULES))


def adamw_step(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """``train_step(state, batch) -> (state, loss)`` for ``state = {"params", "opt_state"}`` and
    ``loss_fn(params, batch)``: one optax step, the step every reference model trains with."""
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    return train_step


def token_batch(vocab: int, seq: int, rows: int, seed: int = 0) -> dict:
    """Random ``tokens`` and ``targets``, each (rows, seq) int32 below ``vocab``."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"tokens": jax.random.randint(k1, (rows, seq), 0, vocab, jnp.int32),
            "targets": jax.random.randint(k2, (rows, seq), 0, vocab, jnp.int32)}


def concrete_of(make_train_step: Callable, make_batch: Callable, cfg, rows: int, seed: int = 0):
    """``(train_step, state, batch)`` with random weights, from a model module's makers."""
    step, init = make_train_step(*cfg) if isinstance(cfg, tuple) else make_train_step(cfg)
    args = cfg if isinstance(cfg, tuple) else (cfg,)
    return step, init(jax.random.PRNGKey(seed), rows), make_batch(*args[:1], rows, seed)


def abstract_of(make_train_step: Callable, make_batch: Callable, cfg, rows: int):
    """The same as ``concrete_of`` as ShapeDtypeStruct pytrees: any size, no memory."""
    step, init = make_train_step(*cfg) if isinstance(cfg, tuple) else make_train_step(cfg)
    args = cfg if isinstance(cfg, tuple) else (cfg,)
    state = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), rows))
    return step, state, jax.eval_shape(lambda: make_batch(*args[:1], rows))

"""Models this project did not design: small language models written the way each library's own
documentation teaches them, for the zoo benchmark (``benchmarks/zoo.py``) and the tests that hold
the planner to its baselines on models it was not tuned to.

- ``nnx_lm``: a Flax NNX decoder (``nnx.Embed``, ``nnx.MultiHeadAttention``, ``nnx.LayerNorm``,
  ``nnx.Linear``), trained through ``nnx.split``/``nnx.merge`` with optax, as the NNX guides'
  functional train step does;
- ``linen_lm``: a Flax linen decoder annotated MaxText-style: parameters made with
  ``nn.with_logical_partitioning`` and activations constrained with
  ``nn.with_logical_constraint``, resolved by ``nn.logical_axis_rules`` (``RULES``); the user's
  own layout is ``linen_user_layout`` (what a plain ``jax.jit`` user passes as
  ``in_shardings``);
- ``eqx_lm``: an Equinox decoder (``eqx.nn.Embedding``, ``eqx.nn.MultiheadAttention``,
  ``eqx.nn.LayerNorm``, ``eqx.nn.Linear``) applied per example under ``jax.vmap``, trained with
  ``eqx.partition``/``eqx.combine``, as Equinox's examples do.

Each maker takes a ``Config`` and returns ``(train_step, state, batch)``: ``state`` a pytree of
arrays (concrete) or ``jax.ShapeDtypeStruct``s (``abstract=True``). ``accum`` > 1 accumulates
gradients over that many microbatches in a ``lax.scan`` inside the step; ``dtype=jnp.bfloat16``
computes in bf16 with float32 master weights (mixed precision).

Shapes in comments: B batch, S sequence, D model width, H heads, F MLP width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["RULES", "Config", "eqx_lm", "linen_lm", "linen_user_layout", "nnx_lm"]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 16
    width: int = 64
    heads: int = 4
    ff: int = 256
    layers: int = 2
    batch: int = 8
    accum: int = 1               # microbatches accumulated in a lax.scan inside the step
    dtype: Any = jnp.float32     # compute dtype; parameters stay float32
    remat: bool = False          # each block under the library's own remat (nnx.remat, nn.remat,
    #                              eqx.filter_checkpoint)
    lr: float = 1e-3


def _batch(cfg: Config, seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    shape = (cfg.batch, cfg.seq)
    return {"tokens": jax.random.randint(k1, shape, 0, cfg.vocab, jnp.int32),
            "targets": jax.random.randint(k2, shape, 0, cfg.vocab, jnp.int32)}


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


def _grads(loss_fn: Callable, params, batch, accum: int):
    """``(loss, grads)``; with ``accum`` > 1 the batch is cut into microbatches and their
    gradients are averaged in a ``lax.scan`` (the gradient-accumulation idiom)."""
    if accum == 1:
        return jax.value_and_grad(loss_fn)(params, batch)
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def body(carry, mb):
        loss, grads = jax.value_and_grad(loss_fn)(params, mb)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zero, micro)
    return loss / accum, jax.tree.map(lambda g: g / accum, grads)


def _optax_step(loss_fn: Callable, tx: optax.GradientTransformation, accum: int) -> Callable:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)``: the step optax's
    and flax's guides write (three arguments, not a state dict)."""
    def train_step(params, opt_state, batch):
        loss, grads = _grads(loss_fn, params, batch, accum)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def _finish(step, params, tx, cfg: Config, abstract: bool):
    if abstract:
        return step, params, jax.eval_shape(tx.init, params), jax.eval_shape(lambda: _batch(cfg))
    return step, params, tx.init(params), _batch(cfg)


# ----------------------------------------------------------------------------------- Flax NNX
def nnx_lm(cfg: Config = Config(), *, abstract: bool = False, seed: int = 0):
    """A Flax NNX decoder trained functionally (``nnx.split`` / ``nnx.merge``)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.width, decode=False, rngs=rngs,
                                               dtype=cfg.dtype)
            self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
            self.up = nnx.Linear(cfg.width, cfg.ff, rngs=rngs, dtype=cfg.dtype)
            self.down = nnx.Linear(cfg.ff, cfg.width, rngs=rngs, dtype=cfg.dtype)

        def __call__(self, x, mask):                                 # (B, S, D)
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))     # (B, S, D)

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.layers)])
            self.ln = nnx.LayerNorm(cfg.width, rngs=rngs)
            self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs, dtype=cfg.dtype)

        def __call__(self, tokens):                                  # (B, S)
            x = self.embed(tokens).astype(cfg.dtype)                 # (B, S, D)
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = (nnx.remat(type(block).__call__)(block, x, mask) if cfg.remat
                     else block(x, mask))
            return self.head(self.ln(x))                             # (B, S, V)

    make = (lambda: LM(nnx.Rngs(seed)))
    graphdef, params = nnx.split(nnx.eval_shape(make) if abstract else make(), nnx.Param)
    tx = optax.adamw(cfg.lr)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return _xent(model(batch["tokens"]), batch["targets"])

    return _finish(_optax_step(loss_fn, tx, cfg.accum), params, tx, cfg, abstract)


# ----------------------------------------------------------------- Flax linen, MaxText-style
# Logical axis -> mesh axis, as MaxText's base config writes them (its "fsdp" column dropped).
RULES = (("batch", "data"), ("length", None), ("embed", None), ("mlp", "model"),
         ("heads", "model"), ("kv", None), ("vocab", "model"))


def _linen_module(cfg: Config):
    import flax.linen as nn

    init = nn.initializers.normal(0.02)

    def param(mod, name, shape, names):
        return mod.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):                                       # (B, S, D)
            d, h = cfg.width, cfg.heads
            y = nn.LayerNorm(dtype=cfg.dtype)(x)
            wq = param(self, "wq", (d, h, d // h), ("embed", "heads", "kv"))
            wk = param(self, "wk", (d, h, d // h), ("embed", "heads", "kv"))
            wv = param(self, "wv", (d, h, d // h), ("embed", "heads", "kv"))
            wo = param(self, "wo", (h, d // h, d), ("heads", "kv", "embed"))
            q, k, v = (jnp.einsum("bsd,dhk->bshk", y, w.astype(cfg.dtype)) for w in (wq, wk, wv))
            q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
            s = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(d // h).astype(cfg.dtype)
            causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            p = jax.nn.softmax(jnp.where(causal, s, -1e9).astype(jnp.float32)).astype(cfg.dtype)
            a = jnp.einsum("bhqs,bshk->bqhk", p, v)                  # (B, S, H, D/H)
            x = x + jnp.einsum("bqhk,hkd->bqd", a, wo.astype(cfg.dtype))
            x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
            y = nn.LayerNorm(dtype=cfg.dtype)(x)
            w1 = param(self, "wi", (d, cfg.ff), ("embed", "mlp"))
            w2 = param(self, "wo_mlp", (cfg.ff, d), ("mlp", "embed"))
            y = nn.gelu(y @ w1.astype(cfg.dtype))                    # (B, S, F)
            y = nn.with_logical_constraint(y, ("batch", "length", "mlp"))
            return nn.with_logical_constraint(x + y @ w2.astype(cfg.dtype),
                                              ("batch", "length", "embed"))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):                                  # (B, S)
            table = param(self, "embedding", (cfg.vocab, cfg.width), ("vocab", "embed"))
            x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)    # (B, S, D)
            x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
            block = nn.remat(Block) if cfg.remat else Block
            for i in range(cfg.layers):
                x = block(name=f"layer_{i}")(x)
            x = nn.LayerNorm(dtype=cfg.dtype)(x)
            return x @ table.T.astype(cfg.dtype)                     # (B, S, V) tied embedding

    return LM()


def linen_lm(cfg: Config = Config(), *, abstract: bool = False, seed: int = 0):
    """A MaxText-style linen decoder: boxed parameters (``nn.Partitioned``) and logical
    constraints, traced under ``nn.logical_axis_rules(RULES)``."""
    import flax.linen as nn

    model = _linen_module(cfg)
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    init = functools.partial(model.init, jax.random.PRNGKey(seed), tokens)
    boxed = jax.eval_shape(init) if abstract else init()
    params = nn.unbox(boxed)["params"]
    tx = optax.adamw(cfg.lr)

    def loss_fn(params, batch):
        with nn.logical_axis_rules(rules_for(_mesh_axes())):
            return _xent(model.apply({"params": params}, batch["tokens"]), batch["targets"])

    return _finish(_optax_step(loss_fn, tx, cfg.accum), params, tx, cfg, abstract)


def rules_for(axes) -> tuple:
    """``RULES`` on a mesh with ``axes``: a logical axis whose mesh axis the mesh lacks stays
    whole (a MaxText user on a data-only mesh writes their rules so). No axes: ``RULES``."""
    if not axes:
        return RULES
    return tuple((name, axis if axis in axes else None) for name, axis in RULES)


def _mesh_axes() -> tuple:
    """The axis names of the mesh the step is traced under (``jax.set_mesh``), or ()."""
    try:
        return tuple(jax.sharding.get_abstract_mesh().axis_names)
    except Exception:  # noqa: BLE001 - no mesh API: the rules as written
        return ()


def linen_user_layout(cfg: Config, mesh) -> tuple:
    """The in_shardings a MaxText-style user passes to ``jax.jit`` for ``linen_lm``'s
    ``(params, opt_state, batch)``: parameters from their logical annotations under ``RULES``,
    optimizer state like its parameter, the batch's rows on ``data``."""
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    model = _linen_module(cfg)
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    specs = nn.get_partition_spec(boxed)["params"]
    params = nn.logical_to_mesh_sharding(specs, mesh, rules_for(mesh.axis_names))
    _, _, opt_abstract, _ = linen_lm(cfg, abstract=True)
    opt = optax.tree_map_params(optax.adamw(cfg.lr), lambda _, s: s, opt_abstract, params,
                                transform_non_params=lambda _: NamedSharding(mesh,
                                                                             PartitionSpec()),
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    return params, opt, {"tokens": rows, "targets": rows}


# ------------------------------------------------------------------------------------ Equinox
def eqx_lm(cfg: Config = Config(), *, abstract: bool = False, seed: int = 0):
    """An Equinox decoder, one example at a time under ``jax.vmap``, trained on the arrays that
    ``eqx.partition(model, eqx.is_array)`` leaves (the static half is closed over)."""
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1 = eqx.nn.LayerNorm(cfg.width)
            self.attn = eqx.nn.MultiheadAttention(cfg.heads, cfg.width, key=k1)
            self.ln2 = eqx.nn.LayerNorm(cfg.width)
            self.up = eqx.nn.Linear(cfg.width, cfg.ff, key=k2)
            self.down = eqx.nn.Linear(cfg.ff, cfg.width, key=k3)

        def __call__(self, x, mask):                                 # (S, D)
            y = jax.vmap(self.ln1)(x)
            x = x + self.attn(y, y, y, mask=mask)
            y = jax.vmap(self.ln2)(x)
            return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(y)

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, cfg.layers + 2)
            self.embed = eqx.nn.Embedding(cfg.vocab, cfg.width, key=keys[0])
            self.blocks = [Block(k) for k in keys[2:]]
            self.ln = eqx.nn.LayerNorm(cfg.width)
            self.head = eqx.nn.Linear(cfg.width, cfg.vocab, key=keys[1])

        def __call__(self, tokens):                                  # (S,)
            x = jax.vmap(self.embed)(tokens)                         # (S, D)
            mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
            for block in self.blocks:
                x = eqx.filter_checkpoint(block)(x, mask) if cfg.remat else block(x, mask)
            return jax.vmap(lambda t: self.head(self.ln(t)))(x)      # (S, V)

    make = (lambda: LM(jax.random.PRNGKey(seed)))
    model = eqx.filter_eval_shape(make) if abstract else make()
    # abstract: the arrays are ShapeDtypeStructs, which eqx.is_array does not take for arrays
    params, static = eqx.partition(model, lambda x: eqx.is_array(x) or isinstance(
        x, jax.ShapeDtypeStruct))
    tx = optax.adamw(cfg.lr)

    def loss_fn(params, batch):
        model = eqx.combine(jax.tree.map(lambda p: p.astype(cfg.dtype), params), static)
        return _xent(jax.vmap(model)(batch["tokens"]), batch["targets"])

    return _finish(_optax_step(loss_fn, tx, cfg.accum), params, tx, cfg, abstract)

"""A model as pipeline stages see it: an embedding, a stack of identical layers, a head and loss.

``StagedModel`` is what the pipelined step (``autopar.pipeline.runtime``) runs: the parameters
split into the stacked layers (a leading layer axis ``L``, as ``flax.linen.scan`` stacks them)
and the rest (embedding, head), and three pure functions over them. An unrolled model's numbered
layers are stacked into that layout (``autopar.pipeline.unrolled``). A step built with
``gpt_train_step`` (or ``autopar.pipeline.hf.gpt2_train_step``) carries its ``StagedModel``
(``staged_model_of``), which is how ``autopar.plan(..., pipeline=...)`` learns the layer
structure of a step; ``autopar.pipeline.derive`` cuts one out of any loss function over
numbered layers (the step is then that loss's optax step).

Shapes: ``b`` rows of one microbatch, ``S`` sequence, ``D`` model width.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import AutoparError

ATTRIBUTE = "__autopar_staged_model__"


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """``embed(rest, batch_mb) -> x`` (b, S, D); ``layer(layer_params, x) -> x``;
    ``head_loss(rest, x, batch_mb) -> scalar`` (the microbatch's mean loss); ``layers_key``: the
    key of the stacked layer parameters in the params dict; ``tx``: the optax optimizer."""

    embed: Callable
    layer: Callable
    head_loss: Callable
    layers_key: str
    num_layers: int
    tx: Any
    name: str = "model"
    # "module/param" -> the dim (after the layer axis) a tensor-parallel axis splits inside a
    # stage (Megatron-LM's layout); parameters not named stay whole on each stage.
    tensor_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # The key path of the stacked layers when they are not a top-level key (HF GPT-2's
    # ("transformer", "h")); () means (layers_key,).
    layers_path: tuple[str, ...] = ()
    # An unrolled model's ``autopar.pipeline.unrolled.Stacking``: how its numbered layers
    # stack; the pipelined step runs on the stacked layout. None: the params are stacked.
    stacking: Any = None
    # The user's own step after its ``autopar.value_and_grad`` (``autopar.pipeline.user``):
    # ``post(state, batch, loss, grads) -> (state, loss)``, run where the runtimes otherwise run
    # ``tx``'s update. None: a declared step, updated by ``tx``.
    post: Any = None

    def _path(self) -> tuple[str, ...]:
        return self.layers_path or (self.layers_key,)

    def split(self, params: dict) -> tuple[Any, dict]:
        """(stacked layer params, the rest)."""
        return _pop(params, self._path())

    def join(self, layers, rest: dict) -> dict:
        return _put(rest, self._path(), layers)

    def loss(self, params: dict, batch: dict):
        """The unpipelined loss, for tests and the reference."""
        layers, rest = self.split(params)
        x = self.embed(rest, batch)
        x, _ = jax.lax.scan(lambda h, p: (self.layer(p, h), None), x, layers)
        return self.head_loss(rest, x, batch)


def _pop(tree: dict, path: tuple[str, ...]):
    head, *tail = path
    if not tail:
        return tree[head], {k: v for k, v in tree.items() if k != head}
    got, inner = _pop(tree[head], tuple(tail))
    return got, {**tree, head: inner}


def _put(tree: dict, path: tuple[str, ...], value) -> dict:
    head, *tail = path
    return {**tree, head: _put(tree[head], tuple(tail), value) if tail else value}


def key_names(path) -> tuple[str, ...]:
    """A jax key path (dict keys, attributes, indices) as strings."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def tensor_dim(tensor_dims: Mapping[str, int], keys) -> int | None:
    """The dim ``tensor_dims`` names for a parameter at path ``keys``: by its last three keys
    first ("mlp/c_proj/kernel"), then its last two ("fc1/kernel")."""
    keys = tuple(keys)
    return tensor_dims.get("/".join(keys[-3:]), tensor_dims.get("/".join(keys[-2:])))


def staged_model_of(step: Callable, args=None) -> StagedModel:
    """The ``StagedModel`` a step declares, or, given its ``args`` ``(state, batch)``, the one cut
    from its ``autopar.value_and_grad`` call (``autopar.pipeline.user``); else an
    ``AutoparError`` naming how to get one."""
    model = getattr(step, ATTRIBUTE, None)
    if model is None:
        from autopar.pipeline import user

        model = user.declared(step)
        if model is None and args is not None:
            model = user.staged(step, *args)
    if model is None:
        name = getattr(step, "__name__", type(step).__name__)
        raise AutoparError(
            f"pipeline= needs a step that declares its layers, and {name} does not: call "
            f"the loss as autopar.value_and_grad(loss_fn)(state['params'], batch) in place of "
            f"jax.value_and_grad (the step is then cut at that call), build it "
            f"from its loss with autopar.pipeline.derive.train_step(loss_fn, tx, params) "
            f"(stages cut from the loss's traced program, for a model that loops over "
            f"numbered layers), with autopar.pipeline.model.gpt_train_step(cfg) for "
            f"autopar's GPT, or attach a StagedModel with "
            f"autopar.pipeline.model.declare(step, model); a plain jax.grad or "
            f"jax.value_and_grad is not cut into stages")
    return model


def declare(step: Callable, model: StagedModel) -> Callable:
    setattr(step, ATTRIBUTE, model)
    return step


def gpt_staged(cfg, lr: float = 1e-3) -> StagedModel:
    """``StagedModel`` of autopar's GPT (``autopar.models.gpt``), with the adamw optimizer
    ``make_train_step`` uses; the same flax modules compute the same values. With
    ``scan=False`` its layers ``layer_0 ..`` are found in the params and stacked
    (``autopar.pipeline.unrolled``)."""
    import flax.linen as nn
    import optax

    from autopar.models import gpt

    block = gpt.Block(dataclasses.replace(cfg, scan=False))
    if cfg.remat:
        block = gpt.remat_block(gpt.Block, cfg.remat)(dataclasses.replace(cfg, scan=False))
    wte = nn.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype)
    ln_f = nn.LayerNorm(dtype=cfg.dtype)
    head = nn.Dense(cfg.vocab, use_bias=False, dtype=cfg.dtype)

    def embed(rest, batch):
        tokens = batch["tokens"]                                        # (b, S)
        x = wte.apply({"params": rest["wte"]}, tokens)                  # (b, S, D)
        return x + rest["wpe"][None, : tokens.shape[1]].astype(cfg.dtype)

    def layer(p, x):
        return block.apply({"params": p}, x)

    def head_loss(rest, x, batch):
        x = ln_f.apply({"params": rest["ln_f"]}, x)
        logits = head.apply({"params": rest["lm_head"]}, x)             # (b, S, V)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()

    tx = optax.adamw(lr, weight_decay=0.01)
    model = StagedModel(embed, layer, head_loss, "layers", cfg.layers, tx, name="gpt",
                        tensor_dims=MEGATRON_GPT)
    if cfg.scan:
        return model
    from autopar.pipeline.unrolled import unrolled

    tokens = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
    params = jax.eval_shape(gpt.GPT(cfg).init, jax.random.PRNGKey(0), tokens)["params"]
    return unrolled(model, params)


# Megatron-LM inside a stage: heads of qkv and out, the hidden dim of the MLP.
MEGATRON_GPT = {"qkv/kernel": 2, "out/kernel": 0, "fc1/kernel": 1, "fc1/bias": 0,
                "fc2/kernel": 0}


def gpt_train_step(cfg, lr: float = 1e-3):
    """``(train_step, init_state)`` of ``autopar.models.gpt.make_train_step`` with the step's
    ``StagedModel`` attached, so ``autopar.plan(step, ..., pipeline=...)`` can pipeline it.
    With ``scan=False`` the step and its state are the unrolled model's; the pipelined step
    runs on their stacked layout (``step.stack_state``)."""
    from autopar.models import gpt

    step, init = gpt.make_train_step(cfg, lr)
    return declare(step, gpt_staged(cfg, lr)), init

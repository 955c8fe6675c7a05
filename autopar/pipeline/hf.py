"""HF transformers' Flax GPT-2 as pipeline stages.

``gpt2_train_step(model_or_config)`` is ``autopar.models.hf``'s training step of
``FlaxGPT2LMHeadModel`` (called as its documentation shows, ``train=False``: no dropout) with a
``StagedModel`` attached: embed = ``wte`` + ``wpe``; layer = HF's own ``FlaxGPT2Block`` applied
to one layer's parameters (deterministic, the all-ones attention mask HF builds when none is
given, plus its causal mask); head = ``ln_f`` and the LM head tied to ``wte``; loss = the
step's next-token cross-entropy. The layers ``transformer/h/0 .. L-1`` are found in the params
and stacked (``autopar.pipeline.unrolled``): the pipelined step runs on the stacked layout.

Megatron-LM inside a stage (``tensor_dims``): HF's ``Conv1D`` stores kernels ``(out, in)``, so
the MLP's ``c_fc`` splits dim 0 and its ``c_proj`` dim 1. Attention stays whole inside a stage:
``c_attn`` fuses q, k and v on one ``3 D`` dim, and any split of attention (of that dim, or of
``attn/c_proj``'s input, which GSPMD propagates back to it) is not head-aligned in contiguous
pieces, so GSPMD reshards q, k, v with collective-permutes; inside the runtime's per-stage
``lax.switch`` branches those deadlock the CPU runtime when the stages take different branches
(observed on ``{stage: 2, data: 2, model: 2}``). Splitting attention needs a head-aligned
layout of ``c_attn`` (not done).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import AutoparError
from autopar.models import hf
from autopar.pipeline.model import StagedModel, declare
from autopar.pipeline.unrolled import unrolled

MEGATRON_GPT2 = {"mlp/c_fc/kernel": 0, "mlp/c_fc/bias": 0, "mlp/c_proj/kernel": 1}


def _model(model_or_config) -> Any:
    if hasattr(model_or_config, "module") and hasattr(model_or_config, "config"):
        model = model_or_config
    elif type(model_or_config).__name__ == "GPT2Config":
        model = hf.build("gpt2", model_or_config)
    else:
        model = model_or_config
    if type(model).__name__ != "FlaxGPT2LMHeadModel":
        raise AutoparError(f"autopar.pipeline.hf.gpt2_train_step takes a GPT2Config or a "
                           f"FlaxGPT2LMHeadModel; got {type(model).__name__}")
    return model


def gpt2_staged(model_or_config, lr: float = 1e-3) -> StagedModel:
    """The ``StagedModel`` of HF's ``FlaxGPT2LMHeadModel`` (a model or its ``GPT2Config``)."""
    import flax.linen as nn
    import optax
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    model = _model(model_or_config)
    cfg, dtype = model.config, model.dtype
    block = FlaxGPT2Block(cfg, dtype=dtype)
    wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    wpe = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
    ln_f = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype)
    lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype)

    def embed(rest, batch):
        ids = batch["inputs"]["input_ids"].astype("i4")                      # (b, S)
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1])[None], ids.shape)
        t = rest["transformer"]
        return (wte.apply({"params": t["wte"]}, ids)
                + wpe.apply({"params": t["wpe"]}, pos.astype("i4")))          # (b, S, D)

    def layer(p, x):
        mask = jnp.ones(x.shape[:2], "i4")            # what HF builds for attention_mask=None
        return block.apply({"params": p}, x, attention_mask=mask, deterministic=True)[0]

    def head_loss(rest, x, batch):
        t = rest["transformer"]
        x = ln_f.apply({"params": t["ln_f"]}, x)
        if cfg.tie_word_embeddings:
            kernel = t["wte"]["embedding"].T
        else:
            kernel = rest["lm_head"]["kernel"]
        logits = lm_head.apply({"params": {"kernel": kernel}}, x)             # (b, S, V)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1).mean()

    tx = optax.adamw(lr, weight_decay=0.01)
    staged = StagedModel(embed, layer, head_loss, "h", cfg.n_layer, tx, name="hf-gpt2",
                         tensor_dims=MEGATRON_GPT2)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), model.input_shape))
    return unrolled(staged, params)


def gpt2_train_step(model_or_config, lr: float = 1e-3):
    """``(train_step, init_state)``: ``autopar.models.hf``'s adamw step of HF's Flax GPT-2 with
    its ``StagedModel`` attached, and ``init_state(rng) -> {"params", "opt_state"}`` in HF's
    own (unrolled) layout, random weights."""
    model = _model(model_or_config)
    step, tx = hf.make_train_step(model, lr)

    def init_state(rng):
        params = model.init_weights(rng, model.input_shape)
        return {"params": params, "opt_state": tx.init(params)}

    return declare(step, gpt2_staged(model, lr)), init_state

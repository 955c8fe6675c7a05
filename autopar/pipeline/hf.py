"""HF transformers' Flax GPT-2 as pipeline stages.

``gpt2_train_step(model_or_config)`` is ``autopar.models.hf``'s training step of
``FlaxGPT2LMHeadModel`` (called as its documentation shows, ``train=False``: no dropout) with a
``StagedModel`` attached: embed = ``wte`` + ``wpe``; layer = the computation of HF's
``FlaxGPT2Block`` (deterministic, the all-ones attention mask HF builds when none is given,
plus its causal mask) on the stacked layout below; head = ``ln_f`` and the LM head tied to
``wte``; loss = the step's next-token cross-entropy. The layers ``transformer/h/0 .. L-1`` are
found in the params and stacked (``autopar.pipeline.unrolled``): the pipelined step runs on the
stacked layout.

Megatron-LM inside a stage (``tensor_dims``, split over the tensor axis): each device holds
whole heads and a slice of the MLP's hidden units, so the stage's only tensor-axis collectives
are one all-reduce after each row-split projection (and one per column-split projection's input
gradient). HF's ``Conv1D`` stores kernels ``(out, in)`` and ``c_attn`` fuses q, k and v on one
``3 D`` dim: a contiguous split of it is not head-aligned (GSPMD then realigns q, k and v with
collective-permutes, which inside the runtime's per-stage ``lax.switch`` branches hang: on
XLA:CPU (jax 0.10) one collective-permute instruction carries the pairs of every group and its
rendezvous waits for every device named in them, including those of stages that took another
branch, whereas an all-reduce meets per replica group, here one stage's model group). So the
stacked layout holds ``c_attn``'s kernel as ``(3, H, Dh, D)``, its bias as ``(3, H, Dh)`` and
``attn/c_proj``'s kernel as ``(D, H, Dh)`` (row-major reshapes, undone by ``unstack_state``),
the staged layer computes attention from those shapes, and ``H`` is the split dim; the MLP's
``c_fc`` splits its hidden dim 0, its ``c_proj`` dim 1. Where the tensor axis's size does not
divide ``H`` (or the MLP's width), those parameters stay whole on each device of the stage.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import AutoparError
from autopar.models import hf
from autopar.pipeline.model import StagedModel, declare
from autopar.pipeline.unrolled import unrolled

# The dim (after the layer axis, in the stacked layout's shapes) the tensor axis splits.
MEGATRON_GPT2 = {"attn/c_attn/kernel": 1, "attn/c_attn/bias": 1, "attn/c_proj/kernel": 1,
                 "mlp/c_fc/kernel": 0, "mlp/c_fc/bias": 0, "mlp/c_proj/kernel": 1}


def stacked_views(cfg) -> dict:
    """The attention parameters' shapes in the stacked layout: heads their own dim."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    return {"attn/c_attn/kernel": (3, h, d // h, d), "attn/c_attn/bias": (3, h, d // h),
            "attn/c_proj/kernel": (d, h, d // h)}


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

    model = _model(model_or_config)
    cfg, dtype = model.config, model.dtype
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
    staged = StagedModel(embed, staged_layer(cfg, dtype), head_loss, "h", cfg.n_layer, tx,
                         name="hf-gpt2", tensor_dims=MEGATRON_GPT2)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), model.input_shape))
    return unrolled(staged, params, views=stacked_views(cfg))


def staged_layer(cfg, dtype):
    """``layer(p, x)``: ``FlaxGPT2Block`` (deterministic, no padding) on one layer's parameters
    in the stacked layout (``stacked_views``): the same operations as HF's modules, with q, k
    and v taken from the head-major ``c_attn`` without a reshape of the fused dim."""
    import flax.linen as nn
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2MLP

    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.hidden_size
    ln_1 = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype)
    ln_2 = nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=dtype)
    mlp = FlaxGPT2MLP(cfg, inner, dtype=dtype)

    def layer(p, x):
        x = x + _attention(p["attn"], ln_1.apply({"params": p["ln_1"]}, x), dtype)
        h = ln_2.apply({"params": p["ln_2"]}, x)
        return x + mlp.apply({"params": p["mlp"]}, h, deterministic=True)

    return layer


def _attention(p, x, dtype):
    """HF's causal self-attention of ``x`` (b, S, D), kernels ``(3, H, Dh, D)`` and
    ``(D, H, Dh)``: each head's q, k, v and output rows are whole on the device holding it."""
    from flax.linen.attention import dot_product_attention_weights

    x = jnp.asarray(x, dtype)
    w_qkv, b_qkv = (jnp.asarray(p["c_attn"][k], dtype) for k in ("kernel", "bias"))
    qkv = jnp.einsum("bsd,thed->tbshe", x, w_qkv) + b_qkv[:, None, None]     # (3, b, S, H, Dh)
    s = x.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))[None, None]                     # (1, 1, S, S)
    bias = jnp.where(causal, jnp.zeros((), dtype), jnp.finfo(dtype).min).astype(dtype)
    weights = dot_product_attention_weights(qkv[0], qkv[1], bias=bias, deterministic=True,
                                            dtype=dtype)                      # (b, H, S, S)
    heads = jnp.einsum("...hqk,...khd->...qhd", weights, qkv[2])               # (b, S, H, Dh)
    w_out = jnp.asarray(p["c_proj"]["kernel"], dtype)
    return jnp.einsum("bshe,ohe->bso", heads, w_out) + jnp.asarray(p["c_proj"]["bias"], dtype)


def gpt2_train_step(model_or_config, lr: float = 1e-3):
    """``(train_step, init_state)``: ``autopar.models.hf``'s adamw step of HF's Flax GPT-2 with
    its ``StagedModel`` attached, and ``init_state(rng) -> {"params", "opt_state"}`` in HF's
    own (unrolled) layout, random weights."""
    model = _model(model_or_config)
    step, tx = hf.make_train_step(model, lr)

    @jax.jit                  # one program, not one per initialiser op
    def init_state(rng):
        params = model.init_weights(rng, model.input_shape)
        return {"params": params, "opt_state": tx.init(params)}

    return declare(step, gpt2_staged(model, lr)), init_state

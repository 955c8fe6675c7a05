"""Third-party models: HF transformers Flax models in an optax adamw training step.

A user's model is rarely one autopar wrote: these are the transformers library's own Flax models
(transformers 4.x; version 5 dropped Flax), built from a config with random weights (nothing is
downloaded: set ``HF_HUB_OFFLINE=1``), called as their documentation shows
(``model(**inputs, params=params, train=False).logits``), and trained with the same adamw step as
``autopar.models``. Their parameters are named ``h/0/attn/c_attn`` (GPT-2),
``layers/0/self_attn/q_proj`` (Llama), ``encoder/block/0/layer/0/SelfAttention/q`` (T5), ...;
their layers are unrolled Python loops.

    step, state, batch = hf.concrete("gpt2", hf.tiny("gpt2"), batch_size=8)
    step, state, batch = hf.abstract("gpt2", hf.gpt2_config(layers=96, width=12288), 64)

Shapes in comments: B batch, S sequence, V vocabulary, L labels.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from autopar.models import adamw_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build and feed one model family: its classes and its batch."""

    model: str           # the transformers Flax class, e.g. "FlaxGPT2LMHeadModel"
    config: str          # its config class, e.g. "GPT2Config"
    batch: str           # "causal", "masked", "seq2seq", "image" or "audio"


FAMILIES: dict[str, Family] = {
    "gpt2": Family("FlaxGPT2LMHeadModel", "GPT2Config", "causal"),
    "llama": Family("FlaxLlamaForCausalLM", "LlamaConfig", "causal"),
    "mistral": Family("FlaxMistralForCausalLM", "MistralConfig", "causal"),
    "gemma": Family("FlaxGemmaForCausalLM", "GemmaConfig", "causal"),
    "bert": Family("FlaxBertForMaskedLM", "BertConfig", "masked"),
    "t5": Family("FlaxT5ForConditionalGeneration", "T5Config", "seq2seq"),
    "bart": Family("FlaxBartForConditionalGeneration", "BartConfig", "seq2seq"),
    "vit": Family("FlaxViTForImageClassification", "ViTConfig", "image"),
    "whisper": Family("FlaxWhisperForConditionalGeneration", "WhisperConfig", "audio"),
}

SEQ = 16          # tokens per sequence in the tiny configs' batches


def _transformers():
    try:
        import transformers
    except ImportError as e:   # an optional dependency: say how to get it
        raise ImportError("autopar.models.hf needs transformers 4.x with its Flax models: "
                          "pip install 'transformers>=4.40,<5' (part of autopar's dev extra)"
                          ) from e
    return transformers


def tiny(name: str, layers: int = 2, width: int = 64, kv_heads: int | None = None) -> Any:
    """A small config of family ``name``: ``layers`` layers, ``width`` hidden units, vocabulary
    128, 4 heads (Llama, Mistral, Gemma: ``kv_heads`` key/value heads, default 4, 2 and 1:
    multi-head, grouped- and multi-query attention), MLP 2x wider, float32. Mistral's sliding
    window is 4 tokens (shorter than ``SEQ``, so its mask is not causal)."""
    tf = _transformers()
    cfg_cls = getattr(tf, FAMILIES[name].config)
    heads, ff, vocab = 4, 2 * width, 128
    common = dict(vocab_size=vocab)
    decoder = dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                   intermediate_size=ff, max_position_embeddings=64)
    kwargs = {
        "gpt2": dict(n_layer=layers, n_embd=width, n_head=heads, n_positions=64, n_inner=ff),
        "llama": dict(decoder, num_key_value_heads=kv_heads or heads),
        "mistral": dict(decoder, num_key_value_heads=kv_heads or 2, sliding_window=4),
        "gemma": dict(decoder, num_key_value_heads=kv_heads or 1, head_dim=width // heads),
        "bert": dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                     intermediate_size=ff, max_position_embeddings=64),
        "t5": dict(num_layers=layers, num_decoder_layers=layers, d_model=width, num_heads=heads,
                   d_kv=width // heads, d_ff=ff),
        "bart": dict(encoder_layers=layers, decoder_layers=layers, d_model=width,
                     encoder_attention_heads=heads, decoder_attention_heads=heads,
                     encoder_ffn_dim=ff, decoder_ffn_dim=ff, max_position_embeddings=64),
        "vit": dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                    intermediate_size=ff, image_size=32, patch_size=8, num_channels=3,
                    num_labels=10),
        "whisper": dict(encoder_layers=layers, decoder_layers=layers, d_model=width,
                        encoder_attention_heads=heads, decoder_attention_heads=heads,
                        encoder_ffn_dim=ff, decoder_ffn_dim=ff, num_mel_bins=16,
                        max_source_positions=SEQ, max_target_positions=64),
    }[name]
    if name == "vit":
        common = {}
    return cfg_cls(**common, **kwargs)


def gpt2_config(layers: int, width: int, heads: int | None = None, vocab: int = 51200,
                positions: int = 2048) -> Any:
    """A GPT-2 config at any size (e.g. GPT-3 175B: 96 layers, width 12288, 96 heads)."""
    return _transformers().GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads or max(width // 128, 1), vocab_size=vocab,
        n_positions=positions)


class _JnpWithOldClip:
    """``jax.numpy`` as transformers' Flax T5 expects it: its relative-position buckets call
    ``jnp.clip(x, a_max=...)``, keywords that this jax removed (``min``/``max`` now). Every other
    name is jax.numpy's own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jnp, name)

    @staticmethod
    def clip(x, min=None, max=None, *, a_min=None, a_max=None):
        return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)


def _old_clip_for(name: str) -> None:
    """Gives the T5 modules the keyword-compatible ``jnp`` when this jax lacks ``a_max``."""
    if name != "t5" or "a_max" in inspect.signature(jnp.clip).parameters:
        return
    module = importlib.import_module("transformers.models.t5.modeling_flax_t5")
    if not isinstance(module.jnp, _JnpWithOldClip):
        module.jnp = _JnpWithOldClip()


def build(name: str, config: Any, dtype=jnp.float32) -> Any:
    """The Flax model of family ``name`` for ``config``, without weights (``_do_init=False``)."""
    _old_clip_for(name)
    cls = getattr(_transformers(), FAMILIES[name].model)
    return cls(config, _do_init=False, dtype=dtype)


def make_batch(name: str, config: Any, rows: int, seq: int = SEQ, seed: int = 0,
               padding: bool = False) -> dict:
    """``{"inputs": model keyword arguments, "labels": int32}`` with random contents; with
    ``padding`` (causal families), an ``attention_mask`` that pads every other row after a
    random length of at least half the sequence."""
    kind = FAMILIES[name].batch
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    vocab = getattr(config, "vocab_size", 0)
    if kind == "image":
        size, ch = config.image_size, config.num_channels
        pixels = jax.random.normal(k1, (rows, ch, size, size), jnp.float32)   # (B, C, H, W)
        labels = jax.random.randint(k2, (rows,), 0, config.num_labels, jnp.int32)
        return {"inputs": {"pixel_values": pixels}, "labels": labels}
    tokens = jax.random.randint(k1, (rows, seq), 0, vocab, jnp.int32)          # (B, S)
    labels = jax.random.randint(k2, (rows, seq), 0, vocab, jnp.int32)
    if kind == "audio":   # log-mel features: (B, mels, 2 * max_source_positions)
        feats = jax.random.normal(k1, (rows, config.num_mel_bins,
                                       2 * config.max_source_positions), jnp.float32)
        return {"inputs": {"input_features": feats, "decoder_input_ids": tokens},
                "labels": labels}
    if kind == "seq2seq":
        return {"inputs": {"input_ids": tokens, "decoder_input_ids": labels}, "labels": labels}
    if padding:
        lengths = jax.random.randint(k2, (rows,), seq // 2, seq)
        lengths = jnp.where(jnp.arange(rows) % 2 == 1, lengths, seq)
        mask = (jnp.arange(seq)[None] < lengths[:, None]).astype(jnp.int32)   # (B, S)
        return {"inputs": {"input_ids": tokens, "attention_mask": mask}, "labels": labels}
    return {"inputs": {"input_ids": tokens}, "labels": labels}


def make_train_step(model: Any, lr: float = 1e-3, clip: float | None = None,
                    remat: bool = False) -> tuple[Callable, optax.GradientTransformation]:
    """``train_step(state, batch) -> (state, loss)``: cross-entropy of the logits against the
    labels, one adamw step, after clipping the gradients' global norm to ``clip`` if given;
    with ``remat`` the loss is under ``jax.checkpoint`` (its forward recomputed for the
    backward: what a user writes for a Flax model without gradient checkpointing, as
    transformers' Llama and GPT-2 are)."""
    tx = optax.adamw(lr, weight_decay=0.01)
    if clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)

    def loss_fn(params, batch):
        logits = model(**batch["inputs"], params=params, train=False).logits   # (B, S, V)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1).mean()

    return adamw_step(jax.checkpoint(loss_fn) if remat else loss_fn, tx), tx


def _params(model: Any, seed: int) -> Any:
    return model.init_weights(jax.random.PRNGKey(seed), model.input_shape)


def _init_state(model: Any, tx: optax.GradientTransformation, seed: int) -> dict:
    """Random weights and the optimizer's state, made by one compiled program: run op by op,
    transformers' initialisers compile one small program per parameter (seconds per model)."""
    def init(key):
        params = model.init_weights(key, model.input_shape)
        return {"params": params, "opt_state": tx.init(params)}
    return jax.jit(init)(jax.random.PRNGKey(seed))


def concrete(name: str, config: Any, batch_size: int, seed: int = 0, lr: float = 1e-3,
             clip: float | None = None, padding: bool = False, remat: bool = False):
    """Small real model: ``(train_step, state, batch)`` with random weights (``padding``,
    ``remat``: see ``make_batch``, ``make_train_step``)."""
    model = build(name, config)
    step, tx = make_train_step(model, lr, clip, remat)
    return step, _init_state(model, tx, seed), make_batch(name, config, batch_size, seed=seed,
                                                          padding=padding)


def abstract(name: str, config: Any, batch_size: int, seq: int = SEQ, dtype=jnp.float32,
             clip: float | None = None, padding: bool = False, remat: bool = False):
    """Any size, no memory: ``(train_step, state, batch)`` as ShapeDtypeStruct pytrees."""
    model = build(name, config, dtype)
    step, tx = make_train_step(model, clip=clip, remat=remat)
    params = jax.eval_shape(lambda: _params(model, 0))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    return step, state, jax.eval_shape(lambda: make_batch(name, config, batch_size, seq,
                                                          padding=padding))
